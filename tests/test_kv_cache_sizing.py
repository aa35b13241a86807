"""The CPU KV cache's size: what the configuration can use, capped by a share of the available RAM."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import hf_greedy

from tp_runtime import LLM, SamplingParams
from tp_runtime.worker.kv_sizing import CPU_KV_CACHE_RAM_SHARE, available_memory_bytes, cpu_kv_cache_blocks
from tp_runtime.worker.model_runner import largest_prefill_chunks

GIB = 1 << 30
MIB = 1 << 20


def test_small_configurations_get_what_they_can_use() -> None:
    # 4 sequences of 8 blocks: 32 blocks, far below 10 % of 16 GiB.
    assert cpu_kv_cache_blocks(1 * MIB, 4, 8, 16 * GIB, 0.1, 1) == 32


def test_ram_share_caps_the_cache_and_ranks_split_it() -> None:
    # SmolLM2-135M in float32: 30 layers x 2 x 3 KV heads x 64 x 4 bytes x 16 tokens = 720 KiB per block;
    # 256 sequences of 8192 tokens would need 90 GiB.
    per_block = 30 * 2 * 3 * 64 * 4 * 16
    usable = 256 * 512
    one_rank = cpu_kv_cache_blocks(per_block, 256, 512, 16 * GIB, 0.1, 1)
    assert one_rank == int(16 * GIB * 0.1) // per_block < usable
    three_ranks = cpu_kv_cache_blocks(per_block, 256, 512, 16 * GIB, 0.1, 3)
    assert three_ranks == int(16 * GIB * 0.1 / 3) // per_block
    assert 3 * three_ranks * per_block <= 16 * GIB * 0.1  # the ranks of a host share the budget
    # A fixed size (cpu_kv_cache_gib=1): the whole GiB for this rank, still no more than usable.
    assert cpu_kv_cache_blocks(per_block, 256, 512, GIB, 1.0, 1) == GIB // per_block
    assert cpu_kv_cache_blocks(per_block, 1, 512, GIB, 1.0, 1) == 512


def test_at_least_one_block_even_without_memory() -> None:
    assert cpu_kv_cache_blocks(1 * MIB, 4, 8, 0, 0.1, 2) == 1
    assert cpu_kv_cache_blocks(1 * MIB, 4, 8, -5, 0.1, 2) == 1


@pytest.mark.parametrize(
    "args", [(0, 1, 1, GIB, 0.1, 1), (1, 0, 1, GIB, 0.1, 1), (1, 1, 0, GIB, 0.1, 1), (1, 1, 1, GIB, 0.0, 1),
             (1, 1, 1, GIB, 1.5, 1), (1, 1, 1, GIB, 0.1, 0)],
)  # fmt: skip
def test_bad_inputs_are_internal_errors(args: tuple[int, int, int, int, float, int]) -> None:
    with pytest.raises(ValueError, match="internal"):
        cpu_kv_cache_blocks(*args)


def test_available_memory_is_plausible() -> None:
    available = available_memory_bytes()
    assert 64 * MIB < available < 1 << 50
    assert 0.0 < CPU_KV_CACHE_RAM_SHARE <= 0.5


def test_memory_profile_runs_the_largest_step(make_checkpoint: Callable[..., Path]) -> None:
    """The GPU sizes its KV cache from a forward of the largest step the scheduler can give: prompts of
    max_model_len tokens filling max_num_batched_tokens (at most max_num_seqs of them, several in one
    attention batch). Its logits are a real forward's (HF's for the same prompt), and the engine's own cache
    is untouched by it."""
    assert largest_prefill_chunks(200, 8, 64) == [(0, 64), (64, 128), (128, 192), (192, 200)]
    assert largest_prefill_chunks(200, 2, 64) == [(0, 64), (64, 128)]
    assert largest_prefill_chunks(8192, 256, 32768) == [(0, 8192)]
    path = make_checkpoint()
    sizes = dict(max_model_len=64, max_num_batched_tokens=200, max_num_seqs=8)
    llm = LLM(path, device="cpu", dtype="float32", **sizes)
    try:
        prompt = [3, 17, 42, 5, 9]
        greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        before = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0].outputs[0].token_ids
        runner = llm.engine.executor.worker.runner  # type: ignore[attr-defined]
        logits = runner.run_largest_prefill()
        # As many rows as a step's logits take at once (the whole step here), the prompts all id 0: the
        # last 8 rows are the last prompt's, the 64 before them a full-length prompt's.
        assert logits.shape[0] == runner.logits_rows == 200
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            want = hf(torch.zeros(1, 64, dtype=torch.int64)).logits[0]
        torch.testing.assert_close(logits[-8:], want[:8], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits[-72:-8], want, rtol=1e-4, atol=1e-4)
        # Then what a step allocates after its forward: the sampler on max_num_seqs rows with every option
        # on (top-k 2 among them), max_logprobs (20) logprobs of the raw logits, the engine's noise untouched.
        noise_state = runner.sampler._engine_generator.get_state()
        sampled = runner.run_largest_sampling(logits)
        assert torch.equal(runner.sampler._engine_generator.get_state(), noise_state)
        top2 = logits[:8].topk(2, dim=-1).indices
        assert sampled.token_ids.shape == (8,)
        assert (top2 == sampled.token_ids.unsqueeze(1)).any(dim=1).all()
        raw = logits[:8].log_softmax(dim=-1)
        assert sampled.logprobs is not None and sampled.logprobs.shape == (8, 21)
        torch.testing.assert_close(sampled.logprobs[:, 1:], raw.topk(20, dim=-1).values)
        torch.testing.assert_close(sampled.logprobs[:, 0], raw[torch.arange(8), sampled.token_ids])
        after = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert after == before == hf_greedy(path, [prompt], 6, suppress_eos=True)[0]
    finally:
        llm.shutdown()


def test_memory_profile_holds_the_penalty_state_through_its_prefill(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The penalties' per-row token state, once made, lives beside every later prefill: the profile whose
    peak sizes the KV cache holds it through its prefill too, not only through its sampling."""
    import weakref

    from tp_runtime.worker import model_runner

    for name in ("reset_peak_memory_stats", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: 0)
    made: list[weakref.ref[Any]] = []
    real_state = model_runner.PenaltyState

    def tracked(*args: Any) -> Any:
        state = real_state(*args)
        made.append(weakref.ref(state))
        return state

    monkeypatch.setattr(model_runner, "PenaltyState", tracked)
    with LLM(make_checkpoint(), device="cpu", dtype="float32", max_model_len=64) as llm:
        runner = llm.engine.executor.worker.runner  # type: ignore[attr-defined]
        assert runner.batch.penalties is None  # no penalized request yet
        prefill, alive_in_prefill = runner.run_largest_prefill, []

        def watched_prefill() -> torch.Tensor:
            alive_in_prefill.append(sum(ref() is not None for ref in made))
            return prefill()

        monkeypatch.setattr(runner, "run_largest_prefill", watched_prefill)
        runner.profile_peak_memory()
    assert alive_in_prefill == [1] and len(made) == 1  # one state, made before the prefill, used by both


