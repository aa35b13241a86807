"""Executors: how the driver reaches its workers.

- InProcessExecutor: TP=1 in the driver's own process (no sockets, no process group).
- MultiprocExecutor: one process per rank, each a fresh interpreter (`python -m tp_runtime.worker_process`:
  the user's main module is never re-imported, so scripts need no __main__ guard). The driver broadcasts
  over a ZeroMQ XPUB socket and reads replies from a PULL socket; only rank 0 answers a step. Start-up
  waits until every worker has subscribed (XPUB reports each subscription, so no message is lost to the
  PUB/SUB slow joiner) and sent READY. While waiting for any reply the driver polls the worker
  processes, so a dead worker is an error naming its rank within a fraction of a second, and every wait
  has a timeout. Workers hold their stdin pipe from the driver and exit when it closes, so they never
  outlive the driver.
- TorchrunExecutor: torchrun started every rank; rank 0 runs the driver plus its own worker in-process,
  ranks > 0 run the worker loop and connect to rank 0 over TCP.

Transport security (see serialize.py for the frame format and why HMAC rather than CURVE):
- Every frame is authenticated with a per-engine key and numbered per sender; anything else is dropped and
  logged. An authentic reply that makes no sense (a step not in flight, a duplicate, lists of different
  lengths) is a ProtocolError naming the problem.
- Every receiving socket has zmq.MAXMSGSIZE set to the largest legitimate message of the config (a peer
  that sends more is disconnected), and what peers send into the broadcast socket is read and discarded.
- Spawned mode listens on nothing but ipc sockets (0600, in a 0700 folder) and, for the process group, a
  FileStore in that folder with gloo/NCCL on the loopback interface. Under torchrun the driver binds
  127.0.0.1 when every rank is on one host; across hosts it binds MASTER_ADDR and requires a shared
  secret (TP_RUNTIME_SECRET or TP_RUNTIME_SECRET_FILE), from which each job derives its own key.
- Liveness: every worker sends a heartbeat each HEARTBEAT_INTERVAL_S from its own thread, read by a
  watchdog thread in the driver. A rank silent for HEARTBEAT_TIMEOUT_S is a StepTimeoutError naming it
  (spawned mode: unless its process is running, as it is while holding the GIL through a long compile;
  the step timeout bounds that); a step timeout names the silent or stopped rank, or says that none is
  known. Under torchrun, where rank 0 has no process handles, a killed rank is named by its closed
  connection and its silence, and when rank 0's own worker stays blocked in a collective with a dead or
  silent rank, the watchdog ends the job.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import os
import secrets
import shutil
import site
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import zmq

import tp_runtime
from tp_runtime.config import EngineConfig
from tp_runtime.errors import (
    ConfigError,
    EngineClosedError,
    ProtocolError,
    StepTimeoutError,
    TPRuntimeError,
    WorkerDiedError,
    WorkerError,
)
from tp_runtime.messages import (
    ControlCall,
    DriverMessage,
    ExecuteModel,
    Flush,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerReply,
)
from tp_runtime.model_runner import PendingOutput
from tp_runtime.serialize import (
    BROADCAST,
    DRIVER_ID,
    FRAME_OVERHEAD,
    HEARTBEATS,
    REPLIES,
    FrameReader,
    FrameRejected,
    FrameWriter,
    Verifier,
    derive_job_key,
    driver_message_codec,
    key_check,
    recv_spinning,
    worker_reply_codec,
)
from tp_runtime.worker import HEARTBEAT_INTERVAL_S, Worker, WorkerAddresses, run_worker_loop
from tp_runtime.worker_process import SpawnArgs, encode_spawn_args

# How often a blocked driver wakes to check that its workers are alive.
_LIVENESS_POLL_MS = 100
_STARTUP_TIMEOUT_S = 600.0
# A rank silent this long is reported as stopped or hung (StepTimeoutError naming it) without waiting for
# step_timeout_s: every other rank waits for it in its next collective anyway.
HEARTBEAT_TIMEOUT_S = 5.0
# A rank silent this long is a suspect: named by a step timeout, or, after its connection closed, dead.
_QUIET_S = 3 * HEARTBEAT_INTERVAL_S
# torchrun: rank 0's own worker can block inside a collective with a dead or stopped rank, where no error
# reaches it; the watchdog ends the process this long after it has named the rank.
_HARD_EXIT_GRACE_S = 2.0
# Peers only send subscription messages to the broadcast socket (1 byte: workers subscribe to everything).
_BROADCAST_INBOUND_MAX = 64
_CLOSED = "the engine was shut down (after an error, or by shutdown()); create a new LLM"
T = TypeVar("T")


class Executor(Protocol):
    # Driver-side timings of the last submit (seconds), for the benchmark's step breakdown.
    last_step_timings: dict[str, float]

    def initialize(self) -> int:
        """Load the model on every rank and allocate the KV cache; returns the number of KV blocks."""
        ...

    def submit(self, so: SchedulerOutput) -> None:
        """Send a step to every rank; returns without waiting for its output."""
        ...

    def wait_output(self, step_id: int) -> ModelRunnerOutput:
        """Rank 0's output of a submitted step (steps are answered in the order they were submitted)."""
        ...

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        """Run a worker control method on every rank; results in rank order."""
        ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config, rank=0, local_rank=0)
        self.last_step_timings: dict[str, float] = {}
        self.pending = _PendingSteps()

    def initialize(self) -> int:
        self.worker.init_device(None)
        self.worker.load_model()
        return _size_kv_cache(self)

    def submit(self, so: SchedulerOutput) -> None:
        self.pending.add(self.worker.execute_model(so))

    def wait_output(self, step_id: int) -> ModelRunnerOutput:
        return self.pending.resolve(step_id)

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        return [self.worker.call(method, list(args or []))]

    def shutdown(self) -> None:
        self.worker.shutdown()


