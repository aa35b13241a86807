"""Only the engine's own processes are heard, nothing listens beyond loopback, and a dead or stopped rank
is named (issue 10, the transport part).

- Frames: HMAC and sequence checks of serialize.py, without processes.
- Spawned TP=2 engines on CPU (tiny model): forged, garbage, unauthenticated, oversized, duplicated and
  reordered frames pushed into each driver socket are dropped and the outputs still equal HF's greedy
  tokens; an authentic but inconsistent reply is a ProtocolError naming the problem; the engine's
  processes listen on loopback only and its ipc files are private; a SIGSTOPped rank is named.
- torchrun: two "nodes" on one host need the shared secret when MASTER_ADDR is a real interface; a killed
  or stopped rank on the other node is noticed by rank 0 within 10 s and the job leaves no process.

Faults are injected on observed events (the engine waiting for its k-th step, the first output printed),
never on timers racing the work.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import os
import queue
import secrets
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import fail_on_hang, hf_greedy, random_prompts
from test_faults import alive, describe, kill_quietly, spawned_children, wait_gone

from tp_runtime import LLM, SamplingParams
from tp_runtime.config import CacheConfig, EngineConfig, SchedulerConfig, build_model_config
from tp_runtime.errors import ConfigError, EngineClosedError, ProtocolError, StepTimeoutError, TPRuntimeError
from tp_runtime.ipc import message_limits
from tp_runtime.messages import (
    CachedRequests,
    ExecuteModel,
    Logprobs,
    ModelRunnerOutput,
    NewRequest,
    RequestSampling,
    SchedulerOutput,
    WorkerReply,
)
from tp_runtime.serialize import (
    BROADCAST,
    HEARTBEATS,
    REPLIES,
    DropLog,
    FrameRejected,
    Signer,
    Verifier,
    channel_key,
    driver_message_codec,
    worker_reply_codec,
)

REPO = Path(__file__).resolve().parents[1]
TEST_TIMEOUT_S = 180
PROMPTS = random_prompts((5, 9, 13, 7), vocab=300)
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Small scheduler limits keep the reply size limit (zmq.MAXMSGSIZE) a few MB, so "oversized" is cheap.
ENGINE = dict(tensor_parallel_size=2, device="cpu", dtype="float32", executor="multiprocess",
              step_timeout_s=60.0, max_num_seqs=8, max_num_batched_tokens=256)  # fmt: skip
slow = pytest.mark.slow


# ----------------------------------------------------------------------------- fixtures and helpers
@pytest.fixture(autouse=True)
def hang_guard() -> Iterator[None]:
    """Fail a test that runs past TEST_TIMEOUT_S; faulthandler ends the run if Python cannot."""
    with fail_on_hang(TEST_TIMEOUT_S):
        yield


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint()


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> list[list[int]]:
    return hf_greedy(checkpoint, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def shared_llm(checkpoint: Path) -> Iterator[LLM]:
    """One engine for the attacks it must survive (each test checks it is still correct)."""
    llm = LLM(checkpoint, **ENGINE)  # type: ignore[arg-type]
    yield llm
    pids = llm.engine.executor.worker_pids()  # type: ignore[attr-defined]
    llm.shutdown()
    assert wait_gone(pids, 10.0) == []


@pytest.fixture
def fresh_llm(checkpoint: Path) -> Iterator[Callable[..., LLM]]:
    """Engines for faults they do not survive; whatever happens, shut down and checked for leftovers."""
    engines: list[LLM] = []
    before = spawned_children()

    def start(**kwargs: Any) -> LLM:
        llm = LLM(checkpoint, **{**ENGINE, **kwargs})  # type: ignore[arg-type]
        engines.append(llm)
        return llm

    yield start
    for llm in engines:
        for pid in llm.engine.executor.worker_pids():  # type: ignore[attr-defined]
            kill_quietly(pid, signal.SIGCONT)
        llm.shutdown()
    leftover = spawned_children() - before
    for pid in leftover:
        kill_quietly(pid)
    assert not leftover, f"worker processes {sorted(leftover)} outlived the test"


def generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def on_step(llm: LLM, step: int, action: Callable[[int], None]) -> list[int]:
    """Call action(step_id) in the driver's thread when the engine waits for its `step`-th output from now
    on; returns the list the step id is appended to once it has run."""
    executor: Any = llm.engine.executor
    real = type(executor).wait_output
    calls, fired = [0], []

    def wait_output(step_id: int) -> ModelRunnerOutput:
        calls[0] += 1
        if calls[0] == step:
            action(step_id)
            fired.append(step_id)
        return real(executor, step_id)

    executor.wait_output = wait_output
    return fired


def record_frames(llm: LLM) -> tuple[list[bytes], list[bytes]]:
    """Keep a copy of every authentic frame the driver reads and sends (to replay them later)."""
    channel: Any = llm.engine.executor.channel  # type: ignore[attr-defined]
    read, encode = channel.reader.read, channel.writer.encode
    replies: list[bytes] = []
    broadcasts: list[bytes] = []

    def recording_read(frame: bytes) -> Any:
        opened = read(frame)
        if opened is not None:
            replies.append(frame)
        return opened

    def recording_encode(message: Any) -> bytes:
        frame = encode(message)
        broadcasts.append(frame)
        return frame

    channel.reader.read = recording_read
    channel.writer.encode = recording_encode
    return replies, broadcasts


def wait_until(condition: Callable[[], bool], timeout_s: float, nudge: Callable[[], None]) -> bool:
    """condition(), calling nudge() (e.g. a generate, which makes the driver read) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        nudge()
    return True


