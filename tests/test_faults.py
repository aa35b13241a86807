"""Process-level robustness of the multiprocess executor (TP=2 over gloo, tiny model).

Each test starts its own engine (a few seconds), injects one fault and checks that the driver raises the
documented error promptly and that no worker process outlives the engine. A per-test guard turns a hang
into a failure: SIGALRM fails the test from Python, and faulthandler ends the whole run (with every
thread's traceback) if the main thread is stuck where Python signal handlers cannot run.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import fail_on_hang, hf_greedy

from tp_runtime import LLM, SamplingParams
from tp_runtime.errors import (
    StepTimeoutError,
    TPRuntimeError,
    WorkerDiedError,
    WorkerError,
)
from tp_runtime.messages import Shutdown
from tp_runtime.worker.worker import FAULT_INJECTION_ENV

pytestmark = pytest.mark.slow

TEST_TIMEOUT_S = 120  # generous: engines start in ~4 s on an idle 2-core machine, far slower when loaded
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = {"prompt_token_ids": [1, 5, 6, 7]}
# Long enough to still be running a second after it starts (several seconds of decode steps).
LONG_PROMPTS = [{"prompt_token_ids": [1, 5 + i % 7, 6, 7]} for i in range(64)]
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


# ----------------------------------------------------------------------------- process helpers
def alive(pid: int) -> bool:
    """True while any thread of pid runs. A SIGKILLed multi-threaded process shows its main thread as a
    zombie while other threads still run and its file descriptors (sockets, pipes) are still open, so the
    state of every thread is checked, not only the main thread's (which is all psutil.status() reports)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if state not in ("Z", "X"):
            return True
    return False


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still alive after waiting up to timeout_s for all of them to go."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def is_spawned_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"tp_runtime.worker.process" in f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False


def spawned_children() -> set[int]:
    """Live multiprocessing-spawned children of this process (engine workers)."""
    me = os.getpid()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == me and alive(int(entry)) and is_spawned_worker(int(entry)):
                found.add(int(entry))
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    return found


def kill_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True)
def hang_guard() -> Iterator[None]:
    """Fail a test that runs past TEST_TIMEOUT_S, and make sure it leaves no worker process behind."""
    before = spawned_children()
    try:
        with fail_on_hang(TEST_TIMEOUT_S):
            yield
    finally:
        leftover = spawned_children() - before
        for pid in leftover:  # our own engine's workers: don't let them leak into later tests
            kill_quietly(pid)
        assert not leftover, f"worker processes {sorted(leftover)} outlived the test"


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint()


@pytest.fixture
def start_llm(checkpoint: Path) -> Iterator[Callable[..., LLM]]:
    """Start TP=2 multiprocess engines; whatever happens, they are shut down after the test."""
    engines: list[LLM] = []

    def start(**kwargs: Any) -> LLM:
        # TP_RUNTIME_TEST_DEVICE=cuda runs the same faults on two GPUs (NCCL) where there are some.
        device = os.environ.get("TP_RUNTIME_TEST_DEVICE", "cpu")
        kwargs = {"tensor_parallel_size": 2, "device": device, "dtype": "float32", "executor": "multiprocess",
                  "step_timeout_s": 60.0, **kwargs}  # fmt: skip
        llm = LLM(checkpoint, **kwargs)
        engines.append(llm)
        pids = llm.engine.executor.worker_pids()  # type: ignore[attr-defined]
        assert len(pids) == kwargs["tensor_parallel_size"] and all(alive(p) for p in pids)
        return llm

    yield start
    for llm in engines:
        for pid in llm.engine.executor.worker_pids():  # type: ignore[attr-defined]
            if alive(pid):  # a test may have stopped it
                kill_quietly(pid, signal.SIGCONT)
        llm.shutdown()


def pids_of(llm: LLM) -> list[int]:
    return list(llm.engine.executor.worker_pids())  # type: ignore[attr-defined]


def generate_ok(llm: LLM) -> list[int]:
    out = llm.generate(PROMPT, SHORT, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 4
    return out


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text[:300]}{' ... ' + text[-400:] if len(text) > 700 else text[300:]}"


