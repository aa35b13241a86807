"""Async scheduling: the driver sends step N+1 before step N's sampled ids are back.

References: HF transformers' greedy continuation, and the same engine with async scheduling off (one step
at a time), which must give identical outputs (tokens, finish and stop reasons, text, logprobs, seeded
samples) however requests end. The worker-side protocol (rank 0 holding a step's answer back until the
next step is queued, or a Flush arrives) is checked against a stub model whose outputs are never ready.
"""

from __future__ import annotations

import secrets
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import hf_greedy, random_prompts

from tp_runtime import LLM, SamplingParams
from tp_runtime.config import CacheConfig, ParallelConfig, SchedulerConfig
from tp_runtime.errors import StepTimeoutError
from tp_runtime.executor.multiproc import MultiprocExecutor
from tp_runtime.messages import (
    CachedRequests,
    ControlCall,
    ExecuteModel,
    Flush,
    Hello,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
)
from tp_runtime.serialize import (
    BROADCAST,
    DRIVER_ID,
    REPLIES,
    FrameReader,
    FrameWriter,
    driver_message_codec,
    worker_reply_codec,
)
from tp_runtime.worker.worker import WorkerAddresses, run_worker_loop

PROMPTS = random_prompts((5, 12, 3, 9, 17, 7), vocab=300, seed=11)


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(seed=21)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    return hf_greedy(model_dir, PROMPTS, 20)


def _llm(model_dir: Path, async_scheduling: bool, **kwargs: Any) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", async_scheduling=async_scheduling, **kwargs)


def assert_same_outputs(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """Tokens, finish and stop reasons and text exactly; logprobs (rounded to 5 places) within 2e-5: a batch
    of another size (async scheduling finishes requests a step later) may round float32 sums differently
    in the last bits."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert {k: v for k, v in g.items() if k != "lp"} == {k: v for k, v in w.items() if k != "lp"}
        if g["lp"] is None or w["lp"] is None:
            assert g["lp"] is w["lp"] is None
            continue
        for a, b in zip(g["lp"], w["lp"], strict=True):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 2e-5 for t in a), (a, b)


def _outputs(llm: LLM, params: list[SamplingParams]) -> list[dict[str, Any]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    result = []
    for o in outs:
        (c,) = o.outputs
        lp = (
            None
            if c.logprobs is None
            else [{t: round(v.logprob, 5) for t, v in d.items()} for d in c.logprobs]
        )
        result.append(
            {"ids": c.token_ids, "finish": c.finish_reason, "stop": c.stop_reason, "text": c.text, "lp": lp}
        )
    return result


class _StepLog:
    """Records the order of the engine's submit / wait_output calls."""

    def __init__(self, llm: LLM) -> None:
        self.events: list[tuple[str, int]] = []
        executor = llm.engine.executor
        submit, wait = executor.submit, executor.wait_output

        def logged_submit(so: SchedulerOutput) -> None:
            self.events.append(("submit", so.step_id))
            submit(so)

        def logged_wait(step_id: int) -> ModelRunnerOutput:
            self.events.append(("wait", step_id))
            return wait(step_id)

        executor.submit = logged_submit  # type: ignore[method-assign]
        executor.wait_output = logged_wait  # type: ignore[method-assign]


@pytest.mark.parametrize("cuda_graphs", ["off", "padded"])
def test_mixed_stops_equal_sync_and_hf(model_dir: Path, reference: list[list[int]], cuda_graphs: str) -> None:
    """Requests ending at different steps (length, stop id, stop id under min_tokens), so rows leave the
    batch mid-run and in-flight tokens of finished requests must be dropped."""
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[reference[2][4]]),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, max_tokens=15, ignore_eos=True, seed=7, top_k=20),
        SamplingParams(
            temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[reference[5][1]], min_tokens=6
        ),
    ]
    results = {}
    for mode in (True, False):
        with _llm(model_dir, mode, cuda_graphs=cuda_graphs) as llm:
            log = _StepLog(llm)
            results[mode] = _outputs(llm, params)
            pairs = list(zip(log.events, log.events[1:], strict=False))
            if mode:  # the driver ran ahead: step k+1 was sent before step k's output was read
                assert sum(a[0] == "submit" and b == ("wait", a[1] - 1) for a, b in pairs) >= 10
            else:  # one step at a time
                assert all(b == ("wait", a[1]) for a, b in pairs if a[0] == "submit")
    assert_same_outputs(results[True], results[False])
    got = results[True]
    for i in (0, 1, 3):
        assert got[i]["ids"] == reference[i][: params[i].max_tokens] and got[i]["finish"] == "length"
    cut = reference[2].index(reference[2][4]) + 1
    assert got[2]["ids"] == reference[2][:cut] and got[2]["finish"] == "stop"
    assert got[2]["stop"] == reference[2][4]
    assert len(got[5]["ids"]) >= 6 and reference[5][1] not in got[5]["ids"][:6]
    assert got[3]["lp"] is not None and len(got[3]["lp"]) == 9