def forged_output(step_id: int, tokens: list[int]) -> WorkerReply:
    ids = list(range(len(tokens)))
    return WorkerReply(0, step_id, "output", output=ModelRunnerOutput(step_id, ids, tokens))


def vm_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# ----------------------------------------------------------------------------- frames (no processes)
def test_frames_authenticate_sender_and_sequence() -> None:
    key = secrets.token_bytes(32)
    rank0, rank1 = Signer(key, REPLIES, 0), Signer(key, REPLIES, 1)
    verifier = Verifier(key, REPLIES, "test socket")
    first, second = rank0.seal(b"a"), rank0.seal(b"b")
    # Standard HMAC-SHA256 over header and body, under the channel's own key.
    assert first[:32] == hmac.digest(channel_key(key, REPLIES), first[32:], "sha256")
    assert verifier.open(first) == (0, memoryview(b"a"))
    assert verifier.open(rank1.seal(b"c"))[0] == 1  # sequence numbers are per sender
    assert bytes(verifier.open(second)[1]) == b"b"
    rejected = {
        "duplicate": second,
        "reordered": first,
        "tampered": second[:-1] + bytes([second[-1] ^ 1]),
        "wrong key": Signer(secrets.token_bytes(32), REPLIES, 0).seal(b"x"),
        "other channel": Signer(key, BROADCAST, 0).seal(b"x"),
        "heartbeat channel": Signer(key, HEARTBEATS, 0).seal(b""),
        "short": b"\x00" * 10,
        "empty": b"",
    }
    for name, frame in rejected.items():
        with pytest.raises(FrameRejected):
            verifier.open(frame)
        assert verifier.drops.last_reason, name
    assert verifier.drops.total == len(rejected)
    assert bytes(verifier.open(rank0.seal(b"d"))[1]) == b"d"  # a rejected frame changes nothing


def test_dropped_frames_are_logged_at_most_once_a_second(caplog: pytest.LogCaptureFixture) -> None:
    log = DropLog("test socket", interval_s=3600.0)
    with caplog.at_level(logging.WARNING, logger="tp_runtime.transport"):
        for _ in range(1000):
            log.note("bad MAC")
    assert len(caplog.records) == 1 and "dropped 1 frame(s) on test socket" in caplog.text
    assert log.total == 1000 and log.pending == 999


def test_message_limits_hold_the_largest_legitimate_messages(checkpoint: Path) -> None:
    """A step of max_num_seqs new requests, each with max_model_len tokens, every block and a vocabulary of
    stop ids, and a reply with full logprobs for every request, fit under the sockets' size limits."""
    model = build_model_config(checkpoint, dtype="float32", device="cpu", max_model_len=128)
    config = EngineConfig(model=model, cache=CacheConfig(block_size=16),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512))  # fmt: skip
    broadcast_max, reply_max = message_limits(config)
    big = 2**63 - 1  # the widest msgpack integer
    vocab, n = model.vocab_size, 4
    sampling = RequestSampling(1.0, 1.0, vocab, 0.0, big, big, list(range(vocab)), vocab)
    new = [NewRequest(big - i, [vocab - 1] * 128, big, sampling, [big] * 10) for i in range(n)]
    step = SchedulerOutput(big, new, CachedRequests([big] * n, [[big] * 10] * n), [big] * n, [128] * n, [big])
    assert len(driver_message_codec().encode(ExecuteModel(step))) < broadcast_max
    rows = Logprobs([list(range(vocab + 1))] * n, [[-1e-300] * (vocab + 1)] * n, [vocab] * n)
    output = ModelRunnerOutput(big, [big] * n, [vocab - 1] * n, rows, {"forward": 1.0})
    assert len(worker_reply_codec().encode(WorkerReply(0, big, "output", output=output))) < reply_max