def assert_engine_closed(llm: LLM) -> None:
    """After a fatal fault the engine is shut down: the next call fails at once with a clear error."""
    t0 = time.monotonic()
    with pytest.raises((TPRuntimeError, RuntimeError)) as info:
        llm.generate(PROMPT, SHORT, use_tqdm=False)
    assert time.monotonic() - t0 < 5
    assert "shut down" in str(info.value), describe(info.value)


# ----------------------------------------------------------------------------- (a) a worker is killed
@pytest.mark.parametrize("victim", [0, 1])
def test_sigkill_worker_mid_generation(start_llm: Callable[..., LLM], victim: int) -> None:
    llm = start_llm()
    pids = pids_of(llm)
    generate_ok(llm)
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(pids[victim], signal.SIGKILL)

    timer = threading.Timer(1.0, kill)
    timer.start()
    try:
        with pytest.raises(TPRuntimeError) as info:
            llm.generate(LONG_PROMPTS, LONG, use_tqdm=False)
        raised_at = time.monotonic()
    finally:
        timer.cancel()
    assert killed_at, "generate failed before the worker was killed"
    latency = raised_at - killed_at[0]
    left = wait_gone(pids, 5.0)

    problems = []
    if not isinstance(info.value, WorkerDiedError):
        problems.append(f"expected WorkerDiedError naming rank {victim}, got {describe(info.value)}")
    elif info.value.rank != victim or f"worker rank {victim} died" not in str(info.value):
        problems.append(f"wrong rank: {describe(info.value)}")
    elif "signal 9" not in str(info.value):
        problems.append(f"the message should say how the worker died: {info.value}")
    if latency > 10:
        problems.append(f"the error came {latency:.1f} s after the kill")
    if left:
        problems.append(f"worker processes {left} still alive 5 s after the error")
    assert not problems, "\n".join(problems)
    assert_engine_closed(llm)


def test_sigkill_worker_between_generates(start_llm: Callable[..., LLM]) -> None:
    llm = start_llm()
    pids = pids_of(llm)
    generate_ok(llm)
    os.kill(pids[1], signal.SIGKILL)
    assert not wait_gone([pids[1]], 5.0)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        llm.generate(PROMPT, SHORT, use_tqdm=False)
    assert time.monotonic() - t0 < 10
    assert info.value.rank == 1
    assert "worker rank 1 died: killed by signal 9" in str(info.value)
    assert wait_gone(pids, 5.0) == []
    assert_engine_closed(llm)
    llm.shutdown()
    llm.shutdown()


# ----------------------------------------------------------------------------- (b) a worker raises
def test_worker_exception_reaches_driver_with_remote_traceback(
    start_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_INJECTION_ENV, "1")  # before the workers start: they inherit it
    llm = start_llm()
    pids = pids_of(llm)
    generate_ok(llm)
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        llm.engine.executor.collective_rpc("debug_raise", ["boom"])
    assert time.monotonic() - t0 < 10
    exc = info.value
    assert exc.rank in (0, 1)
    message = str(exc)
    assert message.startswith(f"worker rank {exc.rank} raised an exception:"), message
    assert "Traceback (most recent call last)" in exc.remote_traceback
    assert "debug_raise" in exc.remote_traceback
    assert "RuntimeError: boom" in exc.remote_traceback
    assert "boom" in message
    # A failed call shuts every worker down (documented in MultiprocExecutor._guarded).
    assert wait_gone(pids, 5.0) == []
    assert_engine_closed(llm)


