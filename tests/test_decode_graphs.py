"""The decode-graph path (padded static inputs, trash slot, bucketed block tables) against HF.

On CPU the path runs without capture ("padded" mode): the inputs, padding and masks are the ones a CUDA
graph replays on GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import GEMMA2, graph_chunks, hf_greedy, record_steps

from tp_runtime import LLM, SamplingParams
from tp_runtime.worker import inputs as inputs_module
from tp_runtime.worker.cuda_graphs import DecodeGraphs, batch_buckets, block_buckets
from tp_runtime.worker.inputs import InputBuilder, MixedStepBatch, _Layout


def test_buckets_cover_every_size() -> None:
    for max_batch in (1, 3, 16, 20, 256):
        sizes = batch_buckets(max_batch)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch
        assert all(any(s >= n for s in sizes) for n in range(1, max_batch + 1))
    for max_blocks in (1, 4, 5, 512, 513):
        for reads_padding in (True, False):
            sizes = block_buckets(max_blocks, reads_padding)
            assert sizes[-1] == max_blocks and sizes == sorted(set(sizes))
            assert all(any(s >= n for s in sizes) for n in range(1, max_blocks + 1))
            if not reads_padding:  # powers of two below the maximum
                assert all(s & (s - 1) == 0 for s in sizes[:-1])


@pytest.mark.parametrize(("kv_heads", "block_size", "max_blocks"), [(8, 16, 512), (1, 4, 37), (2, 32, 300)])
def test_graph_width_shares_graphs_only_between_equal_launches(
    kv_heads: int, block_size: int, max_blocks: int
) -> None:
    """With kernels that read only each row's length, a step's graph is the widest bucket with the same
    split-KV count: at least the step's width, one of the captured shapes, and the same launch (split
    count); with the gather path, the step's own bucket."""
    from tp_runtime.layers.attention import TorchAttention, TritonAttention

    feed = torch.zeros(64, dtype=torch.int64)
    triton = TritonAttention(kv_heads, block_size, num_sms=132, split_kv=True)
    graphs = DecodeGraphs(lambda *a: None, block_size, 64, max_blocks, 0, torch.device("cpu"), False, feed,  # type: ignore[arg-type,return-value]
                          triton)  # fmt: skip
    shapes = set(graphs.shapes())
    assert len(shapes) < len(graphs.batch_sizes) * len(graphs.block_sizes)  # graphs really are shared
    for n in range(1, 65):
        for blocks in range(1, max_blocks + 1):
            rows, bucket = graphs.padded_shape(n, blocks * block_size)
            width = graphs.graph_width(rows, bucket)
            assert width >= bucket and (rows, width) in shapes
            assert triton.num_decode_splits(rows, width) == triton.num_decode_splits(rows, bucket)
    gather = DecodeGraphs(lambda *a: None, block_size, 64, max_blocks, 0, torch.device("cpu"), False, feed,  # type: ignore[arg-type,return-value]
                          TorchAttention())  # fmt: skip
    assert all(gather.graph_width(r, b) == b for r in gather.batch_sizes for b in gather.block_sizes)


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 300, (length,), generator=gen).tolist() for length in (1, 7, 18, 33, 5)[:n]]


@pytest.mark.parametrize(
    ("arch", "overrides", "engine_args", "num_prompts"),
    [
        # 3 sequences pad to a batch bucket of 4; contexts cross block-bucket boundaries (4 -> 8 blocks).
        ("LlamaForCausalLM", {}, {"block_size": 4}, 3),
        ("MistralForCausalLM", {"sliding_window": 8}, {"block_size": 4}, 5),
        ("Qwen2ForCausalLM", {}, {}, 5),
        # Preemption and chunked prefill around padded decode steps.
        ("LlamaForCausalLM", {}, {"block_size": 4, "num_kv_blocks": 22, "max_num_batched_tokens": 9}, 5),
    ],
    ids=["llama-pad", "mistral-window", "qwen2", "llama-preempt"],
)
def test_padded_decode_matches_hf(
    make_checkpoint: Callable[..., Path], arch: str, overrides: dict[str, Any], engine_args: dict[str, Any],
    num_prompts: int,
) -> None:  # fmt: skip
    model_dir = make_checkpoint(arch, **overrides)
    prompts = _prompts(num_prompts)
    max_model_len = 64 if "num_kv_blocks" in engine_args else None
    with LLM(model_dir, device="cpu", dtype="float32", cuda_graphs="padded", max_model_len=max_model_len,
             **engine_args) as llm:  # fmt: skip
        graphs = llm.engine.executor.worker.runner.decode_graphs  # type: ignore[attr-defined]
        assert graphs is not None
        calls = []
        original = graphs.run
        graphs.run = lambda step: calls.append(len(step.input_ids)) or original(step)  # type: ignore[method-assign]
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
            use_tqdm=False,
        )
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dir, prompts, 20)
    assert calls and any(n not in batch_buckets(256) for n in calls)  # padding really happened



