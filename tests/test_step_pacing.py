"""Holding the next step for requests still to come (engine/pacing.py): the pacer's arithmetic against
hand-computed times, when the engine offers a hold, and that the engine thread's hold admits a request
into the very next step and ends as soon as a command comes."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import test_streaming_engine
import torch
from test_streaming_engine import PROMPT, ScriptedExecutor, closed_form, collect, make_engine

from tp_runtime import LLM, SamplingParams
from tp_runtime.engine.async_engine import AsyncLLMEngine
from tp_runtime.engine.pacing import StepPacer
from tp_runtime.messages import ModelRunnerOutput, SchedulerOutput, WorkerReply
from tp_runtime.worker.outputs import HostTransfer, PendingOutput
from tp_runtime.worker.worker import _Replies

MS = 1e-3


# The scripted engine's checkpoint and byte-level tokenizer (module-scoped fixtures of that file).
model_config = test_streaming_engine.model_config
tokenizer = test_streaming_engine.tokenizer


def feed(pacer: StepPacer, arrivals: list[float], decode_only: bool = True) -> None:
    """Outputs that arrive at `arrivals`, each asked for while its step still ran."""
    for t in arrivals:
        pacer.output_arrived(t, False, decode_only)


def test_the_hold_ends_a_margin_before_the_running_step_ends() -> None:
    pacer = StepPacer(margin_s=1.5 * MS, margin_share=0.25)
    feed(pacer, [0.0, 5 * MS, 10 * MS, 15 * MS])  # three 5 ms steps (the first arrival starts the chain)
    assert pacer.step_estimate() == pytest.approx(5 * MS)
    # The running step began at the last arrival (15 ms) and ends at 20 ms: send by 18.5 ms.
    assert pacer.hold_s(15 * MS) == pytest.approx(3.5 * MS)
    assert pacer.hold_s(18 * MS) == pytest.approx(0.5 * MS)
    assert pacer.hold_s(19 * MS) == 0.0
    # A long step: the margin is a quarter of it.
    slow = StepPacer(margin_s=1.5 * MS, margin_share=0.25)
    feed(slow, [0.0, 0.02, 0.04, 0.06])
    assert slow.hold_s(0.06) == pytest.approx(0.015)


def test_only_enough_decode_steps_make_an_estimate_the_median_or_a_shorter_last() -> None:
    pacer = StepPacer(min_samples=3)
    feed(pacer, [0.0, 5 * MS, 10 * MS])
    assert pacer.step_estimate() is None and pacer.hold_s(10 * MS) == 0.0
    feed(pacer, [30 * MS], decode_only=False)  # a prefill step's 20 ms is no decode step's duration
    assert pacer.step_estimate() is None
    feed(pacer, [35 * MS, 75 * MS, 80 * MS])  # 5, 40 (one slow step), 5 ms
    assert pacer.step_estimate() == pytest.approx(5 * MS)
    feed(pacer, [120 * MS, 160 * MS, 200 * MS, 240 * MS])  # four more slow ones: most of the window of 8
    assert pacer.step_estimate() == pytest.approx(40 * MS)
    feed(pacer, [243 * MS])  # the batch shrank: its first short step is the estimate at once
    assert pacer.step_estimate() == pytest.approx(3 * MS)


def test_an_output_ready_before_it_was_asked_for_drops_the_estimates_and_widens_the_margin() -> None:
    """The device may have idled before the next step (a host slower than the device, a hold too long):
    that interval is no step's duration, and no step is held until three new ones are measured. If that
    step was held, later holds end earlier, by a margin that shrinks back while held steps go out in time."""
    pacer = StepPacer(min_samples=3, margin_s=1.5 * MS, margin_share=0.25)
    feed(pacer, [0.0, 5 * MS, 10 * MS, 15 * MS])
    assert pacer.hold_s(15 * MS) == pytest.approx(3.5 * MS)
    pacer.output_arrived(21 * MS, True, True)  # held, and too long
    assert pacer.step_estimate() is None and pacer.hold_s(21 * MS) == 0.0
    feed(pacer, [26 * MS, 31 * MS])
    assert pacer.hold_s(31 * MS) == 0.0
    feed(pacer, [36 * MS])
    assert pacer.margin(5 * MS) == pytest.approx(3.0 * MS)  # 1.5 ms more
    assert pacer.hold_s(36 * MS) == pytest.approx(2.0 * MS)
    pacer.output_arrived(41 * MS, False, True)  # held, in time: the added margin shrinks by a tenth
    assert pacer.hold_s(41 * MS) == pytest.approx((5 - 1.5 - 1.35) * MS)
    pacer.output_arrived(46 * MS, False, True)
    # Ready early after a step that was not held (the host alone was late): no wider margin.
    pacer.output_arrived(52 * MS, True, True)
    assert pacer.step_estimate() is None
    assert pacer.margin(5 * MS) == pytest.approx((1.5 + 1.215) * MS)
    # Held and late, again and again: the added margin doubles (plus 1.5 ms) up to half a step.
    feed(pacer, [60 * MS, 70 * MS, 80 * MS, 90 * MS])  # 8, 10, 10, 10 ms
    assert pacer.step_estimate() == pytest.approx(10 * MS)
    extras = []
    for t in (90, 131, 172):  # each the last output's arrival
        assert pacer.hold_s(t * MS) > 0
        pacer.output_arrived((t + 11) * MS, True, True)
        feed(pacer, [(t + 21) * MS, (t + 31) * MS, (t + 41) * MS])
        extras.append(pacer.margin(10 * MS) - 2.5 * MS)
    assert extras == pytest.approx([3.93 * MS, 5 * MS, 5 * MS])
    # A pipeline that emptied starts a new chain: the first output after it measures nothing.
    pacer.reset()
    feed(pacer, [500 * MS])
    assert pacer.step_estimate() == pytest.approx(10 * MS)
    with pytest.raises(ValueError, match="min_samples"):
        StepPacer(window=2, min_samples=3)


def test_an_output_says_whether_it_was_ready_before_it_was_asked_for() -> None:
    class Event:  # a CUDA event's query() and synchronize(), without a GPU
        def __init__(self, done: bool) -> None:
            self.done = done

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.done = True

    for done in (False, True):
        transfer = HostTransfer(host=torch.tensor([7]), done=Event(done), num_logprobs=0)  # type: ignore[arg-type]
        output = PendingOutput(step_id=3, req_ids=[1], transfer=transfer, num_sampled=1).resolve()
        assert output.sampled_token_ids == [7] and output.ready_before_asked is done
    # Sampled on the CPU, whose forward runs before the next step is sent: always ready.
    cpu = PendingOutput(
        step_id=4, req_ids=[1], transfer=HostTransfer(torch.tensor([5]), None, 0), num_sampled=1
    )
    assert cpu.resolve().ready_before_asked


class SlowDevice(ScriptedExecutor):
    """A step's output comes `step_s` after it is asked for, as from a device still running it."""

    step_s = 0.05

    def wait_output(self, step_id: int) -> ModelRunnerOutput:
        time.sleep(self.step_s)
        return super().wait_output(step_id)