def test_an_error_with_a_huge_message_still_reaches_the_driver(
    start_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception whose text passes the driver's reply frame limit (ipc.message_limits): the frame was
    dropped by the driver's socket, which then waited for the step until step_timeout_s. The error's
    start and end arrive, the middle left out."""
    from tp_runtime.ipc import message_limits
    from tp_runtime.worker.worker import MAX_ERROR_CHARS

    monkeypatch.setenv(FAULT_INJECTION_ENV, "1")
    llm = start_llm(max_num_seqs=2, max_num_batched_tokens=64)
    huge = message_limits(llm.engine.config)[1] + (1 << 20)
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        llm.engine.executor.collective_rpc("debug_raise", ["0123456789", huge // 10])
    assert time.monotonic() - t0 < 10
    assert "RuntimeError: 01234567890123" in info.value.remote_traceback
    assert info.value.remote_traceback.rstrip().endswith("0123456789")
    assert "characters left out" in info.value.remote_traceback
    assert len(info.value.remote_traceback) < 2 * MAX_ERROR_CHARS


def test_an_error_reply_from_a_rank_that_then_exits_keeps_its_traceback() -> None:
    """A rank that reports an error and exits of it (a failed start-up, say) is named by its error and
    traceback, however soon its exit shows; a different rank's death still comes first (it broke the
    collectives the reporting rank failed in)."""
    from types import SimpleNamespace

    from tp_runtime.executor.remote import RemoteWorkers
    from tp_runtime.messages import WorkerReply

    class ExitedRank(RemoteWorkers):
        def __init__(self, dead: int) -> None:
            super().__init__(SimpleNamespace(watchdog=SimpleNamespace(late=dict)), [1, 2], 0.0)  # type: ignore[arg-type]
            self.dead = dead

        def _check_processes(self, settle_s: float) -> None:
            raise WorkerDiedError(self.dead, "exit code 1")

    reply = WorkerReply(rank=1, call_id=3, kind="error", error="Traceback (...)\nValueError: truncated file")
    with pytest.raises(WorkerError, match="worker rank 1 raised an exception:\nTraceback") as info:
        ExitedRank(dead=1)._handle(1, reply, None)
    assert "truncated file" in info.value.remote_traceback
    with pytest.raises(WorkerDiedError, match="worker rank 2 died: exit code 1"):
        ExitedRank(dead=2)._handle(1, reply, None)


def test_fault_injection_is_refused_without_the_variable(
    checkpoint: Path, start_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without TP_RUNTIME_FAULT_INJECTION=1 a worker refuses the debug_raise hook, with a message naming the
    variable. In process the refusal is the caller's ValueError and the engine keeps serving; across
    processes it is a worker error, after which the driver closes the engine, as after any failed call."""
    monkeypatch.delenv(FAULT_INJECTION_ENV, raising=False)
    refused = f"is refused: the worker's environment does not set {FAULT_INJECTION_ENV}=1"
    with LLM(checkpoint, device="cpu", dtype="float32") as llm:  # TP=1: the in-process worker
        with pytest.raises(ValueError, match=refused):
            llm.engine.executor.collective_rpc("debug_raise", ["boom"])
        generate_ok(llm)
    llm = start_llm()
    with pytest.raises(WorkerError) as info:
        llm.engine.executor.collective_rpc("debug_raise", ["boom"])
    assert refused in str(info.value), describe(info.value)
    assert "RuntimeError: boom" not in info.value.remote_traceback
    assert_engine_closed(llm)


_TORCHRUN_RANK1_FAILS = """
import sys
from tp_runtime import LLM, SamplingParams, run_torchrun_worker
from tp_runtime.config import torchrun_rank
from tp_runtime.worker.worker import Worker

options = dict(tensor_parallel_size=2, device="cpu", dtype="float32", step_timeout_s=120.0)
if torchrun_rank():
    steps = 0
    execute = Worker.execute_model

    def failing(self, so):
        global steps
        steps += 1
        if steps == 3:
            raise RuntimeError("injected failure in rank 1's third step")
        return execute(self, so)

    Worker.execute_model = failing
    run_torchrun_worker(sys.argv[1], **options)
else:
    llm = LLM(sys.argv[1], **options)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    llm.generate({"prompt_token_ids": [1, 5, 6]}, params, use_tqdm=False)
    print("NOT REACHED: generate returned", flush=True)
"""


def test_torchrun_rank_failing_mid_step_ends_the_job(checkpoint: Path, tmp_path: Path) -> None:
    """Under torchrun rank 0 runs its own worker in-process, so when rank 1 fails inside a step, rank 0 is
    blocked in a collective with it and cannot read rank 1's report. Rank 1 prints its error and exits, and
    the job ends at once (torchrun stops the other ranks; across hosts rank 0's watchdog sees rank 1 gone),
    instead of after the step timeout (120 s). Rank 0, killed by torchrun, leaves no socket folder: it was
    removed once every rank had connected."""
    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_RANK1_FAILS)
    sockets = tmp_path / "tmp"
    sockets.mkdir()
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "TMPDIR": str(sockets)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), str(checkpoint)]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "NOT REACHED" not in output, output[-3000:]
    assert time.monotonic() - t0 < 60, output[-3000:]
    assert "rank 1 failed" in output and "injected failure in rank 1's third step" in output, output[-3000:]
    assert not [p.name for p in sockets.iterdir() if p.name.startswith("tp-runtime-")], output[-2000:]


