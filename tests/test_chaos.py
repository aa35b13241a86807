"""Chaos: a TP=2 CPU engine (tiny model) under random faults, round after round (issue 10).

Each round runs a batch of greedy requests and, when the engine waits for its k-th step (k and the fault
drawn from a seeded RNG; TP_RUNTIME_CHAOS_SEED picks another run), does one of: push garbage, forged,
duplicated, reordered or oversized frames into the driver's reply, broadcast or heartbeat socket, or
straight to the workers; SIGKILL or SIGSTOP a rank; or run the batch from several threads at once. Every
fault appears at least once. After each round:
- if the engine must survive: every output equals HF's greedy tokens and every KV block is free;
- if it cannot (a killed or stopped rank): WorkerDiedError / StepTimeoutError naming the rank within the
  timeout, then no worker process, no ipc folder and no KV block left, and the next call is refused.
No round may hang (a per-test alarm, and faulthandler as the last resort). The rounds stop after
ROUNDS_BUDGET_S, so the test takes 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import functools
import os
import random
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import fail_on_hang, hf_greedy, random_prompts
from test_faults import describe, kill_quietly, spawned_children, wait_gone

from tp_runtime import LLM, SamplingParams
from tp_runtime.errors import EngineClosedError, StepTimeoutError, TPRuntimeError, WorkerDiedError
from tp_runtime.messages import CachedRequests, ExecuteModel, ModelRunnerOutput, SchedulerOutput, WorkerReply
from tp_runtime.serialize import HEARTBEATS, REPLIES, Signer, driver_message_codec, worker_reply_codec

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("TP_RUNTIME_CHAOS_SEED", "20261130"))
# Random rounds after every fault once (more with TP_RUNTIME_CHAOS_ROUNDS, to search further than CI does).
EXTRA_ROUNDS = int(os.environ.get("TP_RUNTIME_CHAOS_ROUNDS", "16"))
ROUNDS_BUDGET_S = 150.0  # no round starts after this
TEST_TIMEOUT_S = 420
STEP_TIMEOUT_S = 8.0
MAX_TOKENS = 16
PROMPTS = random_prompts((3, 8, 12, 6, 10, 4), vocab=300, seed=77)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(tensor_parallel_size=2, device="cpu", dtype="float32", executor="multiprocess",
              step_timeout_s=STEP_TIMEOUT_S, max_num_seqs=8, max_num_batched_tokens=256)  # fmt: skip
SURVIVABLE = [
    "reply_garbage", "reply_forged", "reply_duplicate", "reply_out_of_order", "reply_oversized",
    "broadcast_outsider", "broadcast_to_workers", "heartbeat_garbage", "threads",
]  # fmt: skip
FATAL = ["sigkill", "sigstop"]


@pytest.fixture(autouse=True)
def hang_guard() -> Iterator[None]:
    with fail_on_hang(TEST_TIMEOUT_S, "chaos test"):
        yield


class Round:
    """One engine's view for a fault: its sockets, its recorded authentic frames, an outsider's sockets."""

    def __init__(
        self, llm: LLM, rng: random.Random, ctx: zmq.Context[zmq.Socket[bytes]], recorded: tuple[Any, Any]
    ) -> None:
        self.llm = llm
        self.replies: list[bytes] = recorded[0]
        self.broadcasts: list[bytes] = recorded[1]
        self.fired: list[int] = []  # the step ids at which the fault was done
        self.rng = rng
        self.executor: Any = llm.engine.executor
        self.channel = self.executor.channel
        self.pids: list[int] = self.executor.worker_pids()
        self.ctx = ctx
        self.sockets: list[zmq.Socket[bytes]] = []
        self.victim: int | None = None  # the rank a signal was sent to

    def outsider(self, kind: int, address: str) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(0)


def record(llm: LLM) -> tuple[list[bytes], list[bytes]]:
    """Copies of every authentic frame the driver reads and sends, for replays."""
    channel: Any = llm.engine.executor.channel  # type: ignore[attr-defined]
    read, encode = channel.reader.read, channel.writer.encode
    replies: list[bytes] = []
    broadcasts: list[bytes] = []

    def recording_read(frame: bytes) -> Any:
        opened = read(frame)
        if opened is not None:
            replies.append(frame)
            del replies[:-50]
        return opened

    def recording_encode(message: Any) -> bytes:
        frame = encode(message)
        broadcasts.append(frame)
        del broadcasts[:-50]
        return frame

    channel.reader.read = recording_read
    channel.writer.encode = recording_encode
    return replies, broadcasts


def fault(name: str, r: Round, step_id: int) -> None:
    """Do fault `name` now (in the thread that waits for step_id)."""
    rng, channel, replies, broadcasts = r.rng, r.channel, r.replies, r.broadcasts
    r.fired.append(step_id)
    forged = worker_reply_codec().encode(
        WorkerReply(0, step_id, "output", output=ModelRunnerOutput(step_id, [0, 1], [7, 7]))
    )
    if name.startswith("reply_"):
        push = r.outsider(zmq.PUSH, channel.results_addr)
        frames = {
            "reply_garbage": [b"", *(secrets.token_bytes(rng.randint(1, 4000)) for _ in range(5))],
            "reply_forged": [forged, Signer(secrets.token_bytes(32), REPLIES, 0).seal(forged)] * 10,
            "reply_duplicate": [replies[-1]] * 3,
            "reply_out_of_order": [rng.choice(replies[:-1] or replies) for _ in range(3)],
            "reply_oversized": [b"\x00" * (channel.pull.getsockopt(zmq.MAXMSGSIZE) + 1)],
        }[name]
        for frame in frames:
            push.send(frame)
    elif name == "broadcast_outsider":
        xsub = r.outsider(zmq.XSUB, channel.broadcast_addr)
        for _ in range(rng.randint(1, 50)):
            xsub.send(rng.choice([b"\x01", b"\x00", b"junk", secrets.token_bytes(30)]))
        xsub.send(b"x" * rng.randint(100, 1 << 21))  # over the limit: the connection is dropped
    elif name == "broadcast_to_workers":
        unsigned = driver_message_codec().encode(
            ExecuteModel(SchedulerOutput(step_id + 1, [], CachedRequests([], []), [], [], [0, 1, 2]))
        )
        for frame in (b"junk", unsigned, broadcasts[-1], rng.choice(broadcasts), secrets.token_bytes(999)):
            channel.pub.send(frame)
    elif name == "heartbeat_garbage":
        push = r.outsider(zmq.PUSH, channel.watchdog.address)
        for rank in (0, 1):
            push.send(Signer(secrets.token_bytes(32), HEARTBEATS, rank).seal(b""))
        push.send(b"\x00" * 1000)
    elif name in ("sigkill", "sigstop"):
        r.victim = rng.randrange(2)
        os.kill(r.pids[r.victim], signal.SIGKILL if name == "sigkill" else signal.SIGSTOP)


def hook_step(llm: LLM, step: int, action: Callable[[int], Any]) -> None:
    """Call action(step_id) when the engine waits for its `step`-th output from now on (once)."""
    executor: Any = llm.engine.executor
    real = type(executor).wait_output
    calls = [0]

    def wait_output(step_id: int) -> ModelRunnerOutput:
        calls[0] += 1
        if calls[0] == step:
            action(step_id)
        return real(executor, step_id)

    executor.wait_output = wait_output


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def in_threads(llm: LLM, reference: dict[tuple[int, ...], list[int]], rng: random.Random) -> None:
    """Three threads generate overlapping subsets at once; each gets exactly its own outputs."""
    subsets = [rng.sample(PROMPTS, rng.randint(1, len(PROMPTS))) for _ in range(3)]
    results: dict[int, Any] = {}

    def run(i: int) -> None:
        try:
            results[i] = generate(llm, subsets[i])
        except BaseException as exc:  # reported below, in the test's thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=STEP_TIMEOUT_S * 10)
        assert not t.is_alive(), "a generate thread hangs"
    for i, subset in enumerate(subsets):
        assert results[i] == [reference[tuple(p)] for p in subset], (i, describe(results[i]) if isinstance(
            results[i], BaseException) else results[i])  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint()


def test_chaos(checkpoint: Path) -> None:
    rng = random.Random(SEED)
    hf = hf_greedy(checkpoint, PROMPTS, MAX_TOKENS)
    reference = {tuple(p): out for p, out in zip(PROMPTS, hf, strict=True)}
    want = [reference[tuple(p)] for p in PROMPTS]
    # Every fault once, in random order, then random ones (more survivable than fatal ones).
    schedule = rng.sample(SURVIVABLE + FATAL, len(SURVIVABLE + FATAL))
    schedule += [rng.choice(SURVIVABLE * 3 + FATAL) for _ in range(EXTRA_ROUNDS)]
    before = spawned_children()
    ctx = zmq.Context()
    llm: LLM | None = None
    ipc_dirs: list[Path] = []
    log: list[str] = []
    start = time.monotonic()
    try:
        for round_no, name in enumerate(schedule):
            if time.monotonic() - start > ROUNDS_BUDGET_S and round_no >= len(SURVIVABLE + FATAL):
                break
            if llm is None:
                llm = LLM(checkpoint, **ENGINE)  # type: ignore[arg-type]
                ipc_dirs.append(Path(llm.engine.executor.ipc_dir))  # type: ignore[attr-defined]
                recorded = record(llm)
                assert generate(llm, PROMPTS) == want  # recorded frames to replay, and a sane engine
            r = Round(llm, rng, ctx, recorded)
            step = rng.randint(1, MAX_TOKENS - 2)
            log.append(f"round {round_no}: {name} at step {step}")
            t0 = time.monotonic()
            # The threads round also gets garbage, so that its waits see some.
            hook_step(llm, step, functools.partial(fault, "reply_garbage" if name == "threads" else name, r))
            try:
                if name == "threads":
                    in_threads(llm, reference, rng)
                else:
                    got = generate(llm, PROMPTS)
                    if name in FATAL:
                        got = generate(llm, PROMPTS)  # the fault may land after the batch's last step
                    assert got == want, f"wrong outputs after {name}"
                assert name not in FATAL, f"{name}: the engine went on"
                kv = llm.engine.scheduler.kv
                assert kv.num_free_blocks == llm.engine.num_kv_blocks, f"KV blocks leaked after {name}"
            except TPRuntimeError as exc:
                elapsed = time.monotonic() - t0
                assert name in FATAL, f"{name} was fatal: {describe(exc)}\n" + "\n".join(log)
                assert r.fired, f"{name}: an error before the fault: {describe(exc)}"
                victim, message = r.victim, str(exc)
                if name == "sigkill":
                    assert isinstance(exc, WorkerDiedError) and exc.rank == victim, describe(exc)
                else:  # named by its silence, or by its process state at the step timeout
                    assert isinstance(exc, StepTimeoutError), describe(exc)
                    named = (f"rank {victim} sent no heartbeat", f"rank {victim} is stopped by a signal")
                    assert any(n in message for n in named), message
                assert elapsed < STEP_TIMEOUT_S + 10, f"{name}: the error took {elapsed:.1f} s"
                for pid in r.pids:
                    kill_quietly(pid, signal.SIGCONT)
                assert wait_gone(r.pids, 10.0) == [], f"workers left after {name}"
                assert not ipc_dirs[-1].exists(), f"ipc folder left after {name}"
                kv = llm.engine.scheduler.kv
                assert kv.num_free_blocks == llm.engine.num_kv_blocks, f"KV blocks leaked after {name}"
                with pytest.raises(EngineClosedError):
                    generate(llm, PROMPTS[:1])
                llm.shutdown()
                llm = None
                log[-1] += f": {type(exc).__name__} after {elapsed:.1f} s"
            finally:
                r.close()
        assert len(log) >= len(SURVIVABLE + FATAL)
        print(f"chaos seed {SEED}: {len(log)} rounds in {time.monotonic() - start:.0f} s", *log, sep="\n")
    finally:
        if llm is not None:
            for pid in llm.engine.executor.worker_pids():  # type: ignore[attr-defined]
                kill_quietly(pid, signal.SIGCONT)
            llm.shutdown()
        ctx.destroy(linger=0)
        leftover = spawned_children() - before
        for pid in leftover:
            kill_quietly(pid)
    assert not leftover, f"worker processes {sorted(leftover)} outlived the chaos"
    assert not [d for d in ipc_dirs if d.exists()], "ipc folders left behind"