def test_preemption_equals_hf(model_dir: Path, reference: list[list[int]]) -> None:
    """Few KV blocks: requests are preempted while a step sampling for them is in flight."""
    with _llm(model_dir, True, num_kv_blocks=10, block_size=4, max_model_len=40) as llm:
        got = _outputs(llm, [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * len(PROMPTS))
        assert llm.engine.scheduler.num_preemptions > 0
    assert [g["ids"] for g in got] == reference


def test_tensor_parallel_equals_sync(model_dir: Path) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=3, ignore_eos=True)
    results = []
    for mode in (True, False):
        with _llm(model_dir, mode, tensor_parallel_size=2) as llm:
            results.append(_outputs(llm, [params] * len(PROMPTS)))
    assert results[0] == results[1]


# ----------------------------------------------------------------------------- worker protocol


_FAILING_STEP = 13


class _NeverReady:
    """A step whose sampled ids are 'still on the device' until resolve() is called."""

    def __init__(self, step_id: int, log: list[tuple[str, int]]) -> None:
        self.step_id = step_id
        self.log = log

    def ready(self) -> bool:
        return False

    def resolve(self) -> ModelRunnerOutput:
        self.log.append(("resolve", self.step_id))
        if self.step_id == _FAILING_STEP:
            raise RuntimeError("device error while waiting for the sampled ids")
        return ModelRunnerOutput(step_id=self.step_id, req_ids=[self.step_id], sampled_token_ids=[7])


class _StubWorker:
    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log = log

    def check_step(self, so: SchedulerOutput) -> None:
        pass  # the loop's order of launches and answers is under test, not the steps' contents

    def execute_model(self, so: SchedulerOutput) -> _NeverReady:
        self.log.append(("launch", so.step_id))
        return _NeverReady(so.step_id, self.log)

    def call(self, method: str, args: list[Any]) -> Any:
        self.log.append(("call", args[0]))
        return args[0]

    def shutdown(self) -> None:
        pass


class _StubConfig:
    def __init__(self, async_scheduling: bool) -> None:
        self.parallel = ParallelConfig()
        self.async_scheduling = async_scheduling
        # What the executor sizes its sockets' message limits from.
        self.model = type("Model", (), {"vocab_size": 300, "max_model_len": 64})()
        self.scheduler = SchedulerConfig()
        self.cache = CacheConfig()
        self.max_logprobs = 20