_TORCHRUN_SEEDS_DIFFER = """
import os, sys, time
from tp_runtime import LLM, SamplingParams, run_torchrun_worker
from tp_runtime.config import torchrun_rank
from tp_runtime.errors import ConfigError

options = dict(tensor_parallel_size=2, device="cpu", dtype="float32")
if torchrun_rank():  # rank 1's heartbeats connect a second after it is ready (a starved thread)
    import tp_runtime.worker.worker as worker_module

    send_heartbeats = worker_module._send_heartbeats

    def late_heartbeats(*args, **kwargs):
        time.sleep(1.0)
        return send_heartbeats(*args, **kwargs)

    worker_module._send_heartbeats = late_heartbeats
try:
    if torchrun_rank():
        run_torchrun_worker(sys.argv[1], seed=torchrun_rank(), **options)
    else:
        LLM(sys.argv[1], seed=0, **options)
except ConfigError as exc:
    print(f"rank {torchrun_rank()} failed to start: {exc}", flush=True)
    if not torchrun_rank():  # its driver's socket folder
        left = [p for p in os.listdir(sys.argv[2]) if p.startswith("tp-runtime-")]
        print(f"left behind: {left}", flush=True)
# The same program then starts engines that work, one after another.
for start in ("SECOND", "THIRD"):
    if torchrun_rank():
        run_torchrun_worker(sys.argv[1], **options)
    else:
        with LLM(sys.argv[1], **options) as llm:
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            out = llm.generate({"prompt_token_ids": [1, 5, 6, 7]}, params, use_tqdm=False)
            print(start, "START", out[0].outputs[0].token_ids, flush=True)
            # Once rank 1's late heartbeats have connected (they cannot once the socket files are gone),
            # the next step removes the socket files.
            watchdog = llm.engine.executor.channel.watchdog
            deadline = time.monotonic() + 60
            while not watchdog.connected_all() and time.monotonic() < deadline:
                time.sleep(0.05)
            heard = watchdog.connected_all()
            again = llm.generate({"prompt_token_ids": [1, 5, 6, 7]}, params, use_tqdm=False)
            left = [p for p in os.listdir(sys.argv[2]) if p.startswith("tp-runtime-")]
            print(start, "RUNNING", again[0].outputs[0].token_ids, left, heard, flush=True)
"""


def test_torchrun_failed_start_cleans_up_and_a_new_engine_starts(checkpoint: Path, tmp_path: Path) -> None:
    """Rank 0 makes the driver's sockets (in a private folder) before the ranks compare their engine
    arguments; when that start fails (a seed differs here), the folder and its sockets go with it, and
    every rank leaves the process group, so the program can start another engine, which gives HF's
    tokens (the retry failed: 'trying to initialize the default process group twice')."""
    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_SEEDS_DIFFER)
    sockets = tmp_path / "tmp"
    sockets.mkdir()
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "TMPDIR": str(sockets)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), str(checkpoint), str(sockets)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} failed to start: " in output and "on some rank: seed" in output, output[-3000:]
    assert "left behind: []" in output, output[-3000:]
    want = hf_greedy(checkpoint, [[1, 5, 6, 7]], 6)[0]
    assert f"SECOND START {want}" in output and f"THIRD START {want}" in output, output[-3000:]
    # Removed once rank 1's late heartbeats had connected (not before: they would never reach rank 0).
    for start in ("SECOND", "THIRD"):
        assert f"{start} RUNNING {want} [] True" in output, output[-3000:]
    assert not [p.name for p in sockets.iterdir() if p.name.startswith("tp-runtime-")], output[-2000:]


_TORCHRUN_RANK_NEVER_JOINS = """
import os, sys, time
from tp_runtime import LLM
if os.environ["RANK"] == "0":
    start = time.monotonic()
    try:
        LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32", startup_timeout_s=5)
    except Exception as exc:
        print("RANK 0", type(exc).__name__, round(time.monotonic() - start), exc, flush=True)
"""


