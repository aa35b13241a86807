"""SamplingParams(prompt_logprobs=k) against HF's log-softmax over the prompt.

As vLLM returns them: one entry per prompt token, None for the first; each a dict holding the prompt token
(with its rank) and the k most likely tokens, logprobs of the raw model output. Prompts prefill in chunks
over several steps (a 16-token budget), are preempted and recomputed mid-prefill, and run as rows of
decode-graph steps (1-token chunks beside decodes, and short chunks a row per token); at TP=1 and TP=2.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import graph_chunks, hf_greedy, random_prompts, record_steps

from tp_runtime import LLM, SamplingParams
from tp_runtime.outputs import Logprob
from tp_runtime.worker.inputs import GraphDecodeBatch

VOCAB = 300
SCHED = dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=22, max_model_len=48)
ENGINES = {
    "tp1": dict(tensor_parallel_size=1),
    "tp2": dict(tensor_parallel_size=2),
}


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(seed=4)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=list(ENGINES), ids=list(ENGINES))
def llm(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[LLM]:
    engine = LLM(model_dir, dtype="float32", device="cpu", **SCHED, **ENGINES[request.param])
    yield engine
    engine.shutdown()


def check(hf_model: Any, prompt: list[int], got: list[dict[int, Logprob] | None] | None, k: int) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)  # row i predicts i + 1
    for pos in range(1, len(prompt)):
        entry, row, token = got[pos], ref[pos - 1], prompt[pos]
        assert entry is not None
        top_lp, top_ids = row.topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert set(entry) == {token, *top_ids.tolist()}, f"position {pos}"
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4), f"position {pos}"
        assert entry[token].rank == int((row > row[token]).sum()) + 1, f"position {pos}"
        for rank, (tid, lp) in enumerate(zip(top_ids.tolist(), top_lp.tolist(), strict=True), start=1):
            assert entry[tid].logprob == pytest.approx(lp, abs=1e-4), f"position {pos}, token {tid}"
            assert tid == token or entry[tid].rank == rank
            assert entry[tid].decoded_token is not None


def test_prompt_logprobs_match_hf(llm: LLM, hf_model: Any, model_dir: Path) -> None:
    prompts = random_prompts((1, 2, 17, 30, 40, 9), VOCAB, seed=31)
    ks = [3, 0, 5, 2, 4, None]
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=k) for k in ks]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, k, out in zip(prompts, ks, outs, strict=True):
        if k is None:
            assert out.prompt_logprobs is None
        else:
            check(hf_model, prompt, out.prompt_logprobs, k)
    # Asking for prompt logprobs changes no generated token.
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dir, prompts, 5)


def test_prompt_logprobs_survive_preemption_mid_prefill(llm: LLM, hf_model: Any) -> None:
    prompts = random_prompts((40, 38, 36, 41), VOCAB, seed=32)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2, n=2)
    scheduler = llm.engine.scheduler
    preempt, mid_prefill = scheduler._preempt, []

    def spy(request: Any) -> None:
        mid_prefill.append(not request.output_token_ids)
        preempt(request)

    scheduler._preempt = spy  # type: ignore[method-assign]
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        del scheduler._preempt
    assert any(mid_prefill), "the test did not preempt a request during its prefill"
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.outputs) == 2
        check(hf_model, prompt, out.prompt_logprobs, 2)


def test_one_token_chunks_on_the_decode_graph_path(model_dir: Path, hf_model: Any) -> None:
    """A 4-token budget with three requests decoding leaves 1 token a step for a fourth prompt: its chunks
    then ride in pure-decode steps, which run on the (padded) decode-graph path."""
    engine = LLM(
        model_dir, dtype="float32", device="cpu", cuda_graphs="padded", max_num_batched_tokens=4,
        max_num_seqs=4, max_model_len=64,
    )  # fmt: skip
    steps = record_steps(engine)
    prompts = random_prompts((1, 1, 1, 20), VOCAB, seed=33)
    with engine:
        params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 3 + [
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
        ]
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    on_graph_path = [isinstance(i.model, GraphDecodeBatch) and i.prompt_logprobs is not None for i in steps]
    assert any(on_graph_path), "no prompt-logprob chunk ran on the decode-graph path"
    check(hf_model, prompts[3], outs[3].prompt_logprobs, 3)


def test_short_chunks_on_the_decode_graph_path(model_dir: Path, hf_model: Any) -> None:
    """Short prompts chunked by an 8-token budget run a row per token on the (padded) decode-graph path,
    fresh and continuation chunks alike; their prompt logprobs equal HF's."""
    engine = LLM(
        model_dir, dtype="float32", device="cpu", cuda_graphs="padded", max_num_batched_tokens=8,
        max_num_seqs=16, max_model_len=64,
    )  # fmt: skip
    steps = record_steps(engine)
    prompts = random_prompts((5, 13, 20), VOCAB, seed=35)
    with engine:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    chunk_starts = [start for i in steps if i.prompt_logprobs is not None for start, _ in graph_chunks(i)]
    assert 0 in chunk_starts and any(start > 0 for start in chunk_starts), chunk_starts
    for prompt, out in zip(prompts, outs, strict=True):
        check(hf_model, prompt, out.prompt_logprobs, 2)


def test_long_chunks_make_their_logits_in_slices(
    model_dir: Path, hf_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk's prompt-logprob logits are made `logits_rows` rows at a time (here 3, a short last slice
    included): the slices join in order and equal HF's."""
    from tp_runtime.worker import model_runner

    monkeypatch.setattr(model_runner, "MIN_LOGITS_ROWS", 1)
    calls: list[int] = []
    engine = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=32, max_num_seqs=3)
    runner = engine.engine.executor.worker.runner  # type: ignore[attr-defined]
    head = runner.model.compute_logits
    monkeypatch.setattr(runner.model, "compute_logits", lambda h: calls.append(len(h)) or head(h))
    prompts = random_prompts((30, 11), VOCAB, seed=35)
    with engine:
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert runner.logits_rows == 3 and max(calls) == 3 and 2 in calls
    for prompt, out in zip(prompts, outs, strict=True):
        check(hf_model, prompt, out.prompt_logprobs, 2)