# ----------------------------------------------------------------------------- attacks the engine survives
@slow
def test_forged_frames_on_the_reply_socket_are_dropped(
    shared_llm: LLM, reference: list[list[int]], checkpoint: Path
) -> None:
    llm = shared_llm
    channel: Any = llm.engine.executor.channel  # type: ignore[attr-defined]
    replies, _ = record_frames(llm)
    assert generate(llm) == reference
    ctx = zmq.Context()
    outsider = ctx.socket(zmq.PUSH)
    outsider.setsockopt(zmq.LINGER, 0)
    outsider.connect(channel.results_addr)
    drops_before = channel.reader.drops.total
    limit = channel.pull.getsockopt(zmq.MAXMSGSIZE)
    assert 0 < limit < 64 << 20
    assert channel.pull.getsockopt(zmq.RCVHWM) <= 16  # what a flooding peer can make the driver hold

    def attack(step_id: int) -> None:
        forged = worker_reply_codec().encode(forged_output(step_id, [7] * len(PROMPTS)))
        frames = {
            "empty": b"",
            "garbage": b"\x00garbage",
            "random": secrets.token_bytes(1000),
            "unauthenticated output": forged,
            "wrong key": Signer(secrets.token_bytes(32), REPLIES, 0).seal(forged),
            "broadcast channel's key": Signer(channel.key, BROADCAST, 0).seal(forged),
            "duplicate of rank 0's last reply": replies[-1],
            "out of order (rank 0's first reply)": replies[0],
        }
        for frame in frames.values():
            outsider.send(frame)
        outsider.send(b"\x00" * (limit + 1))  # oversized: ZeroMQ drops the connection instead
        for _ in range(50):  # the probe: 50 forged outputs
            outsider.send(forged)

    try:
        fired = on_step(llm, 3, attack)
        assert generate(llm) == reference
        assert fired
        # Every frame was read and dropped (the last ones may only be read by a later call).
        assert wait_until(lambda: channel.reader.drops.total - drops_before >= 58, 30, lambda: generate(llm))
        assert generate(llm) == reference
        kv = llm.engine.scheduler.kv
        assert kv.num_free_blocks == llm.engine.num_kv_blocks
    finally:
        outsider.close(0)
        ctx.term()


@slow
def test_frames_into_the_broadcast_socket_are_dropped(shared_llm: LLM, reference: list[list[int]]) -> None:
    """Outsiders sending to the XPUB socket (subscriptions, junk, 5 x 50 MB) change nothing and are not
    kept; and frames that reach the workers without the driver's MAC, or replayed, are dropped there."""
    llm = shared_llm
    channel: Any = llm.engine.executor.channel  # type: ignore[attr-defined]
    _, broadcasts = record_frames(llm)
    assert generate(llm) == reference
    assert channel.pub.getsockopt(zmq.MAXMSGSIZE) <= 64 and channel.pub.getsockopt(zmq.RCVHWM) <= 16
    flood = (
        "import sys, zmq\n"
        "ctx = zmq.Context(); s = ctx.socket(zmq.XSUB); s.setsockopt(zmq.LINGER, 2000)\n"
        "s.connect(sys.argv[1])\n"
        "for i in range(200): s.send(b'\\x01'); s.send(b'junk %d' % i); s.send(b'\\x00' + bytes(40))\n"
        "for i in range(5): s.send(b'x' + bytes(50 << 20))\n"
        "s.close(); ctx.term()\n"
    )
    rss_before = vm_rss_bytes()
    outsider: list[subprocess.Popen[bytes]] = []

    def attack(step_id: int) -> None:
        outsider.append(subprocess.Popen([sys.executable, "-c", flood, channel.broadcast_addr]))
        # Straight to the workers, through the driver's own socket: no MAC, a replay, an old frame.
        unsigned = driver_message_codec().encode(ExecuteModel(SchedulerOutput(step_id + 1, [], CachedRequests(
            [], []), [], [], list(range(100)))))  # fmt: skip
        for frame in (b"junk", unsigned, broadcasts[-1], broadcasts[0], b"\x00" * 100_000):
            channel.pub.send(frame)

    try:
        on_step(llm, 2, attack)
        assert generate(llm) == reference
        assert outsider[0].wait(timeout=60) == 0
        assert generate(llm) == reference
    finally:
        for p in outsider:
            if p.poll() is None:
                p.kill()
                p.wait()
    growth = vm_rss_bytes() - rss_before
    assert growth < 100 << 20, f"the driver grew by {growth >> 20} MB after 250 MB were sent to it"
    channel.discard_inbound()
    assert not channel.pub.poll(0)


