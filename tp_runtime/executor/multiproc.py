"""MultiprocExecutor: one process per rank, each a fresh interpreter
(`python -m tp_runtime.worker.process`), reached over ipc sockets in a private folder."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import site
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import zmq

import tp_runtime
from tp_runtime.config import EngineConfig
from tp_runtime.errors import (
    EngineClosedError,
    WorkerDiedError,
)
from tp_runtime.executor.base import T, size_kv_cache
from tp_runtime.executor.remote import INTERRUPTED_MESSAGE, RemoteWorkers
from tp_runtime.ipc import DriverChannel, ipc_channel, message_limits
from tp_runtime.messages import (
    PROTOCOL,
    ControlCall,
    ExecuteModel,
    Flush,
    GrammarMask,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
)
from tp_runtime.worker.process import (
    PROTOCOL_MISMATCH,
    PROTOCOL_MISMATCH_EXIT,
    SpawnArgs,
    encode_spawn_args,
)


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


class _SpawnedWorkers(RemoteWorkers):
    """Ranks started as fresh interpreters (`python -m tp_runtime.worker.process`). Each gets its
    arguments as one frame on its stdin, which the driver then holds open: the workers see EOF, and exit,
    when the driver dies. A death is seen through Popen.poll() between polls for replies."""

    def __init__(self, config: EngineConfig, channel: DriverChannel) -> None:
        super().__init__(
            channel, list(range(config.parallel.tensor_parallel_size)), config.parallel.spin_wait_s,
            vocab_size=config.model.vocab_size,
        )
        self.config = config
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ready = False  # every rank answered READY (a rank exits PROTOCOL_MISMATCH_EXIT only before)

    def start(self, init_method: str | None) -> None:
        channel = self.channel
        env = _worker_environment()
        # A process forked from the driver would inherit the pipes' write ends and keep the workers alive
        # after the driver died: the child closes them. One hook per engine, which does nothing once the
        # engine is gone (a weak reference).
        os.register_at_fork(after_in_child=functools.partial(_close_pipes_in_child, weakref.ref(self)))
        # A worker asks the kernel for a signal when its parent dies (process.die_with_parent), which
        # comes when the thread that spawned it ends: asked for only when that is the main thread, which
        # lasts as long as the driver (from a short-lived thread it would come early, and then not again).
        main = threading.current_thread() is threading.main_thread()
        die_with_parent = os.getpid() if main else None
        for rank in self.remote_ranks:
            # The key travels only in this frame, over the child's stdin: never on its command line (ps
            # shows that) or in its environment, and never pickled.
            frame = encode_spawn_args(
                SpawnArgs(
                    config=self.config, rank=rank, local_rank=rank, broadcast=channel.broadcast_addr,
                    results=channel.results_addr, heartbeat=channel.watchdog.address,
                    max_broadcast_bytes=message_limits(self.config)[0], key=channel.key,
                    init_method=init_method, die_with_parent=die_with_parent, protocol=PROTOCOL,
                )
            )  # fmt: skip
            # A session of its own: a Ctrl-C at the terminal (SIGINT to the foreground process group)
            # reaches only the driver, which shuts the workers down; they print nothing.
            proc = subprocess.Popen(
                [sys.executable, "-m", "tp_runtime.worker.process"], stdin=subprocess.PIPE, env=env,
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
                if code == PROTOCOL_MISMATCH_EXIT and not self.ready:
                    raise WorkerDiedError(rank, f"it {PROTOCOL_MISMATCH}")
                if code is not None:
                    detail = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
                    raise WorkerDiedError(rank, f"{detail}; the engine is shutting the other workers down")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.02)

    def wait_ready(self, timeout_s: float) -> dict[int, Any]:
        answers = super().wait_ready(timeout_s)
        self.ready = True
        return answers

    def _stopped(self, rank: int) -> bool:
        return rank < len(self.procs) and _process_state(self.procs[rank].pid) in ("T", "t")

    def _maybe_busy(self, rank: int) -> bool:
        # Silent but running: its main thread may hold the GIL for long (a Triton compile); the step
        # timeout still bounds the wait. Stopped (T) or asleep while silent (S, D): stuck.
        return _process_state(self.procs[rank].pid) == "R"

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self, grace_s: float, hurry: threading.Event | None = None) -> None:
        """Wait up to grace_s for workers to leave after the Shutdown message, then SIGTERM, then SIGKILL;
        once `hurry` is set, SIGKILL at once. Every process is reaped."""
        self.closed = True
        hurry = hurry or threading.Event()
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            _wait(p, deadline, hurry)
        for p in self.procs:
            if p.poll() is None:
                # A stopped process cannot act on SIGTERM: do not wait for it.
                p.kill() if hurry.is_set() or _process_state(p.pid) in ("T", "t") else p.terminate()
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            if not _wait(p, deadline, hurry):
                p.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=2.0)
        for p in self.procs:
            if p.stdin is not None:
                with contextlib.suppress(OSError):
                    p.stdin.close()


def _close_pipes_in_child(workers: weakref.ref[_SpawnedWorkers]) -> None:
    spawned = workers()
    for proc in spawned.procs if spawned is not None else ():
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()


def _wait(proc: subprocess.Popen[bytes], deadline: float, hurry: threading.Event) -> bool:
    """Wait for proc to exit until the deadline or until `hurry` is set; whether it exited."""
    while proc.poll() is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or hurry.is_set():
            return False
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=min(remaining, 0.05))
    return True


class MultiprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        broadcast_limit, reply_limit = message_limits(config)
        self.ipc_dir, self.channel = ipc_channel(
            secrets.token_bytes(32), reply_limit, max_broadcast_bytes=broadcast_limit
        )
        self.workers = _SpawnedWorkers(config, self.channel)
        self._shut_down = False
        self.last_step_timings: dict[str, float] = {}
        self._last_sent_step: int | None = None  # a step with nothing sent after it yet
        # Control calls of the start-up (KV-cache sizing: a profiling forward, compiles) are start-up.
        self._control_timeout_s = config.parallel.startup_timeout_s

    def initialize(self) -> int:
        tp = self.config.parallel.tensor_parallel_size
        # A FileStore in the private folder: torch's TCPStore would listen on every interface.
        init_method = f"file://{self.ipc_dir}/process-group-store" if tp > 1 else None
        try:
            self.workers.start(init_method)
            self.workers.wait_ready(self.config.parallel.startup_timeout_s)
            num_blocks = size_kv_cache(self)
            self._control_timeout_s = self.config.parallel.step_timeout_s
            return num_blocks
        except BaseException:
            self.shutdown(grace_s=0.5)
            raise

    def _guarded(self, fn: Callable[[], T]) -> T:
        """Run fn; on any failure shut every worker down before re-raising (a Ctrl-C is named by the
        later calls' EngineClosedError)."""
        try:
            return fn()
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) and not self._shut_down:
                self.workers.closed_message = INTERRUPTED_MESSAGE
            # Survivors may be stuck in a collective with the failed rank: do not wait long for them.
            self.shutdown(grace_s=0.5)
            raise

    def submit(self, so: SchedulerOutput) -> None:
        def run() -> None:
            t0 = time.perf_counter()
            # Liveness is checked while waiting (each time the reply poll times out), not per step.
            self._check_open()
            self.workers.broadcast(ExecuteModel(so))
            self.workers.submitted(so.step_id, so.scheduled_req_ids)
            self._last_sent_step = so.step_id
            self.last_step_timings = {"encode_broadcast": time.perf_counter() - t0}

        self._guarded(run)

    def submit_grammar_mask(self, mask: GrammarMask) -> None:
        def run() -> None:
            self._check_open()
            self.workers.broadcast(mask)

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
            results = self.workers.wait_replies(call_id, "result", ranks, self._control_timeout_s)
            return [results[r] for r in sorted(results)]

        return self._guarded(run)

    def check_alive(self) -> None:
        def run() -> None:
            self._check_open()
            self.workers.check_alive()

        self._guarded(run)

    def _check_open(self) -> None:
        if self._shut_down:
            raise EngineClosedError(self.workers.closed_message)

    def worker_pids(self) -> list[int]:
        return self.workers.pids()

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop the workers (grace_s to leave on their own) and remove the sockets and their folder. A
        Ctrl-C meanwhile (an impatient second one, say) does not cut it short: the step it interrupted runs
        again in a hurry (the workers are killed at once), the rest follows, and then it is raised."""
        if self._shut_down:
            return
        self._shut_down = True
        hurry = threading.Event()

        def say_shutdown() -> None:
            with contextlib.suppress(zmq.ZMQError):
                self.workers.broadcast(Shutdown())

        steps: list[Callable[[], object]] = [
            say_shutdown,
            lambda: self.workers.stop(grace_s, hurry),
            self.channel.close,
            lambda: shutil.rmtree(self.ipc_dir, ignore_errors=True),
        ]
        interrupted: KeyboardInterrupt | None = None
        for step in steps:
            while True:
                try:
                    step()
                    break
                except KeyboardInterrupt as exc:
                    interrupted = exc
                    hurry.set()
        if interrupted is not None:
            raise interrupted