def test_a_gpu_with_no_room_left_says_what_took_it() -> None:
    """Llama-3-70B FP8 on an 80 GB card at the defaults: the sizing came out at -1449 blocks, which the
    worker then refused as a protocol error ("allocate_kv_cache needs a number of blocks >= 0")."""
    from tp_runtime.errors import ConfigError
    from tp_runtime.worker.kv_sizing import GpuMemoryPlan

    plan = GpuMemoryPlan(total=80 * GIB, share=0.9, weights=68 * GIB, peak=70 * GIB, reserve=3 * GIB)
    # 72 GiB allowed, 73 taken: one GiB short, in blocks of 512 MiB
    assert plan.blocks(512 * MIB) == -2
    assert GpuMemoryPlan(80 * GIB, 0.95, 68 * GIB, 70 * GIB, 3 * GIB).blocks(512 * MIB) == 6
    error = plan.no_room(rank=1)
    assert isinstance(error, ConfigError)
    for says in ("rank 1", "gives 72.00 GiB of the GPU's 80.00 GiB", "weights take 68.00 GiB",
                 "activations 2.00 GiB", "graphs 3.00 GiB", "outside PyTorch (the CUDA context, NCCL, other "
                 "processes) 0.00 GiB", "raise gpu_memory_utilization"):  # fmt: skip
        assert says in str(error)
    # What the card holds outside PyTorch's allocator comes off the share too.
    outside = GpuMemoryPlan(80 * GIB, 0.95, 68 * GIB, 70 * GIB, 3 * GIB, outside=GIB)
    assert outside.blocks(512 * MIB) == 4
    assert "other processes) 1.00 GiB" in str(outside.no_room(rank=0))


