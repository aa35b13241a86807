"""Steps with prefill on the mixed-step graphs (worker/mixed_graphs.py), run in padded mode on CPU: the
same pieces, buffers and padding a GPU replays, with each layer's attention run between them.

- Staggered arrivals of many prompt lengths beside decoding sequences, for every attention variant (GQA,
  sliding window, Gemma 2's soft-cap and window, Qwen3's q/k norms, sparse experts), through chunked
  prefill and preemption, give HF transformers' greedy tokens at TP 1 and 2.
- Seeded sampling with logprobs and prompt logprobs gives the same tokens and logprobs as eager steps.
- Steps really ran there, padded to a bucket, with decode rows and prompt chunks together.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import GEMMA2, GEMMA3, assert_same_tokens, hf_greedy, random_prompts, record_steps

from tp_runtime import LLM, SamplingParams
from tp_runtime.worker.inputs import MixedStepBatch
from tp_runtime.worker.mixed_graphs import MIXED_GRAPH_MAX_TOKENS, token_buckets


def test_token_buckets_cover_every_size_with_bounded_padding() -> None:
    for max_tokens in (1, 15, 16, 17, 40, 100, 512, 1000, MIXED_GRAPH_MAX_TOKENS):
        sizes = token_buckets(max_tokens)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens, (max_tokens, sizes)
        for n in range(1, max_tokens + 1):
            bucket = next(s for s in sizes if s >= n)
            # At most 16 tokens or a quarter of the step up to 256 tokens, 32 up to 1024, 128 above.
            assert bucket - n <= (max(16, n // 4) if n <= 256 else 32 if n <= 1024 else 128), (n, bucket)


CASES: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "llama-gqa": ("LlamaForCausalLM", {}, None),
    "mistral-window": ("MistralForCausalLM", {"sliding_window": 8}, None),
    "gemma2": ("Gemma2ForCausalLM", GEMMA2, "eager"),  # HF's SDPA path drops the soft-cap
    "gemma3": ("Gemma3ForCausalLM", GEMMA3, None),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}, None),
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}, None),
}
# Chunks of up to 40 tokens pad to the buckets 16, 32 and 40; 20 blocks of 4 tokens is less than the
# requests hold together, so some are preempted and recomputed.
SCHED = dict(max_num_batched_tokens=40, max_num_seqs=4, block_size=4, num_kv_blocks=20, max_model_len=64)
LENGTHS = (23, 5, 37, 14, 30, 9, 41, 2, 18, 27)
ARRIVALS = (0, 0, 1, 3, 4, 4, 7, 9, 12, 15)  # the engine step each request arrives at
MAX_TOKENS = 12


def run_staggered(llm: LLM, prompts: list[list[int]], arrivals: tuple[int, ...]) -> list[list[int]]:
    """Greedy outputs of requests added to the engine at the given step numbers."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    waiting = sorted(zip(arrivals, range(len(prompts)), strict=True))
    index_of: dict[str, int] = {}
    outputs: dict[int, list[int]] = {}
    step = 0
    while waiting or engine.has_unfinished_requests():
        while waiting and waiting[0][0] <= step:
            _, i = waiting.pop(0)
            index_of[str(engine.add_request(prompts[i], params))] = i
        for out in engine.step():
            if out.finished:
                outputs[index_of[out.request_id]] = out.outputs[0].token_ids
        step += 1
    return [outputs[i] for i in range(len(prompts))]


