"""The decode-graph path (padded static inputs, trash slot, bucketed block tables) against HF.

On CPU the path runs without capture ("padded" mode): the inputs, padding and masks are the ones a CUDA
graph replays on GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import hf_greedy

from tp_runtime import LLM, SamplingParams
from tp_runtime.worker import inputs as inputs_module
from tp_runtime.worker.cuda_graphs import batch_buckets, block_buckets
from tp_runtime.worker.inputs import EagerBatch, GraphDecodeBatch


def test_buckets_cover_every_size() -> None:
    for max_batch in (1, 3, 16, 20, 256):
        sizes = batch_buckets(max_batch)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch
        assert all(any(s >= n for s in sizes) for n in range(1, max_batch + 1))
    for max_blocks in (1, 4, 5, 512, 513):
        sizes = block_buckets(max_blocks)
        assert sizes[-1] == max_blocks and sizes == sorted(set(sizes))


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


GEMMA2 = {
    "num_hidden_layers": 3, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 6,
    "attn_logit_softcapping": 20.0, "final_logit_softcapping": 10.0, "tie_word_embeddings": True,
}  # fmt: skip


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
    per token on the decode-graph path, longer ones eagerly, and the tokens equal HF's either way."""
    monkeypatch.setattr(inputs_module, "GRAPH_PREFILL_MAX_KEYS", 150)
    model_dir = make_checkpoint(arch, **overrides)
    prompts = _prompts(5)
    with LLM(model_dir, device="cpu", dtype="float32", cuda_graphs="padded", block_size=4,
             max_num_batched_tokens=16) as llm:  # fmt: skip
        builder = llm.engine.executor.worker.runner.inputs  # type: ignore[attr-defined]
        prepare, graph_prefill_rows, eager_prefills = builder.prepare, [], []

        def spy(so: Any) -> Any:
            step = prepare(so)
            if isinstance(step.model, GraphDecodeBatch):
                rows = step.model.batch_rows
                graph_prefill_rows.append(len(rows) - len(set(rows.tolist())))
            elif isinstance(step.model, EagerBatch) and step.model.meta.prefills:
                eager_prefills.append(len(step.model.meta.prefills))
            return step

        builder.prepare = spy
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            use_tqdm=False,
        )
    assert any(graph_prefill_rows), "no prefill chunk ran on the decode-graph path"
    assert eager_prefills, "no prefill chunk was too long for the decode-graph path"
    want = hf_greedy(model_dir, prompts, 12, attn_implementation=attn_implementation)
    assert [o.outputs[0].token_ids for o in outs] == want
