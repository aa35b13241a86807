"""Authentic frames whose content is wrong: a step a rank cannot run safely, an output that does not fit
the step it answers. A frame must carry the engine's MAC to get this far, so only a broken (or
compromised) process of the engine sends one; the receiver must still refuse it with a ProtocolError
that says what is wrong, before any of it becomes a device index, and the engine must close cleanly.

- check_step (worker side), without processes: every kind of bad step is refused and leaves the
  persistent batch as it was; a legitimate sequence of steps passes.
- RemoteWorkers (driver side), without processes: an output naming a request the step did not run, a
  request twice, or a token outside the vocabulary is a ProtocolError.
- Spawned TP=2 engines on CPU: an authentic step whose request computes past its own blocks (before: its
  keys silently overwrote block 0 of the cache, another request's), or carries a token outside the
  vocabulary (before: silently embedded as zeros at TP 2), is refused by the workers: WorkerError naming
  the problem, the workers gone, EngineClosedError after. An authentic rank-0 output with a token id
  outside the vocabulary is a ProtocolError.

Faults are injected on observed events (the engine submitting its k-th step), never on timers.
"""

from __future__ import annotations

import copy
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
import zmq
from conftest import fail_on_hang
from test_faults import describe, kill_quietly, spawned_children, wait_gone

from tp_runtime import LLM, SamplingParams
from tp_runtime.config import CacheConfig, EngineConfig, SchedulerConfig, build_model_config
from tp_runtime.errors import EngineClosedError, ProtocolError, WorkerError
from tp_runtime.executor.remote import RemoteWorkers
from tp_runtime.messages import (
    CachedRequests,
    Logprobs,
    ModelRunnerOutput,
    NewRequest,
    PromptLogprobs,
    RequestSampling,
    SchedulerOutput,
    WorkerReply,
)
from tp_runtime.serialize import REPLIES, Signer, worker_reply_codec
from tp_runtime.worker.persistent_batch import PersistentBatch
from tp_runtime.worker.step_check import check_step

TEST_TIMEOUT_S = 120
VOCAB = 300  # the test checkpoint's
BLOCK = 16
MAX_LEN = 128  # 8 blocks a request
NUM_BLOCKS = 40
GREEDY = RequestSampling(0.0, 1.0, 0, 0.0, None, 0, [], -1)
ENGINE = dict(
    tensor_parallel_size=2,
    device="cpu",
    dtype="float32",
    executor="multiprocess",
    step_timeout_s=60.0,
    max_num_seqs=4,
    max_num_batched_tokens=256,
    max_model_len=MAX_LEN,
    num_kv_blocks=NUM_BLOCKS,
)
SHORT = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(autouse=True)
def hang_guard() -> Iterator[None]:
    with fail_on_hang(TEST_TIMEOUT_S):
        yield


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint()


@pytest.fixture(scope="module")
def config(checkpoint: Path) -> EngineConfig:
    model = build_model_config(checkpoint, dtype="float32", device="cpu", max_model_len=MAX_LEN)
    return EngineConfig(
        model=model,
        cache=CacheConfig(block_size=BLOCK),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
    )