class _PendingSteps:
    """Steps queued on an in-process worker, resolved in order (older ones are dropped when a newer one is
    asked for: their requests were aborted)."""

    def __init__(self) -> None:
        self.steps: dict[int, PendingOutput] = {}

    def add(self, pending: PendingOutput) -> None:
        self.steps[pending.step_id] = pending

    def resolve(self, step_id: int) -> ModelRunnerOutput:
        for older in [s for s in self.steps if s < step_id]:
            del self.steps[older]
        pending = self.steps.pop(step_id, None)
        if pending is None:
            raise RuntimeError(f"internal: step {step_id} was never submitted")
        return pending.resolve()


def _size_kv_cache(executor: Executor) -> int:
    num_blocks = int(executor.collective_rpc("determine_num_kv_blocks")[0])
    executor.collective_rpc("allocate_kv_cache", [num_blocks])
    return num_blocks


def message_limits(config: EngineConfig) -> tuple[int, int]:
    """The largest legitimate (broadcast, reply) frame of this config, doubled, plus 1 MiB for headers,
    control calls and tracebacks: each receiving socket's zmq.MAXMSGSIZE. Numbers count 9 bytes (the
    widest msgpack integer or float)."""
    model, sched = config.model, config.scheduler
    vocab, seq_blocks = model.vocab_size, model.max_model_len // config.cache.block_size + 2
    # A new request carries all its tokens, its block ids and up to a vocabulary of stop token ids; every
    # scheduled request carries at most its new block ids.
    new_requests = min(sched.max_num_seqs, sched.max_num_batched_tokens)
    broadcast = new_requests * (model.max_model_len + seq_blocks + vocab + 64)
    broadcast += sched.max_num_seqs * (seq_blocks + 8)
    # A row per request: its token, and up to max_logprobs + 1 (id, logprob) pairs plus a rank; prompt
    # logprobs the same for every token of the step.
    pairs = min(vocab, config.max_logprobs + 1)
    reply = (sched.max_num_seqs + sched.max_num_batched_tokens) * (2 * pairs + 8)
    return 2 * 9 * broadcast + (1 << 20), 2 * 9 * reply + (1 << 20)


def _bind(sock: zmq.Socket[bytes], addr: str) -> str:
    if addr.endswith(":0"):
        host = addr[: addr.rindex(":")]
        return f"{host}:{sock.bind_to_random_port(host)}"
    sock.bind(addr)
    if addr.startswith("ipc://"):
        os.chmod(addr[len("ipc://") :], 0o600)  # the folder is 0700 already; the socket file too
    return addr