def test_torchrun_rank_that_never_joins_is_named_in_the_startup_timeout(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A torchrun program whose rank 1 never calls run_torchrun_worker: rank 0 waited the collectives'
    timeout (step_timeout_s + 60, 6 minutes by default) and failed with torch's DistStoreError; it now
    says what is wrong once startup_timeout_s has passed."""
    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_RANK_NEVER_JOINS)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), str(checkpoint)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
    output = proc.stdout + proc.stderr
    found = re.search(r"RANK 0 TPRuntimeError (\d+) rank 0: ranks \[1\] of 2 did not join", output)
    assert found and int(found.group(1)) < 60, output[-3000:]
    assert "run_torchrun_worker(model, **the same options)" in output, output[-3000:]


# ----------------------------------------------------------------------------- (c) the driver is killed
_DRIVER_SCRIPT = """
import os, sys, time
from tp_runtime import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32", executor="multiprocess")
llm.generate({"prompt_token_ids": [1, 5, 6]}, use_tqdm=False)
child = os.fork() if sys.argv[2] == "fork" else -1  # a child of the driver's that outlives it
if child == 0:
    time.sleep(120)
    os._exit(0)
print("PIDS", *llm.engine.executor.worker_pids(), "CHILD", child, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("case", ["alone", "with-a-forked-child", "with-a-stopped-worker"])
def test_killing_the_driver_leaves_no_worker(checkpoint: Path, tmp_path: Path, case: str) -> None:
    """The workers leave when the driver dies, also while a process it forked lives on (the child closes
    the inherited ends of the workers' pipes) and when one is stopped by a signal (it cannot read its
    pipe until the kernel's parent-death signal, SIGCONT, resumes it)."""
    forked = case == "with-a-forked-child"
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    log = (tmp_path / "driver.log").open("w")
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER_SCRIPT, str(checkpoint), "fork" if forked else "alone"],
        stdout=subprocess.PIPE, stderr=log, text=True, env=env,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in driver.stdout or []], daemon=True).start()
    worker_pids: list[int] = []
    child = -1
    try:
        try:
            line = lines.get(timeout=TEST_TIMEOUT_S - 30)
        except queue.Empty:
            pytest.fail(
                f"the driver never reported its workers; stderr:\n{(tmp_path / 'driver.log').read_text()}"
            )
        assert line.startswith("PIDS "), line
        fields = line.split()
        worker_pids, child = [int(p) for p in fields[1:-2]], int(fields[-1])
        assert len(worker_pids) == 2 and all(alive(p) for p in worker_pids)
        assert (child > 0) == forked and (not forked or alive(child))
        if case == "with-a-stopped-worker":
            os.kill(worker_pids[1], signal.SIGSTOP)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=10)
        t0 = time.monotonic()
        left = wait_gone(worker_pids, 10.0)
        assert not left, f"workers {left} outlived their driver by {time.monotonic() - t0:.1f} s"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for pid in worker_pids:  # started (indirectly) by this test
            if alive(pid) and is_spawned_worker(pid):
                kill_quietly(pid)
        if child > 0:
            kill_quietly(child)
        log.close()


_STOP_IN_LOAD = """
import os, signal
if os.environ.get("TP_RUNTIME_TEST_STOP_RANK_IN_LOAD"):
    from tp_runtime.worker import worker

    load_model = worker.Worker.load_model

    def stopping_load_model(self):
        if self.rank == int(os.environ["TP_RUNTIME_TEST_STOP_RANK_IN_LOAD"]):
            os.kill(os.getpid(), signal.SIGSTOP)
        return load_model(self)

    worker.Worker.load_model = stopping_load_model
"""