@slow
def test_forged_heartbeats_are_dropped(shared_llm: LLM, reference: list[list[int]]) -> None:
    llm = shared_llm
    watchdog: Any = llm.engine.executor.channel.watchdog  # type: ignore[attr-defined]
    before = watchdog.verifier.drops.total
    ctx = zmq.Context()
    outsider = ctx.socket(zmq.PUSH)
    outsider.setsockopt(zmq.LINGER, 0)
    outsider.connect(watchdog.address)
    try:
        for frame in (b"", b"beat", Signer(secrets.token_bytes(32), HEARTBEATS, 1).seal(b""),
                      Signer(watchdog_key(llm), REPLIES, 1).seal(b"")):  # fmt: skip
            outsider.send(frame)
        assert wait_until(lambda: watchdog.verifier.drops.total - before >= 4, 10, lambda: time.sleep(0.05))
        outsider.send(b"\x00" * 1000)  # oversized for a heartbeat: the connection is dropped
        assert generate(llm) == reference
        assert not watchdog.silent and not watchdog.lost
    finally:
        outsider.close(0)
        ctx.term()


def watchdog_key(llm: LLM) -> bytes:
    return llm.engine.executor.channel.key  # type: ignore[attr-defined,no-any-return]


# ----------------------------------------------------------------------------- no listener beyond loopback
def _listeners(pids: list[int]) -> list[tuple[int, str]]:
    """(pid, address) of every TCP socket in LISTEN state that one of `pids` holds."""
    owner: dict[int, int] = {}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    owner[int(link[8:-1])] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], int(fields[9])
                if state == "0A" and inode in owner:
                    host_hex, port_hex = local.split(":")
                    raw = bytes.fromhex(host_hex)
                    # /proc/net prints each 32-bit word in host (little-endian) order.
                    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                    found.append((owner[inode], f"{ipaddress.ip_address(raw)}:{int(port_hex, 16)}"))
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


@slow
def test_spawned_engine_listens_on_loopback_only(shared_llm: LLM) -> None:
    pids = [os.getpid(), *shared_llm.engine.executor.worker_pids()]  # type: ignore[attr-defined]
    # The check itself finds a wildcard listener.
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        probe.listen()
        assert any(not _loopback(a) for _, a in _listeners(pids)), "the listener scan does not work"
    found = _listeners(pids)
    assert not [(p, a) for p, a in found if not _loopback(a)], f"listeners beyond loopback: {found}"


@slow
def test_ipc_sockets_are_private_and_removed(fresh_llm: Callable[..., LLM]) -> None:
    llm = fresh_llm()
    folder = Path(llm.engine.executor.ipc_dir)  # type: ignore[attr-defined]
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    sockets = [p for p in folder.iterdir() if stat.S_ISSOCK(p.stat().st_mode)]
    assert len(sockets) == 3  # broadcast, replies, heartbeats
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in sockets), [
        (p.name, oct(p.stat().st_mode)) for p in sockets
    ]
    llm.shutdown()
    assert not folder.exists()