class _Watchdog:
    """Driver side of the heartbeats: a thread with its own socket (so a main thread blocked in a
    collective, as torchrun's rank 0 can be, does not stop it) that notes each watched rank's last
    heartbeat and when a heartbeat connection closed. It publishes `silent` (rank -> seconds without a
    heartbeat, for ranks quiet over _QUIET_S) and `lost` (silent ranks whose connection closed: dead),
    recomputed after every read, so a backlog of unread heartbeats never looks like silence."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str, key: bytes) -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, FRAME_OVERHEAD)  # heartbeats are empty frames
        self.address = _bind(self.sock, address)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.verifier = Verifier(key, HEARTBEATS, "the driver's heartbeat socket")
        self.watched: tuple[int, ...] = ()
        self.last_seen: dict[int, float] = {}
        self.silent: dict[int, float] = {}
        self.lost: list[int] = []
        # torchrun: set while rank 0's own worker runs (it may block in a collective); with hard_exit the
        # watchdog ends the process when a watched rank is dead or silent and that call does not return.
        self.hard_exit = False
        self.busy_since: float | None = None
        self.disconnected_at: float | None = None
        self._problem_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tp-runtime-watchdog", daemon=True)
        self._thread.start()

    def watch(self, ranks: list[int]) -> None:
        now = time.monotonic()
        for r in ranks:
            self.last_seen[r] = now
        self.watched = tuple(ranks)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_LIVENESS_POLL_MS))
                now = time.monotonic()
                if self.sock in ready:
                    self._read_heartbeats(now)
                if self.monitor in ready:
                    while self.monitor.poll(0):
                        self.monitor.recv_multipart()
                    self.disconnected_at = now
                self._judge(time.monotonic())
                self.verifier.drops.flush()
        finally:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.sock.close(linger=0)

    def _read_heartbeats(self, now: float) -> None:
        for _ in range(1000):  # a flood of garbage must not keep the verdicts from being updated
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            with contextlib.suppress(FrameRejected):
                sender, _ = self.verifier.open(frame)
                self.last_seen[sender] = now

    def _judge(self, now: float) -> None:
        last_seen = self.last_seen
        silent = {r: now - last_seen[r] for r in self.watched if now - last_seen[r] > _QUIET_S}
        self.silent = silent
        t = self.disconnected_at
        if t is not None and now - t > _QUIET_S:
            self.lost = [r for r in silent if last_seen[r] < t]
        if self.hard_exit:
            self._end_job_if_stuck(now)

    def late(self) -> dict[int, float]:
        """Ranks silent for HEARTBEAT_TIMEOUT_S or more, and for how long."""
        return {r: age for r, age in self.silent.items() if age >= HEARTBEAT_TIMEOUT_S}

    def verdict(self) -> TPRuntimeError | None:
        """The error a dead (connection closed, silent) or long-silent rank means, if any."""
        if self.lost:
            return WorkerDiedError(
                self.lost[0],
                "its connection to the driver closed and its heartbeats stopped (killed or crashed); the "
                "engine is shutting the other ranks down",
            )
        late = self.late()
        if late:
            rank = max(late, key=lambda r: late[r])
            return _stalled_error(rank, late[rank], "it is stopped or hung")
        return None

    def _end_job_if_stuck(self, now: float) -> None:
        busy = self.busy_since
        problem = self.verdict() if busy is not None else None
        if problem is None:
            self._problem_since = None
            return
        if self._problem_since is None:
            self._problem_since = now
        assert busy is not None
        if now - self._problem_since >= _HARD_EXIT_GRACE_S and now - busy >= _HARD_EXIT_GRACE_S:
            why = "rank 0 is blocked in a collective with it, so the job ends now"
            print(f"tp-runtime: error: {problem}; {why}", file=sys.stderr, flush=True)
            os._exit(1)


def _stalled_error(rank: int, silent_s: float, state: str) -> StepTimeoutError:
    return StepTimeoutError(
        f"rank {rank} sent no heartbeat for {silent_s:.1f} s: {state}, and every other rank waits for it in "
        "its next collective"
    )


class _Channel:
    """Driver side of the sockets: authenticated broadcasts out, authenticated replies in, and the
    heartbeat watchdog. Inbound sizes are bounded and nothing peers send to the broadcast socket is kept."""

    def __init__(
        self, broadcast_addr: str, results_addr: str, heartbeat_addr: str, key: bytes, max_reply_bytes: int
    ) -> None:
        self.key = key
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscriber, not only the first
        # Bounded: a peer that subscribes and never reads (only possible across hosts, where the sockets
        # are TCP) has broadcasts dropped past this many instead of queued without limit. A real worker
        # is at most a step or two behind.
        self.pub.setsockopt(zmq.SNDHWM, 10_000)
        self.pub.setsockopt(zmq.RCVHWM, 16)
        self.pub.setsockopt(zmq.MAXMSGSIZE, _BROADCAST_INBOUND_MAX)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.MAXMSGSIZE, max_reply_bytes + FRAME_OVERHEAD)
        self.broadcast_addr = _bind(self.pub, broadcast_addr)
        self.results_addr = _bind(self.pull, results_addr)
        self.writer = FrameWriter(driver_message_codec(), key, BROADCAST, DRIVER_ID)
        self.reader = FrameReader(worker_reply_codec(), key, REPLIES, "the driver's reply socket")
        self.watchdog = _Watchdog(self.ctx, heartbeat_addr, key)
        self.next_call_id = 0

    def send(self, message: DriverMessage) -> None:
        self.pub.send(self.writer.encode(message))

    def discard_inbound(self) -> None:
        """Read and drop what peers sent to the broadcast socket (subscriptions after start-up, anything
        else). Waits call it at least every _LIVENESS_POLL_MS; in between, each call into the socket
        queues at most RCVHWM more messages of at most _BROADCAST_INBOUND_MAX bytes per peer."""
        with contextlib.suppress(zmq.Again):
            while True:
                self.pub.recv(zmq.NOBLOCK)

    def close(self) -> None:
        self.watchdog.stop()
        self.ctx.destroy(linger=0)


def _ipc_channel(folder: str, key: bytes, max_reply_bytes: int) -> _Channel:
    tag = uuid.uuid4().hex[:8]
    return _Channel(
        f"ipc://{folder}/bcast-{tag}", f"ipc://{folder}/results-{tag}", f"ipc://{folder}/heartbeat-{tag}",
        key, max_reply_bytes,
    )  # fmt: skip


@dataclass
class _Expected:
    """The replies a wait collects: `kind` ("result" / "ready") for `call_id` from `ranks`."""

    call_id: int
    kind: str
    ranks: set[int]
    results: dict[int, Any] = field(default_factory=dict)


def _output_problem(out: ModelRunnerOutput) -> str | None:
    """What is inconsistent in an output, if anything (its lists must agree in length)."""
    n = len(out.req_ids)
    if len(out.sampled_token_ids) != n:
        return f"has {n} request ids but {len(out.sampled_token_ids)} sampled token ids"
    lp = out.logprobs
    if lp is not None:
        for name in ("token_ids", "logprobs", "sampled_ranks"):
            rows = len(getattr(lp, name))
            if rows != n:
                return f"has {n} request ids but {rows} rows of logprobs.{name}"
        for i, (ids, values) in enumerate(zip(lp.token_ids, lp.logprobs, strict=True)):
            if len(ids) != len(values):
                return f"has {len(ids)} token ids but {len(values)} logprobs in logprob row {i}"
    for p in getattr(out, "prompt_logprobs", None) or []:
        lengths = {len(p.token_ids), len(p.logprobs), len(p.ranks)}
        if len(lengths) > 1 or any(len(a) != len(b) for a, b in zip(p.token_ids, p.logprobs, strict=True)):
            return f"has prompt logprobs of request {p.req_id} whose lists differ in length"
    return None


class _RemoteWorkers:
    """Sends to and waits on remote ranks; subclasses say how to tell whether a rank is alive.

    Steps are tracked from submission to answer: rank 0 answers each step once, in the order they were
    sent, so an authentic output for any other step is a ProtocolError, never something to wait past."""

    settle_s = 0.5  # how long an error reply waits for a rank's death to show (the dead rank is named)

    def __init__(self, channel: _Channel, remote_ranks: list[int], spin_wait_s: float) -> None:
        self.channel = channel
        self.remote_ranks = remote_ranks
        self.spin_wait_s = spin_wait_s
        self.closed = False
        self.in_flight: dict[int, None] = {}  # steps sent and not answered yet, oldest first
        self.arrived: dict[int, ModelRunnerOutput] = {}  # answered, not asked for yet
        self.abandoned: set[int] = set()  # in flight but no longer wanted (their requests were aborted)
        self.answered: deque[int] = deque(maxlen=64)  # to tell a duplicate from a step never sent

    def _check_processes(self, settle_s: float) -> None:
        """Raise WorkerDiedError for a rank that is gone (waiting up to settle_s for one to go)."""

    def _stopped(self, rank: int) -> bool:
        """Whether the rank's process is known to be stopped by a signal (only for local processes)."""
        return False

    def _maybe_busy(self, rank: int) -> bool:
        """Whether a silent rank may just be busy holding the GIL (a long compile, say), not stuck."""
        return False

    def check_alive(self, settle_s: float = 0.0) -> None:
        if self.closed:
            raise EngineClosedError(_CLOSED)
        self._check_processes(settle_s)
        for rank, silent_s in self.channel.watchdog.late().items():
            if not self._maybe_busy(rank):
                state = "it is stopped by a signal" if self._stopped(rank) else "it is stopped or hung"
                raise _stalled_error(rank, silent_s, state)

    def broadcast(self, message: DriverMessage) -> None:
        self.channel.send(message)

    def submitted(self, step_id: int) -> None:
        self.in_flight[step_id] = None

    def wait_for_subscribers(self, deadline: float) -> None:
        subscribed = 0
        while subscribed < len(self.remote_ranks):
            if self.channel.pub.poll(_LIVENESS_POLL_MS):
                event = self.channel.pub.recv()
                if event[:1] == b"\x01":
                    subscribed += 1
            self.check_alive()
            if time.monotonic() > deadline:
                raise StepTimeoutError("workers did not connect to the driver in time")

    def _serve(self, done: Callable[[], bool], expected: _Expected | None, timeout_s: float) -> None:
        """Handle replies until done(); a worker error, a death or the timeout raises."""
        start = time.monotonic()
        deadline, next_check = start + timeout_s, start + _LIVENESS_POLL_MS / 1000
        pull, reader, spin_s = self.channel.pull, self.channel.reader, self.spin_wait_s
        while not done():
            data = recv_spinning(pull, spin_s, _LIVENESS_POLL_MS)
            if data is not None:
                opened = reader.read(data)
                if opened is not None:
                    self._handle(*opened, expected)
            now = time.monotonic()
            # Checked on every pass, not only when the socket is quiet: a flood of frames must not
            # postpone the timeout or the liveness checks.
            if data is None or now >= next_check:
                next_check = now + _LIVENESS_POLL_MS / 1000
                self.channel.discard_inbound()
                reader.drops.flush()
                self.check_alive()
            if now > deadline and not done():
                raise self._timeout(expected, timeout_s)

    def _handle(self, sender: int, reply: WorkerReply, expected: _Expected | None) -> None:
        if reply.rank != sender:
            raise ProtocolError(f"a reply signed by rank {sender} says it comes from rank {reply.rank}")
        if reply.kind == "error":
            # A rank that died takes its peers' collectives down with it; name the dead rank, not the
            # survivor whose all-reduce failed.
            self.check_alive(settle_s=self.settle_s)
            raise WorkerError(reply.rank, reply.error or "(no traceback)")
        if reply.kind == "output":
            self._accept_output(reply)
            return
        if (
            expected is not None
            and reply.kind == expected.kind
            and reply.call_id == expected.call_id
            and reply.rank in expected.ranks
        ):
            if reply.rank in expected.results:
                raise ProtocolError(f"rank {reply.rank} sent its {reply.kind} of call {reply.call_id} twice")
            expected.results[reply.rank] = reply.result
            return
        waiting = f"; waiting for the {expected.kind} of call {expected.call_id}" if expected else ""
        raise ProtocolError(
            f"rank {reply.rank} sent an unexpected {reply.kind!r} reply for call {reply.call_id}{waiting}"
        )

    def _accept_output(self, reply: WorkerReply) -> None:
        step, out = reply.call_id, reply.output
        if reply.rank != 0:
            raise ProtocolError(f"rank {reply.rank} sent an output (step {step}); only rank 0 answers steps")
        if out is None or out.step_id != step:
            carried = "no output" if out is None else f"the output of step {out.step_id}"
            raise ProtocolError(f"rank 0's reply for step {step} carries {carried}")
        if step not in self.in_flight:
            if step in self.answered:
                raise ProtocolError(f"rank 0 answered step {step} twice (a duplicate reply)")
            raise ProtocolError(
                f"rank 0 answered step {step}, which is not in flight (in flight: {list(self.in_flight)})"
            )
        oldest = next(iter(self.in_flight))
        if step != oldest:
            raise ProtocolError(
                f"rank 0 answered step {step} before step {oldest} (steps are answered in the order sent)"
            )
        problem = _output_problem(out)
        if problem is not None:
            raise ProtocolError(f"rank 0's output of step {step} {problem}")
        del self.in_flight[step]
        self.answered.append(step)
        if step in self.abandoned:
            self.abandoned.discard(step)
        else:
            self.arrived[step] = out

    def _timeout(self, expected: _Expected | None, timeout_s: float) -> StepTimeoutError:
        missing = sorted(expected.ranks - expected.results.keys()) if expected else [0]
        stalled = {r: f"sent no heartbeat for {age:.1f} s" for r, age in self.channel.watchdog.silent.items()}
        stalled.update({r: "is stopped by a signal" for r in self.remote_ranks if self._stopped(r)})
        if stalled:
            who = "the stalled rank: " + ", ".join(f"rank {r} {why}" for r, why in sorted(stalled.items()))
        else:
            who = (
                "the stalled rank is unknown (every rank still sends heartbeats: the step is slower than the "
                "timeout, or a rank is stuck inside a collective)"
            )
        return StepTimeoutError(
            f"no reply from rank(s) {missing} within {timeout_s:g} s; {who}. One slow or stuck rank stalls "
            "every rank of the group; raise step_timeout_s if steps are expected to take this long"
        )

    def wait_replies(self, call_id: int, kind: str, ranks: set[int], timeout_s: float) -> dict[int, Any]:
        """Replies of `kind` for `call_id` from `ranks`; a worker error or death raises at once."""
        expected = _Expected(call_id, kind, ranks)
        self._serve(lambda: len(expected.results) == len(ranks), expected, timeout_s)
        return expected.results

    def wait_output(self, step_id: int, timeout_s: float) -> ModelRunnerOutput:
        for older in [s for s in self.in_flight if s < step_id]:  # steps of aborted requests
            self.abandoned.add(older)
        for older in [s for s in self.arrived if s < step_id]:
            del self.arrived[older]
        if step_id not in self.arrived and step_id not in self.in_flight:
            raise RuntimeError(f"internal: step {step_id} was never submitted")
        arrived = self.arrived
        self._serve(lambda: step_id in arrived, None, timeout_s)
        return arrived.pop(step_id)

    def poll_errors(self) -> None:
        """Handle whatever replies are waiting, without waiting (torchrun: only errors can be)."""
        reader = self.channel.reader
        while self.channel.pull.poll(0):
            opened = reader.read(self.channel.pull.recv())
            if opened is not None:
                self._handle(*opened, None)

    def wait_ready(self) -> dict[int, Any]:
        ready = self.wait_replies(-1, "ready", set(self.remote_ranks), _STARTUP_TIMEOUT_S)
        self.channel.watchdog.watch(self.remote_ranks)
        return ready