def new_batch() -> PersistentBatch:
    return PersistentBatch(4, MAX_LEN, MAX_LEN // BLOCK, VOCAB, torch.device("cpu"), numpy_feed=True)


def step(
    step_id: int,
    new: list[NewRequest] | None = None,
    cached: CachedRequests | None = None,
    scheduled: list[int] | None = None,
    counts: list[int] | None = None,
    freed: list[int] | None = None,
) -> SchedulerOutput:
    return SchedulerOutput(
        step_id, new or [], cached or CachedRequests([], []), scheduled or [], counts or [], freed or []
    )


def request(req_id: int, tokens: list[int], blocks: list[int], **kw: Any) -> NewRequest:
    return NewRequest(
        req_id, tokens, kw.pop("num_output_tokens", 0), kw.pop("sampling", GREEDY), blocks, **kw
    )


def state(batch: PersistentBatch) -> Any:
    return copy.deepcopy((batch.row_of, batch.req_at, batch.num_blocks.copy(), batch.block_table.copy()))


# ----------------------------------------------------------------------------- worker side, no processes
def test_legitimate_steps_pass(config: EngineConfig) -> None:
    """A prompt over two blocks, its decode steps (a new block on the way), a second request joining, the
    first freed and resumed after a preemption with its outputs: every step passes the checks."""
    batch = new_batch()
    tokens = list(range(3, 33))  # 30 tokens: two blocks
    steps = [
        step(1, [request(7, tokens, [0, 1])], scheduled=[7], counts=[30]),
        step(2, scheduled=[7], counts=[1], cached=CachedRequests([7], [[]])),
        step(3, scheduled=[7], counts=[1], cached=CachedRequests([7], [[2]])),
        step(
            4, [request(8, [5, 6, 7], [3], num_computed_tokens=0)], CachedRequests([7], [[]]), [7, 8], [1, 2]
        ),
        step(
            5,
            [request(7, [*tokens, 9, 9], [4, 5, 6], num_output_tokens=2)],
            scheduled=[7],
            counts=[32],
            freed=[7, 99],
        ),
    ]
    for so in steps:
        check_step(so, config, batch, NUM_BLOCKS)
        batch.update(so)
        # What the runner's bookkeeping does after a step (every scheduled row computes its tokens; a row
        # that reached its end samples one more).
        for rid, n in zip(so.scheduled_req_ids, so.num_scheduled_tokens, strict=True):
            row = batch.row_of[rid]
            batch.num_computed[row] += n
            if batch.num_computed[row] == batch.num_tokens[row]:
                batch.num_tokens[row] += 1


def _bad_steps() -> dict[str, tuple[Callable[[], SchedulerOutput], str]]:
    """Each a step sent while request 7 runs (30 tokens computed, 31 held, blocks [0, 1])."""
    return {
        "negative block id": (
            lambda: step(2, [request(8, [5, 6], [-1])], scheduled=[8], counts=[2]),
            "block id -1, outside the KV cache [0, 40)",
        ),
        "block id past the cache": (
            lambda: step(2, [request(8, [5, 6], [NUM_BLOCKS])], scheduled=[8], counts=[2]),
            "block id 40, outside the KV cache",
        ),
        "new cached block past the cache": (
            lambda: step(2, cached=CachedRequests([7], [[10**12]]), scheduled=[7], counts=[1]),
            "block id 1000000000000, outside the KV cache",
        ),
        "more blocks than max_model_len needs": (
            lambda: step(2, cached=CachedRequests([7], [list(range(2, 9))]), scheduled=[7], counts=[1]),
            "would hold 9 blocks",
        ),
        "token id past the vocabulary": (
            lambda: step(2, [request(8, [5, VOCAB], [3])], scheduled=[8], counts=[2]),
            f"token id {VOCAB}, outside the vocabulary [0, {VOCAB})",
        ),
        "negative token id": (
            lambda: step(2, [request(8, [-5, 6], [3])], scheduled=[8], counts=[2]),
            "token id -5, outside the vocabulary",
        ),
        "prompt longer than max_model_len": (
            lambda: step(2, [request(8, [5] * (MAX_LEN + 1), [3])], scheduled=[8], counts=[1]),
            f"has {MAX_LEN + 1} tokens",
        ),
        "empty prompt": (lambda: step(2, [request(8, [], [3])]), "has 0 tokens"),
        "more outputs than tokens": (
            lambda: step(2, [request(8, [5, 6], [3], num_output_tokens=2)]),
            "2 of them outputs",
        ),
        "computing past its tokens": (
            lambda: step(2, [request(8, [5, 6, 7], [3])], scheduled=[8], counts=[10]),
            "to compute 10 tokens after 0, past its 3 tokens",
        ),
        "computing past its blocks": (
            lambda: step(2, [request(8, list(range(3, 43)), [3])], scheduled=[8], counts=[40]),
            "past its 40 tokens or its 1 blocks of 16",
        ),
        "decode past its blocks": (
            lambda: step(2, scheduled=[7], counts=[2]),
            "to compute 2 tokens after 30, past its 31 tokens",
        ),
        "zero tokens": (
            lambda: step(2, [request(8, [5, 6], [3])], scheduled=[8], counts=[0]),
            "each at least 1",
        ),
        "enormous token count": (
            lambda: step(2, [request(8, [5, 6], [3])], scheduled=[8], counts=[10**15]),
            "at most max_num_batched_tokens=256",
        ),
        "counts and ids differ": (
            lambda: step(2, scheduled=[7], counts=[1, 1]),
            "1 scheduled request ids but 2",
        ),
        "unknown scheduled request": (
            lambda: step(2, scheduled=[5], counts=[1]),
            "scheduled request 5 is not",
        ),
        "freed request scheduled": (
            lambda: step(2, scheduled=[7], counts=[1], freed=[7]),
            "scheduled request 7 is not running",
        ),
        "scheduled twice": (lambda: step(2, scheduled=[7, 7], counts=[1, 1]), "scheduled twice"),
        "unknown cached request": (
            lambda: step(2, cached=CachedRequests([5], [[3]])),
            "cached request 5 is not running",
        ),
        "cached ids and blocks differ": (
            lambda: step(2, cached=CachedRequests([7], [])),
            "1 cached request ids but 0 block lists",
        ),
        "running request sent again": (
            lambda: step(2, [request(7, [5, 6], [3])]),
            "new request 7 is already on this rank",
        ),
        "new request twice": (
            lambda: step(2, [request(8, [5], [3]), request(8, [5], [4])]),
            "new request 8 is already on this rank",
        ),
        "more requests than max_num_seqs": (
            lambda: step(2, [request(8 + i, [5], [3 + i]) for i in range(4)]),
            "more than max_num_seqs=4 requests",
        ),
        "stop id past the vocabulary": (
            lambda: step(
                2, [request(8, [5], [3], sampling=RequestSampling(0.0, 1.0, 0, 0.0, None, 5, [999], -1))]
            ),
            "stop token id 999",
        ),
        "too many logprobs": (
            lambda: step(
                2, [request(8, [5], [3], sampling=RequestSampling(0.0, 1.0, 0, 0.0, None, 0, [], 10**6))]
            ),
            "logprobs 1000000",
        ),
        "seed wider than 64 bits": (
            lambda: step(
                2, [request(8, [5], [3], sampling=RequestSampling(0.5, 1.0, 0, 0.0, 2**64 - 1, 0, [], -1))]
            ),
            "does not fit in 64 bits",
        ),
        "NaN temperature": (
            lambda: step(
                2,
                [request(8, [5], [3], sampling=RequestSampling(float("nan"), 1.0, 0, 0.0, None, 0, [], -1))],
            ),
            "not a finite number",
        ),
        "top_k past the vocabulary": (
            lambda: step(
                2, [request(8, [5], [3], sampling=RequestSampling(1.0, 1.0, VOCAB + 1, 0.0, None, 0, [], -1))]
            ),
            "top_k 301",
        ),
        "logit_bias id past the vocabulary": (
            lambda: step(
                2, [request(8, [5], [3], sampling=sampling(logit_bias_ids=[VOCAB], logit_bias_values=[1.0]))]
            ),
            f"logit_bias or allowed token id {VOCAB}",
        ),
        "negative allowed token id": (
            lambda: step(2, [request(8, [5], [3], sampling=sampling(allowed_token_ids=[4, -3]))]),
            "logit_bias or allowed token id -3",
        ),
        "logit_bias values not matching its ids": (
            lambda: step(
                2, [request(8, [5], [3], sampling=sampling(logit_bias_ids=[4, 5], logit_bias_values=[1.0]))]
            ),
            "logit_bias values that do not match",
        ),
        "infinite logit_bias": (
            lambda: step(
                2,
                [
                    request(
                        8, [5], [3], sampling=sampling(logit_bias_ids=[4], logit_bias_values=[float("inf")])
                    )
                ],
            ),
            "outside [-100, 100]",
        ),
        "constrained request not in the step": (
            lambda: SchedulerOutput(2, [], CachedRequests([], []), [7], [1], [], structured_req_ids=[5]),
            "constrained requests [5]",
        ),
        "stray sampling setting": (
            lambda: step(
                2, [request(8, [5], [3], sampling=RequestSampling(1.0, 0.0, 0, 0.0, None, 0, [], -1))]
            ),
            "out of its range",
        ),
    }


def sampling(**fields: Any) -> RequestSampling:
    return RequestSampling(0.0, 1.0, 0, 0.0, None, 0, [], -1, **fields)


BAD_STEPS = _bad_steps()


@pytest.mark.parametrize("case", list(BAD_STEPS))
def test_a_step_the_rank_cannot_run_is_refused_before_it_changes_anything(
    config: EngineConfig, case: str
) -> None:
    batch = new_batch()
    first = step(1, [request(7, list(range(3, 33)), [0, 1])], scheduled=[7], counts=[30])
    check_step(first, config, batch, NUM_BLOCKS)
    batch.update(first)
    batch.num_computed[0], batch.num_tokens[0] = 30, 31
    before = state(batch)
    make, message = BAD_STEPS[case]
    with pytest.raises(ProtocolError, match="step 2 from the driver is refused") as info:
        check_step(make(), config, batch, NUM_BLOCKS)
    assert message in str(info.value), str(info.value)
    after = state(batch)
    assert after[:2] == before[:2] and all(
        np.array_equal(a, b) for a, b in zip(after[2:], before[2:], strict=True)
    )


def test_a_step_before_the_kv_cache_is_refused(config: EngineConfig) -> None:
    with pytest.raises(ProtocolError, match="before the KV cache was allocated"):
        check_step(step(1, [request(7, [5], [0])], scheduled=[7], counts=[1]), config, new_batch(), None)


# ----------------------------------------------------------------------------- driver side, no processes
def _output_cases() -> dict[str, tuple[ModelRunnerOutput, str]]:
    one_row = Logprobs([[5, VOCAB]], [[-1.0, -2.0]], [1])
    prompt = PromptLogprobs(9, 0, [[5]], [[-1.0]], [1])
    return {
        "stray request": (ModelRunnerOutput(5, [1, 9], [5, 6]), "has request 9, which the step did not run"),
        "request twice": (ModelRunnerOutput(5, [1, 1], [5, 6]), "names a request twice"),
        "stray prompt logprobs": (ModelRunnerOutput(5, [1], [5], prompt_logprobs=[prompt]), "has request 9"),
        "token past the vocabulary": (ModelRunnerOutput(5, [1], [VOCAB]), f"has token id {VOCAB}, outside"),
        "negative token": (ModelRunnerOutput(5, [1], [-1]), "has token id -1, outside"),
        "logprob token past the vocabulary": (ModelRunnerOutput(5, [1], [5], one_row), f"token id {VOCAB}"),
    }


@pytest.mark.parametrize("case", list(_output_cases()))
def test_an_output_that_does_not_fit_its_step_is_a_protocol_error(case: str) -> None:
    remote = RemoteWorkers(cast(Any, None), [0, 1], 0.0, vocab_size=VOCAB)
    remote.submitted(5, [1, 2])
    output, message = _output_cases()[case]
    with pytest.raises(ProtocolError, match="rank 0's output of step 5") as info:
        remote._handle(0, WorkerReply(0, 5, "output", output=output), None)
    assert message in str(info.value), str(info.value)
    good = ModelRunnerOutput(
        5, [2, 1], [0, VOCAB - 1], Logprobs([[0], [VOCAB - 1]], [[-1.0], [-1.0]], [1, 1])
    )
    remote._handle(0, WorkerReply(0, 5, "output", output=good), None)
    assert remote.arrived[5] is good


# ----------------------------------------------------------------------------- spawned engines
@pytest.fixture
def fresh_llm(checkpoint: Path) -> Iterator[Callable[..., LLM]]:
    engines: list[LLM] = []
    before = spawned_children()

    def start(**kwargs: Any) -> LLM:
        llm = LLM(checkpoint, **{**ENGINE, **kwargs})  # type: ignore[arg-type]
        engines.append(llm)
        return llm

    yield start
    for llm in engines:
        llm.shutdown()
    leftover = spawned_children() - before
    for pid in leftover:
        kill_quietly(pid, signal.SIGKILL)
    assert not leftover, f"worker processes {sorted(leftover)} outlived the test"


def _corrupt(so: SchedulerOutput, case: str) -> str:
    """Make the engine's own step one the workers cannot run; returns what their refusal names."""
    req = so.new_requests[0]
    if case == "computes past its blocks":
        # 40 tokens in one block: positions 16-39 would be written through stale block-table entries.
        req.token_ids, req.block_ids = list(range(3, 43)), req.block_ids[:1]
        so.num_scheduled_tokens = [40]
        return "past its 40 tokens or its 1 blocks of 16"
    req.token_ids[1] = VOCAB + 7
    return f"token id {VOCAB + 7}, outside the vocabulary"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["computes past its blocks", "token outside the vocabulary"])
