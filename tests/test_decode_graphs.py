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
from tp_runtime.worker.cuda_graphs import batch_buckets, block_buckets


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