def test_a_temporary_folder_too_deep_for_sockets_is_a_config_error(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unix socket paths hold at most 107 bytes: a deep TMPDIR is refused with advice, before any worker
    starts, and leaves no folder behind."""
    import tempfile

    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with pytest.raises(ConfigError, match="set TMPDIR to a shorter folder"):
        LLM(checkpoint, tensor_parallel_size=2, device="cpu", dtype="float32", executor="multiprocess")
    assert list(deep.iterdir()) == []


_FORK_SCRIPT = """
import os, sys
from tp_runtime import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32", executor="multiprocess")
folder = llm.engine.executor.ipc_dir
pid = os.fork()
if pid == 0:
    with llm:  # leaving a with block calls shutdown(), and a normal exit the inherited exit hooks
        sys.exit(0)
os.waitpid(pid, 0)
params = SamplingParams(max_tokens=3, ignore_eos=True)
out = llm.generate({"prompt_token_ids": [1, 5, 6]}, params, use_tqdm=False)[0].outputs[0].token_ids
print("FOLDER", os.path.isdir(folder), "TOKENS", len(out), flush=True)
"""


def test_a_forked_child_leaves_the_engine_alone(checkpoint: Path) -> None:
    """A process forked from the driver that exits normally, here from inside a `with LLM` block, does not
    shut down the driver's engine (its inherited exit hook removed the driver's socket folder)."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, str(checkpoint)], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "FOLDER True TOKENS 3" in proc.stdout, proc.stdout + proc.stderr[-3000:]


# ----------------------------------------------------------------------------- authentic nonsense
def _inconsistent(step_id: int, scheduled: list[int]) -> dict[str, tuple[WorkerReply, str]]:
    a, b = scheduled[0], scheduled[1]
    two_rows = Logprobs([[5], [6]], [[-1.0], [-2.0]], [1, 1])
    return {
        "lengths": (
            WorkerReply(0, step_id, "output", output=ModelRunnerOutput(step_id, [a, b], [5])),
            "has 2 request ids but 1 sampled token ids",
        ),
        "logprob rows": (
            WorkerReply(0, step_id, "output", output=ModelRunnerOutput(step_id, [a], [5], two_rows)),
            "has 1 request ids but 2 rows of logprobs.token_ids",
        ),
        "not in flight": (forged_output(10**6, [5]), "answered step 1000000, which is not in flight"),
        "duplicate": (forged_output(step_id - 1, [5]), f"answered step {step_id - 1} twice"),
    }


@slow
@pytest.mark.parametrize("case", ["lengths", "logprob rows", "not in flight", "duplicate"])
def test_authentic_inconsistent_reply_is_a_protocol_error(fresh_llm: Callable[..., LLM], case: str) -> None:
    """Signed with the engine's key (as only a broken rank 0 could), read before rank 0's real reply."""
    llm = fresh_llm(async_scheduling=False)
    executor: Any = llm.engine.executor
    pids = executor.worker_pids()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(executor.channel.results_addr)
    real_submit, calls, expected = type(executor).submit, [0], []

    def submit(so: SchedulerOutput) -> None:
        calls[0] += 1
        if calls[0] == 2:
            reply, message = _inconsistent(so.step_id, so.scheduled_req_ids)[case]
            expected.append(message)
            signer = Signer(executor.channel.key, REPLIES, 0)
            signer.seq = 10**9  # fresher than anything rank 0 sent
            push.send(signer.seal(worker_reply_codec().encode(reply)))
            # Nothing else can be queued now (no step in flight): wait until it is there, then send.
            assert executor.channel.pull.poll(10_000)
        real_submit(executor, so)

    executor.submit = submit
    try:
        t0 = time.monotonic()
        with pytest.raises(ProtocolError) as info:
            generate(llm)
        assert time.monotonic() - t0 < 10
    finally:
        push.close(0)
        ctx.term()
    assert expected and expected[0] in str(info.value), describe(info.value)
    assert wait_gone(pids, 10.0) == []
    with pytest.raises(EngineClosedError):
        executor.collective_rpc("decode_traffic")


# ----------------------------------------------------------------------------- a stopped rank is named
@slow
@pytest.mark.parametrize("step_timeout_s", [2.0, 60.0])
def test_a_stopped_rank_is_named(fresh_llm: Callable[..., LLM], step_timeout_s: float) -> None:
    """SIGSTOP of rank 1 stalls rank 0 in its collective: the error names rank 1, at the step timeout
    (2 s) or from its missing heartbeats well before it (60 s)."""
    llm = fresh_llm(step_timeout_s=step_timeout_s)
    pids = llm.engine.executor.worker_pids()  # type: ignore[attr-defined]
    generate(llm)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(TPRuntimeError) as info:
            generate(llm)
        elapsed = time.monotonic() - t0
    finally:
        kill_quietly(pids[1], signal.SIGCONT)
    message = str(info.value)
    assert isinstance(info.value, StepTimeoutError), describe(info.value)
    if step_timeout_s == 2.0:
        assert "within 2 s" in message and "rank 1 is stopped by a signal" in message, message
    else:
        assert "rank 1 sent no heartbeat for" in message and elapsed < 10, (elapsed, message)
    assert "rank 0 is" not in message and "rank 0 sent" not in message, message
    assert wait_gone(pids, 10.0) == []