def _step(step_id: int) -> ExecuteModel:
    return ExecuteModel(SchedulerOutput(step_id, [], CachedRequests([], []), [step_id], [1], []))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_rank0_holds_a_step_back_until_the_next_is_queued(async_scheduling: bool) -> None:
    log: list[tuple[str, int]] = []
    folder = tempfile.mkdtemp(prefix="tp-runtime-test-")
    tag = uuid.uuid4().hex[:8]
    key = secrets.token_bytes(32)
    addresses = WorkerAddresses(f"ipc://{folder}/b-{tag}", f"ipc://{folder}/r-{tag}", key)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.bind(addresses.broadcast)
    pull = ctx.socket(zmq.PULL)
    pull.bind(addresses.results)
    encoder = FrameWriter(driver_message_codec(), key, BROADCAST, DRIVER_ID)
    decoder = FrameReader(worker_reply_codec(), key, REPLIES, "the test's reply socket")
    thread = threading.Thread(
        target=run_worker_loop,
        args=(_StubConfig(async_scheduling), 0, 0, addresses, None),
        kwargs={"worker": _StubWorker(log)},
        daemon=True,
    )
    thread.start()

    def recv() -> tuple[str, int]:
        assert pull.poll(5000), f"no reply; worker log {log}"
        opened = decoder.read(pull.recv())
        assert opened is not None, "the worker's reply failed authentication"
        _, reply = opened
        return reply.kind, reply.call_id

    def nothing_pending() -> bool:
        return not pull.poll(200)

    try:
        assert pub.poll(5000) and pub.recv()[:1] == b"\x01"  # subscribed
        pub.send(encoder.encode(Hello()))
        assert recv() == ("ready", -1)
        pub.send(encoder.encode(_step(1)))
        if async_scheduling:
            assert nothing_pending()  # held back: its ids are not on the host yet
            pub.send(encoder.encode(_step(2)))
            assert recv() == ("output", 1)
            assert log[:3] == [("launch", 1), ("launch", 2), ("resolve", 1)]  # 2 queued before 1 waited
            assert nothing_pending()
            pub.send(encoder.encode(Flush()))
            assert recv() == ("output", 2)
            pub.send(encoder.encode(_step(3)))
            pub.send(encoder.encode(ControlCall(call_id=9, method="x", args=[5])))
            assert recv() == ("output", 3)  # a control call first answers the held step
            assert recv() == ("result", 9)
        else:
            assert recv() == ("output", 1)  # answered at once, ready or not
            assert log == [("launch", 1), ("resolve", 1)]
        if async_scheduling:
            # A held step that fails when answered is that step's error; the Shutdown still ends the loop.
            pub.send(encoder.encode(_step(_FAILING_STEP)))
            assert nothing_pending()
        pub.send(encoder.encode(Shutdown()))
        if async_scheduling:
            assert recv() == ("error", _FAILING_STEP)
        thread.join(timeout=5)
        assert not thread.is_alive()
    finally:
        ctx.destroy(linger=0)


def test_an_outsider_subscriber_does_not_stand_in_for_a_rank() -> None:
    """Start-up waits for each rank's READY, which a rank sends only once a broadcast has reached it: a
    subscriber that is not a rank (possible across hosts, where the sockets are TCP) does not end the wait,
    and the first step is not lost to the rank's late subscription."""
    log: list[tuple[str, int]] = []
    config = _StubConfig(True)
    config.parallel = ParallelConfig(step_timeout_s=5.0)
    executor = MultiprocExecutor(config)  # type: ignore[arg-type]
    channel = executor.channel
    outsider_ctx = zmq.Context()
    outsider = outsider_ctx.socket(zmq.SUB)
    outsider.setsockopt(zmq.SUBSCRIBE, b"")
    outsider.connect(channel.broadcast_addr)
    ready: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: ready.update(executor.workers.wait_ready(timeout_s=20)))
    addresses = WorkerAddresses(
        channel.broadcast_addr, channel.results_addr, channel.key, channel.watchdog.address
    )
    worker = threading.Thread(
        target=run_worker_loop, args=(config, 0, 0, addresses, None), kwargs={"worker": _StubWorker(log)}
    )
    try:
        waiter.start()
        for _ in range(2):  # the driver greets, and the outsider hears it, while no rank has started
            assert outsider.poll(10_000), "no greeting reached the outsider"
            outsider.recv()
        assert waiter.is_alive() and not ready
        worker.start()
        waiter.join(timeout=20)
        assert not waiter.is_alive() and list(ready) == [0]
        executor.submit(_step(1).scheduler_output)
        assert executor.wait_output(1).step_id == 1
    finally:
        executor.shutdown(grace_s=0.0)
        waiter.join(timeout=5)
        if worker.ident is not None:  # started
            worker.join(timeout=5)
        outsider_ctx.destroy(linger=0)
    assert not worker.is_alive()