@pytest.mark.parametrize(
    ("arch", "overrides", "attn_implementation"),
    [
        ("LlamaForCausalLM", {"num_key_value_heads": 1}, None),  # MQA
        ("MistralForCausalLM", {"sliding_window": 5}, None),
        ("Gemma2ForCausalLM", GEMMA2, "eager"),  # windowed and soft-capped layers (SDPA drops the cap)
    ],
    ids=["llama-mqa", "mistral-window", "gemma2"],
)
def test_short_prefill_chunks_run_as_graph_rows(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, arch: str,
    overrides: dict[str, Any], attn_implementation: str | None,
) -> None:  # fmt: skip
    """Prompts chunked by a 16-token budget, beside decoding sequences: chunks within the key limit run a row
    per token on the decode-graph path, longer ones on the mixed-step graphs, and the tokens equal HF's
    either way."""
    monkeypatch.setattr(inputs_module, "GRAPH_PREFILL_MAX_KEYS", 150)
    model_dir = make_checkpoint(arch, **overrides)
    prompts = _prompts(5)
    with LLM(model_dir, device="cpu", dtype="float32", cuda_graphs="padded", block_size=4,
             max_num_batched_tokens=16) as llm:  # fmt: skip
        steps = record_steps(llm)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            use_tqdm=False,
        )
    chunks = [chunk for step in steps for chunk in graph_chunks(step)]
    mixed_prefills = [s for s in steps if isinstance(s.model, MixedStepBatch) and s.model.meta.prefills]
    # Fresh and continuation chunks, and chunks that do not finish their prompt, on the graph path.
    assert any(start == 0 for start, _ in chunks), chunks
    assert any(start > 0 for start, _ in chunks), chunks
    assert any(not samples for _, samples in chunks), chunks
    assert mixed_prefills, "no prefill chunk was too long for the decode-graph path"
    want = hf_greedy(model_dir, prompts, 12, attn_implementation=attn_implementation)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_graph_rows_equal_the_eager_path_when_sampling(make_checkpoint: Callable[..., Path]) -> None:
    """Seeded sampling with top-k/top-p, penalties, min_tokens and logprobs: the same tokens and logprobs
    whether short chunks run as decode-graph rows or eagerly (SDPA over the prompt's own keys)."""
    model_dir = make_checkpoint("LlamaForCausalLM")
    prompts = _prompts(5)
    options = dict(
        temperature=0.9, top_k=40, top_p=0.9, max_tokens=10, min_tokens=4, logprobs=2, presence_penalty=0.5,
        frequency_penalty=0.3, repetition_penalty=1.2,
    )  # fmt: skip
    params = [SamplingParams(seed=7 + i, **options) for i in range(len(prompts))]
    results, steps = {}, []
    for mode in ("off", "padded"):
        with LLM(model_dir, device="cpu", dtype="float32", cuda_graphs=mode, block_size=4,
                 max_num_batched_tokens=16) as llm:  # fmt: skip
            steps = record_steps(llm)
            results[mode] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert any(graph_chunks(step) for step in steps), "no chunk ran on the decode-graph path"
    for eager, graph in zip(results["off"], results["padded"], strict=True):
        want, got = eager.outputs[0], graph.outputs[0]
        assert got.token_ids == want.token_ids
        assert want.logprobs is not None and got.logprobs is not None
        for w, g in zip(want.logprobs, got.logprobs, strict=True):
            assert set(w) == set(g)
            assert all(abs(w[t].logprob - g[t].logprob) < 1e-4 for t in w)


def _layout(decode_lens: list[int], chunks: list[tuple[int, int]]) -> _Layout:
    """A step's layout: decoding sequences (context after the step), then (computed, tokens) chunks."""
    computed = np.array([n - 1 for n in decode_lens] + [c for c, _ in chunks], dtype=np.int64)
    n = np.array([1] * len(decode_lens) + [k for _, k in chunks], dtype=np.int64)
    ends = np.cumsum(n)
    starts = ends - n
    seq = np.repeat(np.arange(len(n)), n)
    positions = computed[seq] + np.arange(int(ends[-1])) - starts[seq]
    return _Layout(
        rows=np.arange(len(n)), n=n, num_decode=len(decode_lens), computed=computed, seq_lens=computed + n,
        starts=starts, ends=ends, token_rows=seq, positions=positions,
    )  # fmt: skip


def test_which_steps_with_chunks_the_graphs_take() -> None:
    """Short chunks only (tokens x (context + tokens) <= 16384), padded to at most 128 rows or the decode
    rows' own bucket, and never at the cost of the decode rows' split-KV programs (an H200's split rule)."""
    from tp_runtime.layers.attention import TritonAttention

    attention = TritonAttention(num_kv_heads=8, block_size=16, num_sms=132, split_kv=True)
    graphs = DecodeGraphs(
        lambda *args: torch.zeros(0), block_size=16, max_batch=256, max_blocks=2048, trash_slot=0,
        device=torch.device("cpu"), capture=False, token_feed=torch.zeros(256, dtype=torch.int64),
        attention=attention,
    )  # fmt: skip
    builder = InputBuilder.__new__(InputBuilder)
    builder.attention = attention

    def takes(decode_lens: list[int], chunks: list[tuple[int, int]]) -> bool:
        return builder._graphs_take(_layout(decode_lens, chunks), graphs)

    assert takes([], [(0, 32)]) and takes([], [(0, 128)]) and not takes([], [(0, 129)])
    assert takes([], [(1008, 16)]) and not takes([], [(1009, 16)])  # 16 x 1024 keys, then more
    assert takes([], [(0, 60), (0, 60)]) and not takes([], [(0, 70), (0, 70)])  # 120 rows, 140 rows
    assert takes([40] * 200, [(0, 5)])  # 205 rows: past 128, but in the decode rows' own bucket of 208
    assert not takes([40] * 100, [(0, 100)])  # 200 rows: past 128 and the decode rows' 112
    assert not takes([40] * 200, [(0, 40)])  # 240 rows: past both 128 and the decode rows' 208
    assert takes([4096] * 40, [(0, 8)])  # 48 rows at 4K keep the splits of the 40 decode rows
    assert not takes([32768], [(0, 31)])  # 32 rows would cut the 32K context from 32 splits to 2
    # The decode rows are held to the splits of their own shape, not to the chunk's longer context.
    assert takes([50], [(0, 100)]) and takes([20], [(1008, 16)])
    assert takes([40] * 256, [])  # a pure decode step of the largest bucket
    assert not takes([40] * 256, [(0, 2)])  # more rows than the largest graph