def test_the_workers_refuse_an_authentic_step_they_cannot_run(
    fresh_llm: Callable[..., LLM], case: str
) -> None:
    """The engine's own step, altered after the scheduler made it (as a broken driver would send it): the
    workers refuse it before it reaches the device, the driver raises WorkerError naming the problem,
    the workers are stopped, and the engine is closed."""
    llm = fresh_llm()
    executor: Any = llm.engine.executor
    pids = executor.worker_pids()
    assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], SHORT, use_tqdm=False)[0].outputs[0].token_ids
    real_submit, expected = type(executor).submit, []

    def submit(so: SchedulerOutput) -> None:
        if so.new_requests and not expected:
            expected.append(_corrupt(so, case))
        real_submit(executor, so)

    executor.submit = submit
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SHORT, use_tqdm=False)
    assert time.monotonic() - t0 < 10
    message = str(info.value)
    assert "ProtocolError: step" in message and "from the driver is refused" in message, describe(info.value)
    assert expected[0] in message, message
    assert wait_gone(pids, 10.0) == []
    with pytest.raises(EngineClosedError):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SHORT, use_tqdm=False)


@pytest.mark.slow
def test_an_authentic_output_with_a_token_outside_the_vocabulary_is_a_protocol_error(
    fresh_llm: Callable[..., LLM],
) -> None:
    """Signed with the engine's key (as only a broken rank 0 could), read before rank 0's real reply."""
    llm = fresh_llm(async_scheduling=False)
    executor: Any = llm.engine.executor
    pids = executor.worker_pids()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(executor.channel.results_addr)
    real_submit = type(executor).submit

    def submit(so: SchedulerOutput) -> None:
        if so.scheduled_req_ids:
            out = ModelRunnerOutput(so.step_id, so.scheduled_req_ids[:1], [VOCAB + 1])
            signer = Signer(executor.channel.key, REPLIES, 0)
            signer.seq = 10**9  # fresher than anything rank 0 sent
            push.send(
                signer.seal(worker_reply_codec().encode(WorkerReply(0, so.step_id, "output", output=out)))
            )
            # Nothing else can be queued now (no step in flight): wait until it is there, then send.
            assert executor.channel.pull.poll(10_000)
        real_submit(executor, so)

    executor.submit = submit
    try:
        with pytest.raises(ProtocolError) as info:
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SHORT, use_tqdm=False)
    finally:
        push.close(0)
        ctx.term()
    assert f"has token id {VOCAB + 1}, outside the vocabulary [0, {VOCAB})" in str(info.value), describe(
        info.value
    )
    assert wait_gone(pids, 10.0) == []


def test_a_broadcast_over_the_workers_limit_is_an_error_not_a_silent_drop() -> None:
    """libzmq drops a message over a receiver's MAXMSGSIZE unseen (and resets the connection), which left
    the driver waiting for a step no worker had; the driver refuses to send it instead."""
    import shutil

    from tp_runtime.ipc import ipc_channel
    from tp_runtime.messages import ControlCall

    folder, channel = ipc_channel(b"k" * 32, 1 << 16, max_broadcast_bytes=4096)
    try:
        channel.send(ControlCall(1, "ping", ["x" * 1000]))  # fits
        with pytest.raises(ProtocolError, match=r"ControlCall of \d+ bytes exceeds the workers' message"):
            channel.send(ControlCall(2, "ping", ["x" * 5000]))
    finally:
        channel.close()
        shutil.rmtree(folder, ignore_errors=True)