def test_start_up_wait_is_bounded_by_the_startup_timeout() -> None:
    """A rank that never answers the start-up greeting (here: never started) ends initialize() with a
    StepTimeoutError after startup_timeout_s, naming the rank, and the executor is shut down."""
    config = _StubConfig(True)
    config.parallel = ParallelConfig(startup_timeout_s=1.0)
    executor = MultiprocExecutor(config)  # type: ignore[arg-type]
    executor.workers.start = lambda init_method: None  # type: ignore[method-assign]
    started = time.monotonic()
    expected = r"rank\(s\) \[0\] did not start within 1 s \(startup_timeout_s\)"
    with pytest.raises(StepTimeoutError, match=expected):
        executor.initialize()
    assert time.monotonic() - started < 30
    assert executor.workers.closed


def test_driver_flushes_a_held_step_when_nothing_follows() -> None:
    """The engine's pattern at the end of a batch: send k, send k+1, read k, (nothing left to schedule) read
    k+1. Rank 0 holds k+1 back until something follows it, so the driver must send a Flush."""
    log: list[tuple[str, int]] = []
    config = _StubConfig(True)
    config.parallel = ParallelConfig(step_timeout_s=5.0)
    executor = MultiprocExecutor(config)  # type: ignore[arg-type]
    channel = executor.channel
    addresses = WorkerAddresses(
        channel.broadcast_addr, channel.results_addr, channel.key, channel.watchdog.address
    )
    thread = threading.Thread(
        target=run_worker_loop, args=(config, 0, 0, addresses, None), kwargs={"worker": _StubWorker(log)}
    )
    thread.start()
    try:
        executor.workers.wait_ready(timeout_s=10)
        executor.submit(_step(1).scheduler_output)
        executor.submit(_step(2).scheduler_output)
        assert executor.wait_output(1).step_id == 1
        assert executor.wait_output(2).step_id == 2  # StepTimeoutError without the Flush
        executor.submit(_step(3).scheduler_output)
        assert executor.wait_output(3).step_id == 3
        assert log == [("launch", 1), ("launch", 2), ("resolve", 1), ("resolve", 2), ("launch", 3),
                       ("resolve", 3)]  # fmt: skip
    finally:
        executor.shutdown(grace_s=0.0)
        thread.join(timeout=5)
    assert not thread.is_alive()


# ----------------------------------------------------------------------------- scheduler, brute force


def _token_at(req_id: int, position: int) -> int:
    """What the fake model 'samples' at a position: depends on nothing else, so any schedule (async or
    not, preempted or not) must produce the same sequences."""
    return (req_id * 7919 + position * 104729) % 300