def _process_state(pid: int | None) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _worker_environment() -> dict[str, str]:
    """The driver's environment (TRITON_INTERPRET, NCCL_*, CUDA_VISIBLE_DEVICES...), with the folder this
    tp_runtime package was imported from put first on PYTHONPATH when it is not an installed location (a
    source checkout imported through the driver's sys.path), so a worker imports the same package."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(tp_runtime.__file__)))
    installed = {os.path.abspath(p) for p in site.getsitepackages()}
    if site.ENABLE_USER_SITE:
        installed.add(os.path.abspath(site.getusersitepackages()))
    if root not in installed:
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if root not in paths:
            env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


class _SpawnedWorkers(_RemoteWorkers):
    """Ranks started as fresh interpreters (`python -m tp_runtime.worker_process`). Each gets its
    arguments as one frame on its stdin, which the driver then holds open: the workers see EOF, and exit,
    when the driver dies. A death is seen through Popen.poll() between polls for replies."""

    def __init__(self, config: EngineConfig, channel: _Channel) -> None:
        super().__init__(
            channel, list(range(config.parallel.tensor_parallel_size)), config.parallel.spin_wait_s
        )
        self.config = config
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, init_method: str | None) -> None:
        channel = self.channel
        env = _worker_environment()
        for rank in self.remote_ranks:
            # The key travels only in this frame, over the child's stdin: never on its command line (ps
            # shows that) or in its environment, and never pickled.
            frame = encode_spawn_args(
                SpawnArgs(
                    config=self.config, rank=rank, local_rank=rank, broadcast=channel.broadcast_addr,
                    results=channel.results_addr, heartbeat=channel.watchdog.address,
                    max_broadcast_bytes=message_limits(self.config)[0], key=channel.key,
                    init_method=init_method,
                )
            )  # fmt: skip
            # A session of its own: a Ctrl-C at the terminal (SIGINT to the foreground process group)
            # reaches only the driver, which shuts the workers down; they print nothing.
            proc = subprocess.Popen(
                [sys.executable, "-m", "tp_runtime.worker_process"], stdin=subprocess.PIPE, env=env,
                bufsize=0, close_fds=True, start_new_session=True,
            )  # fmt: skip
            self.procs.append(proc)
            assert proc.stdin is not None
            # A worker that died at once is reported by the liveness checks, with its exit code.
            with contextlib.suppress(BrokenPipeError):
                view = memoryview(frame)
                while view:  # an unbuffered write may be partial
                    view = view[proc.stdin.write(view) or 0 :]

    def _check_processes(self, settle_s: float) -> None:
        deadline = time.monotonic() + settle_s
        while True:
            for rank, proc in enumerate(self.procs):
                code = proc.poll()
                if code is not None:
                    detail = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
                    raise WorkerDiedError(rank, f"{detail}; the engine is shutting the other workers down")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.02)

    def _stopped(self, rank: int) -> bool:
        return _process_state(self.procs[rank].pid) in ("T", "t")

    def _maybe_busy(self, rank: int) -> bool:
        # Silent but running: its main thread may hold the GIL for long (a Triton compile); the step
        # timeout still bounds the wait. Stopped (T) or asleep while silent (S, D): stuck.
        return _process_state(self.procs[rank].pid) == "R"

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self, grace_s: float) -> None:
        """Wait up to grace_s for workers to leave after the Shutdown message, then SIGTERM, then SIGKILL."""
        self.closed = True
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.poll() is None:
                # A stopped process cannot act on SIGTERM: do not wait for it.
                p.kill() if _process_state(p.pid) in ("T", "t") else p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=2.0)
        for p in self.procs:
            if p.stdin is not None:
                with contextlib.suppress(OSError):
                    p.stdin.close()


class MultiprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.ipc_dir = tempfile.mkdtemp(prefix="tp-runtime-")  # 0700: only this user reaches the sockets
        self.channel = _ipc_channel(self.ipc_dir, secrets.token_bytes(32), message_limits(config)[1])
        self.workers = _SpawnedWorkers(config, self.channel)
        self._shut_down = False
        self.last_step_timings: dict[str, float] = {}
        self._last_sent_step: int | None = None  # a step with nothing sent after it yet

    def initialize(self) -> int:
        tp = self.config.parallel.tensor_parallel_size
        # A FileStore in the private folder: torch's TCPStore would listen on every interface.
        init_method = f"file://{self.ipc_dir}/process-group-store" if tp > 1 else None
        try:
            self.workers.start(init_method)
            deadline = time.monotonic() + _STARTUP_TIMEOUT_S
            self.workers.wait_for_subscribers(deadline)
            self.workers.wait_ready()
            return _size_kv_cache(self)
        except BaseException:
            self.shutdown(grace_s=0.5)
            raise

    def _guarded(self, fn: Callable[[], T]) -> T:
        """Run fn; on any failure shut every worker down before re-raising."""
        try:
            return fn()
        except BaseException:
            # Survivors may be stuck in a collective with the failed rank: do not wait long for them.
            self.shutdown(grace_s=0.5)
            raise

    def submit(self, so: SchedulerOutput) -> None:
        def run() -> None:
            t0 = time.perf_counter()
            # Liveness is checked while waiting (each time the reply poll times out), not per step.
            self._check_open()
            self.workers.broadcast(ExecuteModel(so))
            self.workers.submitted(so.step_id)
            self._last_sent_step = so.step_id
            self.last_step_timings = {"encode_broadcast": time.perf_counter() - t0}

        self._guarded(run)

    def wait_output(self, step_id: int) -> ModelRunnerOutput:
        def run() -> ModelRunnerOutput:
            self._check_open()
            if self._last_sent_step == step_id and self.config.async_scheduling:
                # Rank 0 holds a step's answer back until the next step arrives; none is coming.
                self.workers.broadcast(Flush())
                self._last_sent_step = None
            return self.workers.wait_output(step_id, self.config.parallel.step_timeout_s)

        return self._guarded(run)

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        def run() -> list[Any]:
            channel = self.channel
            call_id = channel.next_call_id
            channel.next_call_id += 1
            self._check_open()
            self.workers.check_alive()
            self.workers.broadcast(ControlCall(call_id, method, list(args or [])))
            self._last_sent_step = None
            ranks = set(self.workers.remote_ranks)
            results = self.workers.wait_replies(call_id, "result", ranks, self.config.parallel.step_timeout_s)
            return [results[r] for r in sorted(results)]

        return self._guarded(run)

    def _check_open(self) -> None:
        if self._shut_down:
            raise EngineClosedError(_CLOSED)

    def worker_pids(self) -> list[int]:
        return self.workers.pids()

    def shutdown(self, grace_s: float = 5.0) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        with contextlib.suppress(zmq.ZMQError):
            self.workers.broadcast(Shutdown())
        self.workers.stop(grace_s)
        self.channel.close()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


class _TorchrunRemotes(_RemoteWorkers):
    """Ranks > 0 of a torchrun job: no process handles, so a death shows as a closed heartbeat connection
    followed by silence (which takes up to _QUIET_S to tell apart from a reconnect)."""

    settle_s = _QUIET_S + 1.0

    def _check_processes(self, settle_s: float) -> None:
        """With settle_s, wait for a closed connection to show (0.3 s at most); after one, wait up to
        settle_s for the silence that names the dead rank."""
        watchdog = self.channel.watchdog
        start = time.monotonic()
        while True:
            problem = watchdog.verdict()
            if isinstance(problem, WorkerDiedError):
                raise problem
            now = time.monotonic()
            closed_at = watchdog.disconnected_at
            death_shown = closed_at is not None and now - closed_at < settle_s + _QUIET_S
            if now - start >= (settle_s if death_shown else min(settle_s, 0.3)):
                return
            time.sleep(0.05)


class TorchrunExecutor:
    """Rank 0 of a torchrun job: hosts the driver and rank 0's worker; other ranks connect over TCP."""

    def __init__(self, config: EngineConfig, worker: Worker, host: str, key: bytes) -> None:
        self.config = config
        self.worker = worker
        tp = config.parallel.tensor_parallel_size
        self.ipc_dir: str | None = None
        if host == _ONE_HOST:
            # Every rank is on this host: ipc sockets in a 0700 folder, which no other user can reach
            # (a loopback TCP port would let any local user subscribe to the broadcasts and read them).
            self.ipc_dir = tempfile.mkdtemp(prefix="tp-runtime-")
            self.channel = _ipc_channel(self.ipc_dir, key, message_limits(config)[1])
        else:
            addr = f"tcp://{host}:0"
            self.channel = _Channel(addr, addr, addr, key, message_limits(config)[1])
        self.channel.watchdog.hard_exit = True
        self.remote = _TorchrunRemotes(self.channel, list(range(1, tp)), config.parallel.spin_wait_s)
        self._shut_down = False
        self.last_step_timings: dict[str, float] = {}
        self.pending = _PendingSteps()

    def initialize(self) -> int:
        try:
            self.remote.wait_for_subscribers(time.monotonic() + _STARTUP_TIMEOUT_S)
            self.remote.wait_ready()
            return _size_kv_cache(self)
        except BaseException:
            self.shutdown()
            raise

    def _guarded(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except BaseException:
            self.shutdown()
            raise

    def _local(self, fn: Callable[[], T]) -> T:
        """Run rank 0's own worker. Its collectives fail (gloo: at once) or block when another rank dies or
        stops: name that rank rather than rank 0; the watchdog ends a call that stays blocked."""
        watchdog = self.channel.watchdog
        watchdog.busy_since = time.monotonic()
        try:
            return fn()
        except TPRuntimeError:
            raise
        except Exception as exc:
            self.remote.check_alive(settle_s=self.remote.settle_s)
            raise WorkerError(0, traceback.format_exc()) from exc
        finally:
            watchdog.busy_since = None

    def submit(self, so: SchedulerOutput) -> None:
        def run() -> None:
            t0 = time.perf_counter()
            self._check_open()
            self.remote.check_alive()
            self.remote.poll_errors()
            self.remote.broadcast(ExecuteModel(so))
            self.last_step_timings = {"encode_broadcast": time.perf_counter() - t0}
            self.pending.add(self._local(lambda: self.worker.execute_model(so)))

        self._guarded(run)

    def wait_output(self, step_id: int) -> ModelRunnerOutput:
        # Ranks > 0 never answer a step; only an error reply can be waiting from them.
        def run() -> ModelRunnerOutput:
            self._check_open()
            return self._local(lambda: self.pending.resolve(step_id))

        return self._guarded(run)

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        def run() -> list[Any]:
            call_id = self.channel.next_call_id
            self.channel.next_call_id += 1
            self._check_open()
            self.remote.check_alive()
            self.remote.poll_errors()
            self.remote.broadcast(ControlCall(call_id, method, list(args or [])))
            local = self._local(lambda: self.worker.call(method, list(args or [])))
            results = self.remote.wait_replies(
                call_id, "result", set(self.remote.remote_ranks), self.config.parallel.step_timeout_s
            )
            return [local] + [results[r] for r in sorted(results)]

        return self._guarded(run)

    def _check_open(self) -> None:
        if self._shut_down:
            raise EngineClosedError(_CLOSED)

    def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        self.remote.closed = True
        try:
            self.remote.broadcast(Shutdown())
            time.sleep(0.2)  # let the shutdown message leave before the socket closes
        except zmq.ZMQError:
            pass
        self.channel.close()
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        self.worker.shutdown()


_SECRET_HOWTO = (
    "give every node the same secret first, e.g. `export TP_RUNTIME_SECRET=$(python3 -c 'import secrets; "
    "print(secrets.token_hex(32))')` (the same value on every node), or TP_RUNTIME_SECRET_FILE=PATH to a "
    "file holding it"
)


def torchrun_secret() -> bytes | None:
    """The shared secret of a multi-host torchrun job, from TP_RUNTIME_SECRET or TP_RUNTIME_SECRET_FILE."""
    value, path = os.environ.get("TP_RUNTIME_SECRET"), os.environ.get("TP_RUNTIME_SECRET_FILE")
    if value and path:
        raise ConfigError("set TP_RUNTIME_SECRET or TP_RUNTIME_SECRET_FILE, not both")
    if path:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read TP_RUNTIME_SECRET_FILE={path!r}: {exc}") from None
    elif value:
        secret = value.strip().encode()
    else:
        return None
    if len(secret) < 16:
        raise ConfigError(f"the shared secret has {len(secret)} bytes; use at least 16: {_SECRET_HOWTO}")
    return secret


# torchrun_bind_host's answer when every rank runs on this host (the driver then uses ipc sockets).
_ONE_HOST = "127.0.0.1"


def torchrun_bind_host(master_addr: str, world: int, secret: bytes | None) -> str:
    """Where rank 0's driver listens: 127.0.0.1 when every rank runs on this host, else MASTER_ADDR, which
    needs the shared secret unless it is a loopback address. Every rank checks, so all refuse alike."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if local == world:
        return _ONE_HOST
    try:
        ip = socket.gethostbyname(master_addr)  # ZeroMQ binds an address, not a host name
    except OSError as exc:
        raise ConfigError(f"cannot resolve MASTER_ADDR={master_addr!r} to an IPv4 address: {exc}") from None
    if secret is None and not ipaddress.ip_address(ip).is_loopback:
        raise ConfigError(
            f"this torchrun job spans hosts (WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local}), so rank 0's "
            f"driver would listen on MASTER_ADDR={master_addr} ({ip}), which other hosts can reach, with no "
            f"shared secret to authenticate its workers; {_SECRET_HOWTO}"
        )
    return ip


def start_torchrun_rank(config: EngineConfig) -> TorchrunExecutor | None:
    """Join the torchrun job this process belongs to. Rank 0 returns the executor its driver uses; every
    other rank serves as a worker until the driver shuts down, then returns None."""
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ["WORLD_SIZE"])
    if world != config.parallel.tensor_parallel_size:
        raise ConfigError(
            f"torchrun started {world} processes but tensor_parallel_size is "
            f"{config.parallel.tensor_parallel_size}; pass the same number to both"
        )
    secret = torchrun_secret()
    host = torchrun_bind_host(config.parallel.driver_host, world, secret)
    worker = Worker(config, rank, local_rank)
    worker.init_device("env://")
    executor = None
    payload = None
    if rank == 0:
        # A fresh nonce per job: with a secret, frames of another job using the same secret are rejected;
        # without one (one host), the nonce is the key, shared only through the process group.
        nonce = secrets.token_bytes(32)
        key = derive_job_key(secret, nonce)
        executor = TorchrunExecutor(config, worker, host, key)
        ch = executor.channel
        fields = [ch.broadcast_addr, ch.results_addr, ch.watchdog.address, nonce.hex(), key_check(key).hex()]
        payload = "\n".join(fields).encode()  # ipc paths may hold spaces
    broadcast_addr, results_addr, heartbeat_addr, nonce_hex, check_hex = (
        worker.tp.broadcast_bytes(payload, worker.device).decode().split("\n")
    )
    key = derive_job_key(secret, bytes.fromhex(nonce_hex))
    same_key = hmac.compare_digest(key_check(key), bytes.fromhex(check_hex))
    if worker.tp.all_reduce_min_int(int(same_key), worker.device) == 0:
        if executor is not None:
            executor.channel.close()
        raise ConfigError(
            "the ranks of this torchrun job hold different shared secrets; set the same TP_RUNTIME_SECRET "
            "(or TP_RUNTIME_SECRET_FILE contents) on every node"
        )
    worker.load_model()
    if executor is not None:
        return executor
    addresses = WorkerAddresses(broadcast_addr, results_addr, key, heartbeat_addr, message_limits(config)[0])
    run_worker_loop(config, rank, local_rank, addresses, None, worker=worker, exit_if_driver_leaves=True)
    return None


def executor_kind(config: EngineConfig) -> str:
    kind = config.parallel.executor
    if kind == "auto":
        if os.environ.get("TORCHELASTIC_RUN_ID") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return "torchrun"
        return "inprocess" if config.parallel.tensor_parallel_size == 1 else "multiprocess"
    return kind