def test_the_engine_holds_only_while_a_decode_step_runs_with_nothing_waiting(
    model_config: Any, tokenizer: Any
) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine = make_engine(model_config, tokenizer, SlowDevice(closed_form))
    engine.add_request(PROMPT, params)
    holds, estimates = [], []
    for _ in range(8):
        engine.step()
        holds.append(engine.step_hold_s())
        estimates.append(engine._pacer.step_estimate())
    # The prompt's step, then three decode steps to measure: no hold before that.
    assert holds[:4] == [0.0] * 4, holds
    for hold, step in zip(holds[4:], estimates[4:], strict=True):
        assert step is not None and step >= SlowDevice.step_s
        assert 0 < hold <= 0.75 * step, (holds, estimates)
    # A request waits: it goes into the next step at once.
    engine.add_request(PROMPT, params)
    assert engine.step_hold_s() == 0.0
    engine.step()  # sends the newcomer's prompt: the step now running is no decode step
    assert engine.step_hold_s() == 0.0
    engine.step()
    # Without async scheduling every step waits for its own output: nothing runs to hold behind.
    sync = make_engine(model_config, tokenizer, SlowDevice(closed_form), async_scheduling=False)
    sync.add_request(PROMPT, params)
    for _ in range(6):
        sync.step()
        assert sync.step_hold_s() == 0.0