class _FakeWorkerExecutor:
    """Stands in for the executor: mirrors a worker's persistent batch and checks every step against it."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.tokens: dict[int, list[int]] = {}  # the worker's view: known tokens per live request
        self.computed: dict[int, int] = {}
        self.outputs: dict[int, ModelRunnerOutput] = {}
        self.last_step_timings: dict[str, float] = {}
        self.last_sampled: dict[int, int] = {}  # per request, the furthest position it sampled

    def initialize(self) -> int:
        return self.num_blocks

    def submit(self, so: SchedulerOutput) -> None:
        for req_id in so.freed_req_ids:
            self.tokens.pop(req_id, None)
            self.computed.pop(req_id, None)
        for new in so.new_requests:
            assert new.req_id not in self.tokens
            # A resumed request's known tokens are exactly what the fake model produced before.
            first_out = len(new.token_ids) - new.num_output_tokens
            assert new.token_ids[first_out:] == [
                _token_at(new.req_id, p) for p in range(first_out, len(new.token_ids))
            ]
            self.tokens[new.req_id] = list(new.token_ids)
            self.computed[new.req_id] = new.num_computed_tokens  # a prefix-cache hit starts later
        req_ids, sampled = [], []
        for req_id, n in zip(so.scheduled_req_ids, so.num_scheduled_tokens, strict=True):
            tokens = self.tokens[req_id]
            assert self.computed[req_id] + n <= len(tokens), "scheduled tokens the worker does not have"
            self.computed[req_id] += n
            if self.computed[req_id] == len(tokens):
                token = _token_at(req_id, len(tokens))
                self.last_sampled[req_id] = max(self.last_sampled.get(req_id, 0), len(tokens))
                tokens.append(token)
                req_ids.append(req_id)
                sampled.append(token)
        self.outputs[so.step_id] = ModelRunnerOutput(so.step_id, req_ids, sampled)

    def wait_output(self, step_id: int) -> ModelRunnerOutput:
        return self.outputs.pop(step_id)

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        return [None]

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("seed", range(4))
def test_scheduler_brute_force_async_equals_sync(model_dir: Path, seed: int) -> None:
    """Random prompts, max_tokens, stop ids and min_tokens, with a KV cache small enough to preempt, run
    through the real LLMEngine and Scheduler against a fake worker; every request's output must be the
    closed-form continuation cut at its first allowed stop id or max_tokens, in both modes."""
    import random

    from tp_runtime.config import CacheConfig, EngineConfig, SchedulerConfig, build_model_config
    from tp_runtime.engine.llm_engine import LLMEngine

    rng = random.Random(seed)
    requests = []
    for _ in range(12):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))]
        stop_ids = rng.sample(range(300), 8)
        max_tokens = rng.randrange(1, 25)
        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, stop_token_ids=stop_ids, ignore_eos=True,
            min_tokens=min(max_tokens, rng.choice([0, 0, 3])),
        )  # fmt: skip
        requests.append((prompt, params))
    model = build_model_config(model_dir, max_model_len=64)
    results = {}
    for mode in (True, False):
        config = EngineConfig(
            model=model, cache=CacheConfig(block_size=4, num_kv_blocks=24),
            scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=20), async_scheduling=mode,
        )  # fmt: skip
        fake = _FakeWorkerExecutor(24)
        engine = LLMEngine(config, tokenizer=None, executor=fake)
        ids = [engine.add_request(p, params) for p, params in requests]
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                finished[int(out.request_id)] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
        assert engine.scheduler.num_preemptions > 0
        assert engine.scheduler.kv.num_free_blocks == 24  # every block came back
        results[mode] = [finished[i] for i in ids]
        for req_id, (prompt, _) in zip(ids, requests, strict=True):
            out, reason = finished[req_id]
            extra = fake.last_sampled[req_id] - (len(prompt) + len(out) - 1)
            # Nothing is sampled past max_tokens; a stop id is seen one step late with async scheduling.
            assert extra == 0 or (mode and reason == "stop" and extra == 1), (req_id, extra, reason)
    assert results[True] == results[False]
    for req_id, (prompt, params), (out, reason) in zip(ids, requests, results[True], strict=True):
        want = []
        for i in range(params.max_tokens):
            token = _token_at(req_id, len(prompt) + i)
            want.append(token)
            if token in params.stop_token_ids and len(want) >= params.min_tokens:
                break
        assert out == want
        assert reason == ("stop" if want[-1] in params.stop_token_ids and len(want) >= params.min_tokens
                          else "length")  # fmt: skip