@pytest.mark.parametrize("case", list(CASES))
def test_staggered_arrivals_on_mixed_graphs_match_hf(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    # Prompt chunks go to the mixed-step graphs, not one row per token on the decode graphs.
    monkeypatch.setattr("tp_runtime.worker.inputs.GRAPH_PREFILL_MAX_KEYS", 0)
    arch, overrides, attn = CASES[case]
    model_dir = make_checkpoint(arch, **overrides)
    prompts = random_prompts(LENGTHS, 300, seed=11)
    with LLM(model_dir, device="cpu", dtype="float32", seed=0, cuda_graphs="padded", **SCHED) as llm:
        steps = record_steps(llm)
        got = run_staggered(llm, prompts, ARRIVALS)
        preemptions = llm.engine.scheduler.num_preemptions
    assert_same_tokens(got, hf_greedy(model_dir, prompts, MAX_TOKENS, attn_implementation=attn), prompts)
    mixed = [s.model for s in steps if isinstance(s.model, MixedStepBatch)]
    buckets = token_buckets(SCHED["max_num_batched_tokens"])
    assert any(len(m.input_ids) not in buckets for m in mixed), "no mixed step was padded"
    assert any(m.meta.num_decode_tokens and m.meta.prefills for m in mixed), "no decodes beside a chunk"
    assert any(c.context_len > 0 for m in mixed for c in m.meta.prefills), "no continuation chunk"
    assert preemptions > 0


def test_mixed_graphs_at_tp2_match_hf(make_checkpoint: Callable[..., Path]) -> None:
    """Two worker processes (gloo), each replaying its shard's pieces: chunks longer than the decode
    graphs take (more than 128 rows) run as mixed steps, beside decoding sequences. Which path a step takes
    depends on its shape only, so the in-process TP=1 run of the same requests shows the mixed steps."""
    model_dir = make_checkpoint("LlamaForCausalLM")
    prompts = random_prompts((150, 7, 190, 60, 133), 300, seed=4)
    arrivals = (0, 0, 2, 5, 6)
    engine = dict(device="cpu", dtype="float32", seed=0, cuda_graphs="padded", max_num_batched_tokens=160,
                  max_num_seqs=3, block_size=8)  # fmt: skip
    with LLM(model_dir, tensor_parallel_size=2, **engine) as llm:  # type: ignore[arg-type]
        got = run_staggered(llm, prompts, arrivals)
    want = hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert_same_tokens(got, want, prompts)
    with LLM(model_dir, **engine) as llm:  # type: ignore[arg-type]
        steps = record_steps(llm)
        assert_same_tokens(run_staggered(llm, prompts, arrivals), want, prompts)
    assert any(isinstance(s.model, MixedStepBatch) and s.model.meta.num_decode_tokens for s in steps)


def test_static_bytes_counts_the_shared_buffers(make_checkpoint: Callable[..., Path]) -> None:
    """What the KV sizing keeps back for the pieces' shared buffers (MixedStepGraphs.static_bytes) is what
    they hold: inputs, q, k, v, attention output and hidden rows of the largest bucket."""
    from tp_runtime.worker.mixed_graphs import MixedStepGraphs

    model_dir = make_checkpoint("LlamaForCausalLM")
    for budget in (100, 4096):
        options: dict[str, Any] = {"cuda_graphs": "padded", "max_num_batched_tokens": budget}
        with LLM(model_dir, device="cpu", dtype="float32", **options) as llm:
            runner = llm.engine.executor.worker.runner  # type: ignore[attr-defined]
            graphs, mc = runner.mixed_graphs, runner.config.model
            held = sum(
                t.numel() * t.element_size()
                for t in (graphs._inputs, graphs._q, graphs._k, graphs._v, graphs._attn_out, graphs._hidden)
            )
            want = MixedStepGraphs.static_bytes(
                min(budget, MIXED_GRAPH_MAX_TOKENS), mc.hidden_size, mc.num_heads,
                runner.model.num_local_kv_heads, mc.head_dim, runner.model.dtype,
            )  # fmt: skip
            assert held == want, budget


def test_attention_warm_up_touches_no_sequence_block(make_checkpoint: Callable[..., Path]) -> None:
    """The start-up attention step (a decode row at every split count, a fresh prompt, a continuation
    chunk) writes only the trash block, even when max_model_len is under two blocks or layers window."""
    import torch

    for arch, overrides, engine in (
        ("LlamaForCausalLM", {}, {}),
        ("MistralForCausalLM", {"sliding_window": 4}, {"max_model_len": 8}),
        ("Gemma2ForCausalLM", GEMMA2, {"block_size": 4}),
    ):
        model_dir = make_checkpoint(arch, **overrides)
        with LLM(model_dir, device="cpu", dtype="float32", cuda_graphs="padded", **engine) as llm:  # type: ignore[arg-type]
            runner = llm.engine.executor.worker.runner  # type: ignore[attr-defined]
            for k, v in runner.kv_caches:
                k.normal_()
                v.normal_()
            before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
            runner._run_attention_warm_up()
            trash = runner.mixed_graphs.trash_slot // runner.block_size
            for (k0, v0), (k1, v1) in zip(before, runner.kv_caches, strict=True):
                assert torch.equal(k0[:trash], k1[:trash]) and torch.equal(v0[:trash], v1[:trash]), arch
                assert not torch.equal(k0[trash], k1[trash]), f"{arch}: the warm-up wrote nothing"


def test_sampling_and_prompt_logprobs_equal_eager_steps(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded sampling with penalties, logprobs and prompt logprobs: the same tokens and logprobs whether
    steps with prefill run as mixed-step graphs or eagerly."""
    monkeypatch.setattr("tp_runtime.worker.inputs.GRAPH_PREFILL_MAX_KEYS", 0)
    model_dir = make_checkpoint("LlamaForCausalLM")
    prompts = random_prompts((19, 33, 8, 26), 300, seed=9)
    options = dict(
        temperature=0.8, top_k=30, top_p=0.9, max_tokens=8, logprobs=2, prompt_logprobs=2,
        repetition_penalty=1.1, presence_penalty=0.3,
    )  # fmt: skip
    params = [SamplingParams(seed=3 + i, **options) for i in range(len(prompts))]
    results, kinds = {}, set()
    for mode in ("off", "padded"):
        with LLM(model_dir, device="cpu", dtype="float32", seed=0, cuda_graphs=mode, block_size=4,
                 max_num_batched_tokens=24, max_num_seqs=3) as llm:  # fmt: skip
            steps = record_steps(llm)
            results[mode] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            kinds |= {type(s.model).__name__ for s in steps} if mode == "padded" else set()
    assert "MixedStepBatch" in kinds
    for eager, mixed in zip(results["off"], results["padded"], strict=True):
        want, got = eager.outputs[0], mixed.outputs[0]
        assert got.token_ids == want.token_ids
        assert want.logprobs is not None and got.logprobs is not None
        for w, g in zip(want.logprobs, got.logprobs, strict=True):
            assert set(w) == set(g) and all(abs(w[t].logprob - g[t].logprob) < 1e-4 for t in w)
        assert eager.prompt_logprobs is not None and mixed.prompt_logprobs is not None
        for w, g in zip(eager.prompt_logprobs[1:], mixed.prompt_logprobs[1:], strict=True):
            assert w is not None and g is not None and set(w) == set(g)
            assert all(abs(w[t].logprob - g[t].logprob) < 1e-4 for t in w)
