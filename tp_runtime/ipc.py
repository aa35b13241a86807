"""The driver's side of the ZeroMQ sockets: authenticated broadcasts out, authenticated replies in, and the
heartbeat watchdog that names a silent or dead rank. The frame format is serialize.py's; the workers' side
of the same sockets is worker/worker.py's run_worker_loop."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid

import zmq
from zmq.utils.monitor import parse_monitor_message

from tp_runtime.config import EngineConfig
from tp_runtime.errors import (
    ConfigError,
    ProtocolError,
    StepTimeoutError,
    TPRuntimeError,
    WorkerDiedError,
)
from tp_runtime.messages import (
    DriverMessage,
    sampling_ids_limit,
)
from tp_runtime.serialize import (
    BROADCAST,
    DRIVER_ID,
    FRAME_OVERHEAD,
    HEARTBEAT_INTERVAL_S,
    HEARTBEATS,
    REPLIES,
    FrameReader,
    FrameRejected,
    FrameWriter,
    Verifier,
    driver_message_codec,
    secure_server,
    worker_reply_codec,
)

# How often a blocked driver wakes to check that its workers are alive.
LIVENESS_POLL_MS = 100
# A rank silent this long is reported as stopped or hung (StepTimeoutError naming it) without waiting for
# step_timeout_s: every other rank waits for it in its next collective anyway.
HEARTBEAT_TIMEOUT_S = 5.0
# A rank silent this long is a suspect: named by a step timeout, or, after its connection closed, dead.
QUIET_S = 3 * HEARTBEAT_INTERVAL_S
# torchrun: rank 0's own worker can block inside a collective with a dead or stopped rank, where no error
# reaches it; the watchdog ends the process this long after it has named the rank.
_HARD_EXIT_GRACE_S = 2.0
# Replies queued per connection on the driver's reply socket.
_REPLIES_QUEUED = 16
# Peers only send subscription messages to the broadcast socket (1 byte: workers subscribe to everything).
_BROADCAST_INBOUND_MAX = 64


def message_limits(config: EngineConfig) -> tuple[int, int]:
    """The largest legitimate (broadcast, reply) frame of this config, doubled, plus 1 MiB for headers,
    control calls and tracebacks: each receiving socket's zmq.MAXMSGSIZE. Numbers count 9 bytes (the
    widest msgpack integer or float)."""
    model, sched = config.model, config.scheduler
    vocab, seq_blocks = model.vocab_size, model.max_model_len // config.cache.block_size + 2
    # A new request carries all its tokens, its block ids and its sampling lists (refused beyond
    # sampling_ids_limit); every scheduled request carries at most its new block ids.
    new_requests = min(sched.max_num_seqs, sched.max_num_batched_tokens)
    broadcast = new_requests * (model.max_model_len + seq_blocks + sampling_ids_limit(vocab) + 64)
    broadcast += sched.max_num_seqs * (seq_blocks + 8)
    # A row per request: its token, and up to max_logprobs + 1 (id, logprob) pairs plus a rank; prompt
    # logprobs the same for every token of the step.
    pairs = min(vocab, config.max_logprobs + 1)
    reply = (sched.max_num_seqs + sched.max_num_batched_tokens) * (2 * pairs + 8)
    return 2 * 9 * broadcast + (1 << 20), 2 * 9 * reply + (1 << 20)


def bind_socket(sock: zmq.Socket[bytes], addr: str) -> str:
    if addr.endswith(":0"):
        host = addr[: addr.rindex(":")]
        return f"{host}:{sock.bind_to_random_port(host)}"
    sock.bind(addr)
    if addr.startswith("ipc://"):
        os.chmod(addr[len("ipc://") :], 0o600)  # the folder is 0700 already; the socket file too
    return addr


# The descriptor a received message came in on (ZMQ_SRCFD; deprecated in libzmq, still served).
_SOURCE_FD = getattr(zmq, "SRCFD", 2)


class Watchdog:
    """Driver side of the heartbeats: a thread with its own socket (so a main thread blocked in a
    collective, as torchrun's rank 0 can be, does not stop it) that notes each watched rank's last
    heartbeat and when a heartbeat connection closed. It publishes `silent` (rank -> seconds without a
    heartbeat, for ranks quiet over QUIET_S) and `lost` (silent ranks whose connection closed: dead),
    recomputed after every read, so a backlog of unread heartbeats never looks like silence.

    A closed connection counts only when it is a rank's: each authenticated heartbeat tells which
    connection (file descriptor) the rank uses, and a disconnect event names the descriptor. A peer that
    is not a rank (across hosts the socket is TCP) can connect and leave without making anyone "dead"."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str, key: bytes) -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, FRAME_OVERHEAD)  # heartbeats are empty frames
        secure_server(self.sock, address, key)
        self.address = bind_socket(self.sock, address)
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
        self.disconnected_at: float | None = None  # the last time a rank's connection closed
        self.closed_at: dict[int, float] = {}  # rank -> when its connection closed
        self._connection_of: dict[int, int] = {}  # rank -> descriptor its heartbeats arrive on
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
                ready = dict(poller.poll(LIVENESS_POLL_MS))
                now = time.monotonic()
                if self.sock in ready:
                    self._read_heartbeats(now)
                if self.monitor in ready:
                    while self.monitor.poll(0):
                        event = parse_monitor_message(self.monitor.recv_multipart())
                        self._connection_closed(int(event["value"]), now)
                self._judge(time.monotonic())
                self.verifier.drops.flush()
        finally:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.sock.close(linger=0)

    def _connection_closed(self, fd: int, now: float) -> None:
        ranks = [r for r, known in self._connection_of.items() if known == fd]
        for rank in ranks:
            del self._connection_of[rank]
            self.closed_at[rank] = now
            self.disconnected_at = now

    def _read_heartbeats(self, now: float) -> None:
        for _ in range(1000):  # a flood of garbage must not keep the verdicts from being updated
            try:
                frame = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            with contextlib.suppress(FrameRejected):
                sender, _ = self.verifier.open(frame.bytes)
                self.last_seen[sender] = now
                with contextlib.suppress(zmq.ZMQError):
                    self._connection_of[sender] = frame.get(_SOURCE_FD)

    def _judge(self, now: float) -> None:
        last_seen = self.last_seen
        silent = {r: now - last_seen[r] for r in self.watched if now - last_seen[r] > QUIET_S}
        self.silent = silent
        closed = self.closed_at
        # Dead: silent, and its own connection closed (after its last heartbeat) long enough ago.
        self.lost = [r for r in silent if now - closed.get(r, now) > QUIET_S and last_seen[r] < closed[r]]
        if self.hard_exit:
            self._end_job_if_stuck(now)

    def connected_all(self) -> bool:
        """Whether every watched rank's heartbeats have arrived on a connection of its own."""
        return all(r in self._connection_of for r in self.watched)

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
            return stalled_error(rank, late[rank], "it is stopped or hung")
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


def stalled_error(rank: int, silent_s: float, state: str) -> StepTimeoutError:
    return StepTimeoutError(
        f"rank {rank} sent no heartbeat for {silent_s:.1f} s: {state}, and every other rank waits for it in "
        "its next collective"
    )


class DriverChannel:
    """Driver side of the sockets: authenticated broadcasts out, authenticated replies in, and the
    heartbeat watchdog. Inbound sizes are bounded and nothing peers send to the broadcast socket is kept."""

    def __init__(
        self, broadcast_addr: str, results_addr: str, heartbeat_addr: str, key: bytes, max_reply_bytes: int,
        max_broadcast_bytes: int | None = None,
    ) -> None:  # fmt: skip
        """`max_broadcast_bytes`: the workers' limit on a broadcast (message_limits); a larger one is an
        error here, where libzmq would drop it unseen at the workers."""
        self.key = key
        self.max_broadcast_bytes = max_broadcast_bytes
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
        # Few messages queued per connection (libzmq's default is 1000 of up to MAXMSGSIZE each): a peer
        # that floods the socket holds at most _REPLIES_QUEUED frames, and a rank's sends wait instead (it
        # has at most a few replies out: two steps in flight, a control call, an error). The bound is per
        # connection, and libzmq caps no count of them: on ipc only this user's processes can connect
        # (the folder is 0700), over TCP only holders of the job's key (CurveZMQ refuses others).
        self.pull.setsockopt(zmq.RCVHWM, _REPLIES_QUEUED)
        secure_server(self.pub, broadcast_addr, key)
        secure_server(self.pull, results_addr, key)
        self.broadcast_addr = bind_socket(self.pub, broadcast_addr)
        self.results_addr = bind_socket(self.pull, results_addr)
        self.writer = FrameWriter(driver_message_codec(), key, BROADCAST, DRIVER_ID)
        self.reader = FrameReader(worker_reply_codec(), key, REPLIES, "the driver's reply socket")
        self.watchdog = Watchdog(self.ctx, heartbeat_addr, key)
        self.next_call_id = 0
        # The broadcast socket and its sequence numbers are shared by the engine's thread and a shutdown()
        # from another: a frame sealed before another but sent after it is dropped by the ranks as a replay
        # (a Shutdown lost so), and a libzmq socket takes one thread at a time.
        self._broadcast_lock = threading.Lock()

    def send(self, message: DriverMessage) -> None:
        with self._broadcast_lock:
            frame = self.writer.encode(message)
            if self.max_broadcast_bytes is not None and len(frame) > self.max_broadcast_bytes:
                raise ProtocolError(
                    f"a {type(message).__name__} of {len(frame)} bytes exceeds the workers' message limit "
                    f"of {self.max_broadcast_bytes} bytes (not sent)"
                )
            self.pub.send(frame)

    def discard_inbound(self) -> None:
        """Read and drop what peers sent to the broadcast socket (subscriptions after start-up, anything
        else). Waits call it at least every LIVENESS_POLL_MS; in between, each call into the socket
        queues at most RCVHWM more messages of at most _BROADCAST_INBOUND_MAX bytes per peer (on TCP, room
        for CURVE's handshake: serialize.secure_server)."""
        with self._broadcast_lock, contextlib.suppress(zmq.Again):
            while True:
                self.pub.recv(zmq.NOBLOCK)

    def close(self) -> None:
        self.watchdog.stop()
        self.ctx.destroy(linger=0)


# The longest path of a Unix socket on this platform (libzmq's limit: sun_path less its NUL).
_MAX_IPC_PATH = getattr(zmq, "IPC_PATH_MAX_LEN", 103)


def ipc_channel(
    key: bytes, max_reply_bytes: int, prefix: str = "tp-runtime-", max_broadcast_bytes: int | None = None
) -> tuple[str, DriverChannel]:
    """A driver channel on ipc sockets in a fresh private (0700) temporary folder, which only this user
    reaches; returns the folder (the caller removes it at shutdown) and the channel. A failure removes it."""
    folder = tempfile.mkdtemp(prefix=prefix)
    try:
        tag = uuid.uuid4().hex[:8]
        longest = f"{folder}/heartbeat-{tag}"
        if len(longest.encode()) > _MAX_IPC_PATH:
            raise ConfigError(
                f"the engine's sockets go in the temporary folder {folder}, whose paths would be longer than "
                f"{_MAX_IPC_PATH} bytes (a Unix socket's limit); set TMPDIR to a shorter folder, e.g. /tmp"
            )
        return folder, DriverChannel(
            f"ipc://{folder}/bcast-{tag}", f"ipc://{folder}/results-{tag}", f"ipc://{folder}/heartbeat-{tag}",
            key, max_reply_bytes, max_broadcast_bytes,
        )  # fmt: skip
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