# ----------------------------------------------------------------------------- torchrun
def _non_loopback_ipv4() -> str | None:
    """This host's address on a real interface (the source address of a route; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else str(address)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TP_RUNTIME_SECRET")}
    path = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)  # keep what was there
    return {**env, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def _two_nodes(args: list[str], master: str, env0: dict[str, str], env1: dict[str, str]) -> list[Any]:
    """Run `launch_tp.sh 1 ARGS` as node 0 and node 1 of a two-node job; returns both CompletedProcess."""
    node_args = f"--nnodes 2 --master-addr {master} --master-port {_free_port()} --node-rank"
    procs = []
    for n, env in ((1, env1), (0, env0)):
        procs.append(subprocess.Popen(
            ["bash", "scripts/launch_tp.sh", "1", *args], cwd=REPO, text=True, start_new_session=True,
            env={**env, "TORCHRUN_ARGS": f"{node_args} {n}"}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        ))  # fmt: skip
    try:
        results = []
        for p in procs[::-1]:
            out, _ = p.communicate(timeout=150)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@slow
def test_torchrun_across_hosts_needs_the_shared_secret(checkpoint: Path, tmp_path: Path) -> None:
    master = _non_loopback_ipv4()
    if master is None:
        pytest.skip("this host has no non-loopback IPv4 interface to act as MASTER_ADDR")
    out = tmp_path / "out.json"
    args = ["generate", "--model", str(checkpoint), "--max-tokens", "6", "--ignore-eos", "--device", "cpu",
            "--dtype", "float32", "--output-json", str(out), "hello world"]  # fmt: skip
    refused = _two_nodes(args, master, _env(), _env())
    assert [r.returncode != 0 for r in refused] == [True, True], refused[0].stdout[-3000:]
    # Every rank refuses before it binds anything; the CLI prints the error on rank 0 only.
    message = refused[0].stdout
    assert "TP_RUNTIME_SECRET" in message and f"MASTER_ADDR={master}" in message, message[-3000:]
    assert not out.exists()
    secret = secrets.token_hex(32)
    ran = _two_nodes(args, master, _env(TP_RUNTIME_SECRET=secret), _env(TP_RUNTIME_SECRET=secret))
    assert [r.returncode for r in ran] == [0, 0], ran[0].stdout[-3000:] + ran[1].stdout[-3000:]
    import json

    import transformers

    prompt = transformers.AutoTokenizer.from_pretrained(checkpoint)("hello world")["input_ids"]
    assert [r["token_ids"] for r in json.loads(out.read_text())] == hf_greedy(checkpoint, [prompt], 6)


_TORCHRUN_SCRIPT = """
import os, sys, time
from tp_runtime import LLM, SamplingParams, run_torchrun_worker
from tp_runtime.errors import TPRuntimeError
print(f"PID {os.environ['RANK']} {os.getpid()}", flush=True)
# TP_RUNTIME_TEST_DEVICE=cuda runs the same job on two GPUs (NCCL) where there are some.
device = os.environ.get("TP_RUNTIME_TEST_DEVICE", "cpu")
options = dict(
    tensor_parallel_size=2, device=device, dtype="float32", executor="torchrun", step_timeout_s=120.0
)
if os.environ["RANK"] != "0":
    run_torchrun_worker(sys.argv[1], **options)
    sys.exit(0)
llm = LLM(sys.argv[1], **options)
prompts = [{"prompt_token_ids": [1, 5 + i % 7, 6, 7]} for i in range(32)]
short, long = (SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 400))
llm.generate(prompts[:1], short, use_tqdm=False)
print("FIRST", flush=True)
try:
    while True:
        llm.generate(prompts, long, use_tqdm=False)
except TPRuntimeError as exc:
    print(f"ERROR {type(exc).__name__} rank={getattr(exc, 'rank', None)}: {exc}", flush=True)
    try:
        llm.generate(prompts[:1], use_tqdm=False)
    except Exception as again:
        print(f"AFTER {type(again).__name__}", flush=True)
    sys.exit(3)