@pytest.mark.parametrize(
    ("tp", "seqs", "graphs"), [(1, 256, True), (2, 256, True), (1, 40, True), (1, 40, False)]
)
def test_decode_reserve_is_what_the_attention_path_holds(tp: int, seqs: int, graphs: bool) -> None:
    """Llama-3-8B's shape (sequences of 8192 tokens, 16-token blocks, 132 SMs). The gather path holds a
    full batch's keys and values of one layer in the model dtype; the Triton kernels read the blocks in
    place and hold only their split-KV partials (float32 sums, maxima and totals per split) for the widest
    batch a decode graph pads to that splits (one split writes its output directly); with CUDA graphs,
    both add the graphs' float32 logits of every row. At 40 sequences the widest is the 32-row batch, in
    two splits, not the 40-row one."""
    import types

    from tp_runtime.layers.attention import TorchAttention, TritonAttention
    from tp_runtime.layers.paged_decode_triton import choose_num_splits
    from tp_runtime.worker.model_runner import ModelRunner

    max_len, block, heads, kv_heads, head_dim, vocab, layers = 8192, 16, 32, 8, 128, 128256, 32
    kv_heads_here, heads_here = kv_heads // tp, heads // tp
    per_block = layers * 2 * block * kv_heads_here * head_dim * 2  # bf16 keys and values of every layer

    def reserve(attention: Any) -> int:
        runner = types.SimpleNamespace(
            attention=attention, max_blocks=max_len // block, kv_cache_dtype=torch.bfloat16,
            kv_bytes_per_block=lambda: per_block, model=types.SimpleNamespace(dtype=torch.bfloat16),
            _captures_graphs=lambda: graphs,
            config=types.SimpleNamespace(
                scheduler=types.SimpleNamespace(max_num_seqs=seqs),
                parallel=types.SimpleNamespace(tensor_parallel_size=tp),
                model=types.SimpleNamespace(
                    num_layers=layers, num_heads=heads, head_dim=head_dim, vocab_size=vocab
                ),
            ),
        )  # fmt: skip
        return ModelRunner.decode_reserve_bytes(runner)  # type: ignore[arg-type]

    logits = seqs * vocab * 4 if graphs else 0
    gather = reserve(TorchAttention())
    assert gather == seqs * max_len * 2 * kv_heads_here * head_dim * 2 + logits  # 8 GiB + logits at 256, TP 1
    triton = reserve(TritonAttention(kv_heads_here, block, num_sms=132, split_kv=True))
    # Every batch size, padded as the decode graphs pad it (16-row steps past 8), split as the kernels split
    # a batch whose longest row is max_model_len long.
    widest = 0
    for n in range(1, seqs + 1):
        padded = next(b for b in (1, 2, 4, 8, *range(16, seqs + 16, 16)) if b >= n)
        padded = min(padded, seqs)
        splits = choose_num_splits(padded, kv_heads_here, max_len // block, block, 132)
        if splits > 1:
            widest = max(widest, padded * heads_here * splits * (head_dim + 2) * 4)
    assert triton == widest + logits
    if seqs == 40 and tp == 1:
        assert widest == 32 * 2 * heads_here * (head_dim + 2) * 4
    assert triton < gather / 30
    assert reserve(TritonAttention(kv_heads_here, block, num_sms=132, split_kv=False)) == logits


def test_every_rank_stops_on_the_rank_with_no_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two GPU ranks sizing at once (stubbed), one of them without room: both raise a ConfigError after the
    agreed minimum; the rank without room says what took it, the other names that rank (the driver
    reports whichever comes first). With room on both, both get the smaller count."""
    import threading
    import types

    from tp_runtime.errors import ConfigError
    from tp_runtime.worker.worker import Worker

    def size(weights_gib: dict[int, int]) -> dict[int, Any]:
        barrier, offered, results = threading.Barrier(2), {}, {}

        def all_reduce_min_int(value: int, device: torch.device) -> int:
            offered[device.index] = value
            barrier.wait()
            return min(offered.values())

        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: weights_gib[d.index] * GIB)
        # The card holds what PyTorch's allocator reserves (the weights) and, on rank 1, 1 GiB besides
        # (its CUDA context, say).
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: weights_gib[d.index] * GIB)
        monkeypatch.setattr(
            torch.cuda, "mem_get_info", lambda d: ((80 - weights_gib[d.index] - d.index) * GIB, 80 * GIB)
        )

        def rank(r: int) -> None:
            runner = types.SimpleNamespace(
                kv_bytes_per_block=lambda: 512 * MIB, profile_peak_memory=lambda: (weights_gib[r] + 2) * GIB,
                decode_reserve_bytes=lambda: 3 * GIB, mixed_graph_pool_bytes=lambda activations: 0,
            )  # fmt: skip
            cache = types.SimpleNamespace(num_kv_blocks=None, gpu_memory_utilization=0.9, block_size=16)
            tp = types.SimpleNamespace(all_reduce_min_int=all_reduce_min_int)
            worker = types.SimpleNamespace(
                _runner=lambda: runner, config=types.SimpleNamespace(cache=cache), rank=r, world_size=2,
                device=torch.device("cuda", r), tp=tp, _report=lambda line: None,
            )  # fmt: skip
            try:
                results[r] = Worker.determine_num_kv_blocks(worker)  # type: ignore[arg-type]
            except ConfigError as exc:
                results[r] = exc

        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return results

    # 72 GiB allowed: 60 + 2 + 3 leaves 7 GiB (14 blocks); 67 + 2 + 3 + 1 outside is one GiB over (-2 blocks)
    results = size({0: 60, 1: 67})
    assert isinstance(results[0], ConfigError) and isinstance(results[1], ConfigError)
    assert "no room for a KV cache on rank 1's GPU" in str(results[0])
    assert "rank 1: gpu_memory_utilization=0.9 gives 72.00 GiB" in str(results[1])
    assert "other processes) 1.00 GiB" in str(results[1])
    assert size({0: 60, 1: 63}) == {0: 6, 1: 6}  # 63 + 2 + 3 + 1 leaves 3 GiB


@pytest.mark.parametrize("tp", [1, 2])
def test_a_kv_cache_too_large_to_allocate_is_a_config_error(tp: int) -> None:
    """num_kv_blocks past what can be allocated (here past any address space, so no overcommit policy can
    grant it): a ConfigError saying so, from every TP size (it was torch's allocator error, and at TP 2 a
    worker's traceback)."""
    from tp_runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"the KV cache of 2147483647 blocks of 4096 tokens .* could not be "
                       r"allocated .*lower num_kv_blocks"):  # fmt: skip
        LLM("tiny-llama-tp", device="cpu", tensor_parallel_size=tp, num_kv_blocks=2**31 - 1, block_size=4096)
