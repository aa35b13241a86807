"""LLM.generate and LLM.chat called from several threads at once (the LLM serializes its callers).

Each thread's outputs must equal what the same call gives when made alone, and the engine must keep
serving afterwards, at TP=1 (in-process worker) and TP=2 (spawned workers).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import random_prompts

from tp_runtime import LLM, SamplingParams

VOCAB = 300
ROUNDS = 3
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def llm(request: pytest.FixtureRequest, make_checkpoint: Callable[..., Path]) -> Iterator[LLM]:
    engine = LLM(make_checkpoint(seed=8), tensor_parallel_size=request.param, dtype="float32", device="cpu",
                 max_num_seqs=8, max_num_batched_tokens=32)  # fmt: skip
    yield engine
    engine.shutdown()


def _jobs() -> list[Callable[[LLM], Any]]:
    """Four different calls: greedy, seeded sampling with n=2, penalties with stop strings, and chat."""
    p = random_prompts((7, 30, 3, 12, 21, 5), VOCAB, seed=41)

    def greedy(llm: LLM) -> Any:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
        return llm.generate([{"prompt_token_ids": x} for x in p[:3]], params, use_tqdm=False)

    def seeded(llm: LLM) -> Any:
        params = SamplingParams(temperature=0.9, top_p=0.9, seed=5, n=2, max_tokens=10, ignore_eos=True)
        return llm.generate([{"prompt_token_ids": x} for x in p[3:5]], params, use_tqdm=False)

    def penalized(llm: LLM) -> Any:
        params = SamplingParams(temperature=0, max_tokens=15, repetition_penalty=1.4, presence_penalty=0.5,
                                stop=["e", "a"], ignore_eos=True)  # fmt: skip
        return llm.generate(["Hello there, my friend", {"prompt_token_ids": p[5]}], params, use_tqdm=False)

    def chat(llm: LLM) -> Any:
        conv = [{"role": "user", "content": "What is the capital of France?"}]
        params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, prompt_logprobs=1)
        return llm.chat([conv, conv[:1]], params, chat_template=TEMPLATE, use_tqdm=False)

    return [greedy, seeded, penalized, chat]


def _summary(outputs: Any) -> list[Any]:
    """Everything a call returns; logprobs as (token id, logprob) lists, compared within 1e-5 (`_same`): a
    repeat finds its prompt's blocks in the prefix cache, whose float32 sums are rounded otherwise."""

    def lps(entries: Any) -> Any:
        return entries and [e and sorted((t, lp.logprob) for t, lp in e.items()) for e in entries]

    return [
        (o.prompt_token_ids, lps(o.prompt_logprobs), [(c.token_ids, c.text, c.finish_reason, lps(c.logprobs))
                                                      for c in o.outputs])
        for o in outputs
    ]  # fmt: skip


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, float):
        return isinstance(got, float) and abs(got - want) <= 1e-5
    if isinstance(want, (list, tuple)):
        return type(got) is type(want) and len(got) == len(want) and all(map(_same, got, want))
    return bool(got == want)


def test_concurrent_callers_each_get_their_own_outputs(llm: LLM) -> None:
    jobs = _jobs()
    alone = [_summary(job(llm)) for job in jobs]
    results: list[list[Any]] = [[] for _ in jobs]
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def run(i: int) -> None:
        try:
            start.wait()
            for _ in range(ROUNDS):
                results[i].append(_summary(jobs[i](llm)))
        except BaseException as exc:  # reported below, with the thread's job
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a generate call never returned"
    assert not errors, errors
    for i, job in enumerate(jobs):
        assert len(results[i]) == ROUNDS
        for got in results[i]:
            assert _same(got, alone[i]), f"thread {job.__name__} got different outputs than alone"
    # The engine still serves.
    assert _same(_summary(jobs[0](llm)), alone[0])
    assert not llm.engine.has_unfinished_requests()


def test_tp1_engine_leaves_the_host_programs_process_group(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """A TP=1 engine joins no process group, so shutting it down must not tear down one the program made
    for its own use (nor need one: the engine runs with or without it)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        engine = LLM(make_checkpoint(seed=8), dtype="float32", device="cpu", max_num_seqs=2)
        out = engine.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=3,
                              ignore_eos=True), use_tqdm=False)  # fmt: skip
        engine.shutdown()
        assert len(out[0].outputs[0].token_ids) == 3
        assert dist.is_initialized(), "the engine's shutdown destroyed the program's own process group"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_shutdown_from_another_thread_ends_a_tp1_generate_with_engine_closed() -> None:
    """LLM.shutdown() while another thread is inside generate() on an in-process (TP=1) engine: the call
    in progress ends with EngineClosedError, as at TP 2 (shutdown had dropped the weights under the running
    step: "internal: worker used before load_model()")."""
    from tp_runtime.errors import EngineClosedError

    llm = LLM("tiny-llama-tp", device="cpu", max_model_len=1024)
    executor = llm.engine.executor
    stepping, outcome = threading.Event(), {}
    submit = executor.submit

    def observed_submit(so: Any) -> None:
        stepping.set()
        submit(so)

    executor.submit = observed_submit  # type: ignore[method-assign]

    def generate() -> None:
        try:
            llm.generate(["x"] * 8, SamplingParams(max_tokens=1000, ignore_eos=True), use_tqdm=False)
            outcome["error"] = None
        except Exception as exc:
            outcome["error"] = exc

    caller = threading.Thread(target=generate)
    caller.start()
    assert stepping.wait(timeout=120)
    llm.shutdown()
    caller.join(timeout=120)
    assert isinstance(outcome["error"], EngineClosedError), outcome
    with pytest.raises(EngineClosedError):
        llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)