"""


@slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_torchrun_rank_0_notices_a_dead_or_stopped_rank(checkpoint: Path, tmp_path: Path, sig: str) -> None:
    """Two single-process "nodes" (so torchrun's own agent on node 0 cannot see rank 1): rank 1 is killed
    or stopped after the first output; rank 0 names it within 10 s and every process of the job exits
    (a stopped rank once continued: it leaves by itself when its driver is gone)."""
    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_SCRIPT)
    port = _free_port()

    def node(n: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
             "--master-addr", "127.0.0.1", "--master-port", str(port), "--nproc-per-node", "1", str(script),
             str(checkpoint)],
            # On GPUs each "node" takes its own (both are local rank 0).
            cwd=REPO, env=_env(CUDA_VISIBLE_DEVICES=str(n)), text=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    nodes = [node(1), node(0)]
    lines: queue.Queue[tuple[int, str, float]] = queue.Queue()
    for n, p in ((1, nodes[0]), (0, nodes[1])):
        threading.Thread(
            target=lambda n=n, p=p: [lines.put((n, line, time.monotonic())) for line in p.stdout or []],
            daemon=True,
        ).start()
    pids: dict[int, int] = {}
    logs: list[str] = []
    killed_at = None
    error: tuple[str, float] | None = None
    try:
        deadline = time.monotonic() + 150
        while error is None and time.monotonic() < deadline:
            try:
                n, line, at = lines.get(timeout=1)
            except queue.Empty:
                continue
            logs.append(f"[node {n}] {line}")
            if line.startswith("PID "):
                _, rank, pid = line.split()
                pids[int(rank)] = int(pid)
            elif line.startswith("FIRST"):
                killed_at = time.monotonic()
                os.kill(pids[1], getattr(signal, sig))
            elif n == 0 and killed_at is not None and ("ERROR " in line or "tp-runtime: error:" in line):
                error = (line, at)
        assert error is not None, "rank 0 reported nothing:\n" + "".join(logs[-60:])
        assert killed_at is not None
        line, at = error
        assert at - killed_at < 10, f"rank 0 named the rank {at - killed_at:.1f} s after the {sig}"
        raised = line.startswith("ERROR ")
        if sig == "SIGKILL":
            # gloo: rank 0's collective fails and the error is raised. NCCL: rank 0 is blocked in the
            # collective, so the watchdog ends the job itself, naming the rank.
            assert "worker rank 1 died" in line, line
            nccl = os.environ.get("TP_RUNTIME_TEST_DEVICE", "cpu") == "cuda"
            assert raised or nccl, f"gloo's collective fails, so the error must be raised: {line}"
            assert not raised or line.startswith("ERROR WorkerDiedError rank=1"), line
        else:  # rank 0 is blocked in a collective with it: the watchdog ends the job, naming rank 1
            assert "rank 1 sent no heartbeat" in line, line
            kill_quietly(pids[1], signal.SIGCONT)
        assert nodes[1].wait(timeout=60) != 0
        assert nodes[0].wait(timeout=60) != 0
        if raised:
            time.sleep(0.5)  # let the last lines in
            text = "".join(logs) + "".join(f"[node {n}] {x}" for n, x, _ in list(lines.queue))
            assert "AFTER EngineClosedError" in text, text[-3000:]
        assert wait_gone(list(pids.values()), 10.0) == []
    finally:
        for pid in pids.values():
            kill_quietly(pid, signal.SIGCONT)
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for pid in pids.values():
            if alive(pid):
                kill_quietly(pid)


def test_a_peer_leaving_the_heartbeat_socket_does_not_make_a_rank_dead() -> None:
    """The watchdog ties a closed connection to a rank by the descriptor its heartbeats arrive on: a peer
    that is not a rank (across hosts the socket is TCP) connects, sends garbage and leaves, and no rank is
    marked closed; a rank whose own connection closes is."""
    from tp_runtime.ipc import Watchdog
    from tp_runtime.serialize import HEARTBEATS, Signer, secure_client

    key = secrets.token_bytes(32)
    ctx = zmq.Context()
    watchdog = Watchdog(ctx, "tcp://127.0.0.1:0", key)
    watchdog.watch([1, 2])
    ranks = {}
    try:
        for rank in (1, 2):
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            secure_client(push, watchdog.address, key)
            push.connect(watchdog.address)
            push.send(Signer(key, HEARTBEATS, rank).seal(b""))
            ranks[rank] = push
        deadline = time.monotonic() + 10
        while len(watchdog._connection_of) < 2:  # both ranks' heartbeats read
            assert time.monotonic() < deadline, "the watchdog read no heartbeat"
            time.sleep(0.01)
        outsider = ctx.socket(zmq.PUSH)
        outsider.setsockopt(zmq.LINGER, 0)
        outsider.connect(watchdog.address)
        outsider.send(b"\x00" * 40)
        outsider.close()
        ranks[2].close()  # after the outsider: once rank 2's close is seen, the outsider's was too
        while 2 not in watchdog.closed_at:
            assert time.monotonic() < deadline, "rank 2's closed connection was not seen"
            time.sleep(0.01)
        assert list(watchdog.closed_at) == [2]
    finally:
        watchdog.stop()
        ctx.destroy(linger=0)


_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def _await_event(monitor: zmq.Socket[bytes], events: int, what: str) -> None:
    from zmq.utils.monitor import parse_monitor_message

    deadline = time.monotonic() + 20
    while True:
        assert monitor.poll(max(1, int(1000 * (deadline - time.monotonic())))), f"no {what}"
        if parse_monitor_message(monitor.recv_multipart())["event"] & events:
            return


@pytest.mark.parametrize("outsider_key", [None, "another job's"], ids=["plain", "wrong-key"])
def test_tcp_sockets_take_only_peers_holding_the_job_key(outsider_key: str | None) -> None:
    """On TCP (torchrun across hosts) the driver's sockets run CurveZMQ keyed by the job key: a peer without
    it fails the handshake, so its frames never reach the reply socket (nothing to verify or queue) and it
    receives no broadcast (prompts' token ids), while a rank's socket works as on ipc."""
    from tp_runtime.ipc import DriverChannel
    from tp_runtime.serialize import FRAME_OVERHEAD, secure_client

    key = secrets.token_bytes(32)
    channel = DriverChannel("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", key, 1 << 20)
    ctx = zmq.Context()
    try:

        def outsider(kind: int, address: str) -> zmq.Socket[bytes]:
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            if outsider_key is not None:
                secure_client(sock, address, secrets.token_bytes(32))
            return sock

        # The reply socket.
        monitor = channel.pull.get_monitor_socket(_HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        stranger = outsider(zmq.PUSH, channel.results_addr)
        stranger.connect(channel.results_addr)
        stranger.send(b"\x00garbage", zmq.NOBLOCK)
        _await_event(monitor, _HANDSHAKE_FAILED, "failed handshake of the outsider")
        rank = ctx.socket(zmq.PUSH)
        rank.setsockopt(zmq.LINGER, 0)
        rank.setsockopt(zmq.MAXMSGSIZE, 64)  # as a worker's: it receives nothing but the handshake
        secure_client(rank, channel.results_addr, key)
        rank.connect(channel.results_addr)
        rank.send(b"a rank's frame")
        assert channel.pull.poll(20_000) and channel.pull.recv() == b"a rank's frame"
        largest = b"x" * ((1 << 20) + FRAME_OVERHEAD)  # the largest reply the limit is sized for: CURVE's
        rank.send(largest)  # own bytes on the wire do not count against it
        assert channel.pull.poll(20_000) and channel.pull.recv() == largest
        assert not channel.pull.poll(0) and channel.reader.drops.total == 0
        channel.pull.disable_monitor()
        monitor.close()
        # The broadcast socket.
        monitor = channel.pub.get_monitor_socket(_HANDSHAKE_FAILED)
        spy = outsider(zmq.SUB, channel.broadcast_addr)
        spy.setsockopt(zmq.SUBSCRIBE, b"")
        spy.connect(channel.broadcast_addr)
        _await_event(monitor, _HANDSHAKE_FAILED, "failed handshake of the subscriber")
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        secure_client(sub, channel.broadcast_addr, key)
        sub.connect(channel.broadcast_addr)
        assert channel.pub.poll(20_000) and channel.pub.recv() == b"\x01"  # the rank's subscription
        channel.pub.send(b"prompt token ids")
        assert sub.poll(20_000) and sub.recv() == b"prompt token ids"
        assert not spy.poll(0)
        channel.pub.disable_monitor()
        monitor.close()
    finally:
        channel.close()
        ctx.destroy(linger=0)