def test_rank_0_flags_a_held_step_that_finished_before_the_next_one_arrived() -> None:
    """The multiprocess executor's rank 0 answers a step only once the next one is queued: the flag says
    whether the step had finished by then, through that hold-back."""

    class Event:
        def __init__(self) -> None:
            self.done = False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.done = True

    class Sent:  # the push socket and the frame writer: keep each reply as it is
        def __init__(self) -> None:
            self.replies: list[WorkerReply] = []

        def encode(self, reply: WorkerReply) -> WorkerReply:
            return reply

        def send(self, reply: WorkerReply) -> None:
            self.replies.append(reply)

    sent = Sent()
    replies = _Replies(sent, sent, rank=0, hold_back=True)  # type: ignore[arg-type]
    events = [Event() for _ in range(3)]
    steps = [
        PendingOutput(step_id=i, req_ids=[1], transfer=HostTransfer(torch.tensor([i]), e, 0), num_sampled=1)  # type: ignore[arg-type]
        for i, e in enumerate(events)
    ]
    replies.step(steps[0])
    assert sent.replies == []  # held: its ids are not on the host yet
    replies.step(steps[1])  # step 0 still runs as step 1 is queued
    events[1].done = True  # step 1 ends before step 2 arrives: the device waited
    replies.step(steps[2])
    replies.answer_held()  # a Flush
    assert [(r.call_id, r.output.ready_before_asked) for r in sent.replies if r.output] == [
        (0, False),
        (1, True),
        (2, False),
    ]


def test_an_engine_whose_forward_runs_on_the_host_never_holds() -> None:
    """On the CPU each step's forward runs when it is sent, so every output is ready before it is asked
    for: there is no device time to hold behind."""
    with LLM("tiny-llama-tp", device="cpu", max_model_len=64, max_num_seqs=2) as llm:
        engine = llm.engine
        assert engine.async_scheduling
        engine.add_request([1, 15, 27, 300], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        holds = []
        while engine.has_unfinished_requests():
            engine.step()
            holds.append(engine.step_hold_s())
        assert len(holds) >= 12 and set(holds) == {0.0}
        assert engine._pacer.step_estimate() is None


class RecordingExecutor(ScriptedExecutor):
    def __init__(self) -> None:
        super().__init__(closed_form)
        self.new_per_step: list[list[int]] = []  # the new requests of each step sent, in order

    def submit(self, so: SchedulerOutput) -> None:
        self.new_per_step.append([new.req_id for new in so.new_requests])
        super().submit(so)


def test_a_request_that_comes_during_the_hold_joins_the_next_step(model_config: Any, tokenizer: Any) -> None:
    """The hold is the engine's to time (tested above); here it is long and begins at a chosen step, so
    each check follows an observed event: the engine thread holding."""
    executor = RecordingExecutor()
    engine = make_engine(model_config, tokenizer, executor)
    held_at: list[int] = []
    holding = threading.Event()

    def step_hold_s() -> float:  # on the engine thread, once before each step it sends
        sent = len(executor.new_per_step)
        # Hold after the 4th step, and 6 steps after the first hold (the newcomer has finished by then).
        if sent == 4 or (held_at and sent == held_at[0] + 6):
            held_at.append(sent)
            holding.set()
            return 60.0
        return 0.0

    engine.step_hold_s = step_hold_s  # type: ignore[method-assign]
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        first = async_engine.add([(PROMPT, long)])
        assert await loop.run_in_executor(None, holding.wait, 30)
        holding.clear()
        added = time.monotonic()
        second = async_engine.add([(PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))])
        got = await collect(second)
        assert time.monotonic() - added < 30, "the request did not end the hold"
        [req_id] = {int(out.request_id) for out in got[0]}
        # Sent in the step right after the hold, where without it two steps would have gone out meanwhile.
        assert executor.new_per_step[held_at[0]] == [req_id], (executor.new_per_step, held_at)
        assert [t for out in got[0] for t in out.outputs[0].token_ids] == [
            closed_form(req_id, len(PROMPT) + i) for i in range(3)
        ]
        # A shutdown during a hold ends it too.
        assert await loop.run_in_executor(None, holding.wait, 30)
        assert len(held_at) == 2
        stopping = time.monotonic()
        await loop.run_in_executor(None, async_engine.shutdown, 0.0)
        assert time.monotonic() - stopping < 30, "shutdown did not end the hold"
        rest = await collect(first)
        assert rest[0][-1].finished and rest[0][-1].outputs[0].finish_reason == "abort"

    asyncio.run(main())
    assert executor.shut_down