def test_a_rank_stopped_while_loading_is_named(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank stopped by a signal before it has answered the start-up greeting (here in its model load) is
    named as stopped after HEARTBEAT_TIMEOUT_S, not after startup_timeout_s (600 s)."""
    (tmp_path / "sitecustomize.py").write_text(_STOP_IN_LOAD)  # imported by the spawned workers only
    paths = [str(tmp_path), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    monkeypatch.setenv("TP_RUNTIME_TEST_STOP_RANK_IN_LOAD", "1")
    stopped = r"rank 1 sent no heartbeat for [\d.]+ s: it is stopped by a signal"
    with pytest.raises(StepTimeoutError, match=stopped):
        LLM(checkpoint, tensor_parallel_size=2, device="cpu", dtype="float32", executor="multiprocess",
            startup_timeout_s=600.0)  # fmt: skip


# ----------------------------------------------------------------------------- (d) garbage on the sockets
def test_garbage_on_result_socket_is_dropped(start_llm: Callable[..., LLM]) -> None:
    """Frames without the engine's MAC are dropped (and logged); the engine carries on. The many kinds of
    forged frames are in test_transport_security.py."""
    llm = start_llm()
    want = generate_ok(llm)
    channel = llm.engine.executor.channel  # type: ignore[attr-defined]
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(channel.results_addr)
    try:
        push.send(b"\x00garbage")
        # The driver reads it while it waits for the next step's output.
        deadline = time.monotonic() + 30
        while channel.reader.drops.total == 0 and time.monotonic() < deadline:
            assert generate_ok(llm) == want
    finally:
        push.close(0)
        ctx.term()
    assert channel.reader.drops.total == 1
    assert "shorter than a frame header" in channel.reader.drops.last_reason
    assert generate_ok(llm) == want


class _RunsShellOnUnpickle:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_garbage_on_broadcast_socket_is_dropped_by_the_workers(
    start_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    llm = start_llm(step_timeout_s=5.0)
    pids = pids_of(llm)
    want = generate_ok(llm)
    marker = tmp_path / "pwned"
    channel = llm.engine.executor.channel  # type: ignore[attr-defined]
    channel.pub.send(b"junk")
    channel.pub.send(pickle.dumps(_RunsShellOnUnpickle(marker)))
    assert generate_ok(llm) == want
    assert all(alive(p) for p in pids)
    assert not marker.exists(), "a worker unpickled bytes from the socket"


# ----------------------------------------------------------------------------- (e) step timeout
def test_step_timeout_when_a_worker_is_stopped(start_llm: Callable[..., LLM]) -> None:
    llm = start_llm(step_timeout_s=1.0)
    pids = pids_of(llm)
    generate_ok(llm)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(TPRuntimeError) as info:
            llm.generate(PROMPT, SHORT, use_tqdm=False)
        elapsed = time.monotonic() - t0
    finally:
        for pid in pids:
            kill_quietly(pid, signal.SIGCONT)
    assert isinstance(info.value, StepTimeoutError), describe(info.value)
    assert "within 1 s" in str(info.value) and "step_timeout_s" in str(info.value)
    # 1 s timeout, then the engine shuts the workers down (a stopped one needs SIGKILL) before raising.
    assert elapsed < 15, f"StepTimeoutError took {elapsed:.1f} s with step_timeout_s=1"
    assert wait_gone(pids, 5.0) == []
    assert_engine_closed(llm)


# ----------------------------------------------------------------------------- (f) orderly shutdown
def test_context_manager_leaves_no_worker(start_llm: Callable[..., LLM]) -> None:
    with start_llm() as llm:
        held = sys.getrefcount(llm._exit_hook)  # the engine's exit hook: atexit holds it while it runs
        pids = pids_of(llm)
        ipc_dir = Path(llm.engine.executor.ipc_dir)  # type: ignore[attr-defined]
        assert ipc_dir.is_dir()
        generate_ok(llm)
    assert wait_gone(pids, 5.0) == []
    assert not ipc_dir.exists()
    after = sys.getrefcount(llm._exit_hook)
    assert after == held - 1  # and lets go of it then (not one kept per engine made)
    llm.shutdown()
    llm.shutdown()
    with pytest.raises(RuntimeError, match="has been shut down; create a new one"):
        llm.generate(PROMPT, SHORT, use_tqdm=False)


def test_ctrl_c_during_shutdown_kills_the_workers_and_still_cleans_up(start_llm: Callable[..., LLM]) -> None:
    """A Ctrl-C while the engine shuts down (an impatient second one) does not leave it half done: the
    workers are killed at once instead of waiting out the grace period (rank 1 is stopped, so it would
    never leave on its own), every one is reaped, the sockets, their folder and the watchdog are gone, and
    the interrupt is raised after that. Fired when the Shutdown message goes out."""
    llm = start_llm()
    generate_ok(llm)
    executor = llm.engine.executor
    workers = executor.workers  # type: ignore[attr-defined]
    ipc_dir = Path(executor.ipc_dir)  # type: ignore[attr-defined]
    watchdog = executor.channel.watchdog._thread  # type: ignore[attr-defined]
    os.kill(workers.procs[1].pid, signal.SIGSTOP)
    real_broadcast = workers.broadcast
    pressed: list[bool] = []

    def broadcast(message: Any) -> None:
        real_broadcast(message)
        if isinstance(message, Shutdown) and not pressed:
            pressed.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    workers.broadcast = broadcast
    with pytest.raises(KeyboardInterrupt):
        executor.shutdown(grace_s=float(TEST_TIMEOUT_S))
    assert all(p.returncode is not None for p in workers.procs), "a worker was not reaped"
    assert not ipc_dir.exists() and not watchdog.is_alive()
    llm.shutdown()  # a no-op now
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPT, SHORT, use_tqdm=False)


def test_context_manager_exiting_by_exception_tp1_multiprocess(start_llm: Callable[..., LLM]) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with start_llm(tensor_parallel_size=1) as llm:
            pids = pids_of(llm)
            generate_ok(llm)
            raise Boom
    assert wait_gone(pids, 5.0) == []
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPT, SHORT, use_tqdm=False)


def test_an_error_after_the_workers_start_shuts_them_down(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error (or a Ctrl-C) in the engine's set-up after its workers started (its scheduler, text codecs,
    grammar compiler) left the workers, their sockets' folder and the watchdog running with no engine to
    shut them down."""
    from tp_runtime.engine import llm_engine

    started = spawned_children()

    def interrupted_scheduler(*args: Any) -> None:
        started.symmetric_difference_update(spawned_children())  # the workers now running
        raise KeyboardInterrupt

    monkeypatch.setattr(llm_engine, "Scheduler", interrupted_scheduler)
    with pytest.raises(KeyboardInterrupt):
        LLM(checkpoint, tensor_parallel_size=2, device="cpu", dtype="float32", executor="multiprocess")
    assert len(started) == 2
    assert not wait_gone(sorted(started), 30), "the workers outlived the failed start"
    assert not any(t.name == "tp-runtime-watchdog" for t in threading.enumerate())


def test_a_shutdown_from_another_thread_cannot_overtake_a_broadcast(start_llm: Callable[..., LLM]) -> None:
    """The engine's thread and shutdown() from another share the broadcast socket and its sequence numbers.
    A frame sealed first but sent second is dropped by the ranks as a replay (a Shutdown lost so: the ranks
    then waited out the grace period and were terminated). Here the first broadcast is held between its
    sealing and its sending until a second one from another thread has gone out, or 2 s have passed (then
    it was held back, as it must be)."""
    llm = start_llm()
    generate_ok(llm)
    channel = llm.engine.executor.channel  # type: ignore[attr-defined]
    real_pub = channel.pub
    sent: list[str] = []
    second_sent = threading.Event()

    class HeldPub:
        def send(self, frame: bytes) -> None:
            name = threading.current_thread().name
            if name == "first" and not sent:
                second_sent.wait(2.0)
            real_pub.send(frame)
            sent.append(name)
            if name == "second":
                second_sent.set()

        def __getattr__(self, attr: str) -> Any:
            return getattr(real_pub, attr)

    channel.pub = HeldPub()
    sealed: list[str] = []
    real_encode = channel.writer.encode

    def encode(message: Any) -> bytes:
        sealed.append(threading.current_thread().name)
        return real_encode(message)

    channel.writer.encode = encode
    first = threading.Thread(target=lambda: channel.send(Shutdown()), name="first")
    second = threading.Thread(target=lambda: channel.send(Shutdown()), name="second")
    first.start()
    while not sealed:  # the first frame is sealed and held before the second thread starts
        time.sleep(0.001)
    second.start()
    first.join()
    second.join()
    channel.pub, channel.writer.encode = real_pub, real_encode
    assert sealed == sent == ["first", "second"], (sealed, sent)
