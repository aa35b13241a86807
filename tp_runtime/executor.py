"""Executors: how the driver reaches its workers.

- InProcessExecutor: TP=1 in the driver's own process (no sockets, no process group).
- MultiprocExecutor: one spawned process per rank. The driver broadcasts over a ZeroMQ XPUB socket and
  reads replies from a PULL socket; only rank 0 answers a step. Start-up waits until every worker
  has subscribed (XPUB reports each subscription, so no message is lost to the PUB/SUB slow joiner) and
  sent READY. While waiting for any reply the driver watches the worker processes' sentinels, so a dead
  worker is an error naming its rank within a fraction of a second, and every wait has a timeout.
  Workers hold a pipe from the driver and exit when it closes, so they never outlive the driver.
- TorchrunExecutor: torchrun started every rank; rank 0 runs the driver plus its own worker in-process,
  ranks > 0 run the worker loop and connect to rank 0 over TCP (MASTER_ADDR).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any, Protocol, TypeVar

import zmq

from tp_runtime.config import EngineConfig
from tp_runtime.errors import ConfigError, EngineClosedError, StepTimeoutError, WorkerDiedError, WorkerError
from tp_runtime.messages import (
    ControlCall,
    DriverMessage,
    ExecuteModel,
    Flush,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
)
from tp_runtime.model_runner import PendingOutput
from tp_runtime.serialize import driver_message_codec, recv_spinning, worker_reply_codec
from tp_runtime.worker import Worker, WorkerAddresses, run_worker_loop

# How often a blocked driver wakes to check that its workers are alive.
_LIVENESS_POLL_MS = 100
_STARTUP_TIMEOUT_S = 600.0
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


def _free_tcp_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class _Channel:
    """Driver side of the sockets: broadcast out, replies in, with liveness checks while waiting."""

    def __init__(self, broadcast_addr: str, results_addr: str) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscriber, not only the first
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.broadcast_addr = self._bind(self.pub, broadcast_addr)
        self.results_addr = self._bind(self.pull, results_addr)
        self.encoder = driver_message_codec()
        self.decoder = worker_reply_codec()
        self.next_call_id = 0

    @staticmethod
    def _bind(sock: zmq.Socket[bytes], addr: str) -> str:
        if addr.endswith(":0"):
            port = sock.bind_to_random_port(addr[: addr.rindex(":")])
            return f"{addr[: addr.rindex(':')]}:{port}"
        sock.bind(addr)
        return addr

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class _RemoteWorkers:
    """Sends to and waits on remote ranks; subclasses say how to tell whether a rank is alive."""

    def __init__(self, channel: _Channel, remote_ranks: list[int], spin_wait_s: float) -> None:
        self.channel = channel
        self.remote_ranks = remote_ranks
        self.spin_wait_s = spin_wait_s
        self.closed = False
        # Step outputs that arrived while the driver waited for something else (a control call's result).
        self.early_outputs: dict[int, ModelRunnerOutput] = {}

    def check_alive(self, settle_s: float = 0.0) -> None:
        """Raise WorkerDiedError for a rank that is gone (waiting up to settle_s for one to exit)."""

    def broadcast(self, message: DriverMessage) -> None:
        self.channel.pub.send(self.channel.encoder.encode(message))

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

    def wait_replies(self, call_id: int, kind: str, ranks: set[int], timeout_s: float) -> dict[int, Any]:
        """Replies of `kind` for `call_id` from `ranks`; a worker error or death raises at once."""
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        pull = self.channel.pull
        spin_s = self.spin_wait_s
        while len(results) < len(ranks):
            data = recv_spinning(pull, spin_s, _LIVENESS_POLL_MS)
            if data is not None:
                reply = self.channel.decoder.decode(data)
                if reply.kind == "error":
                    # A rank that died takes its peers' collectives down with it; name the dead rank,
                    # not the survivor whose all-reduce failed.
                    self.check_alive(settle_s=0.5)
                    raise WorkerError(reply.rank, reply.error or "(no traceback)")
                if reply.call_id == call_id and reply.kind == kind and reply.rank in ranks:
                    results[reply.rank] = reply.output if kind == "output" else reply.result
                elif reply.kind == "output" and reply.output is not None:
                    self.early_outputs[reply.call_id] = reply.output
                continue
            self.check_alive()
            if time.monotonic() > deadline:
                missing = sorted(ranks - results.keys())
                raise StepTimeoutError(
                    f"no reply from rank(s) {missing} within {timeout_s:g} s (one slow or stuck rank stalls "
                    "every rank of the group); raise step_timeout_s if steps are expected to take this long"
                )
        return results

    def wait_output(self, step_id: int, timeout_s: float) -> ModelRunnerOutput:
        early = self.early_outputs.pop(step_id, None)
        for stale in [s for s in self.early_outputs if s < step_id]:  # steps of aborted requests
            del self.early_outputs[stale]
        if early is not None:
            return early
        output: ModelRunnerOutput = self.wait_replies(step_id, "output", {0}, timeout_s)[0]
        return output

    def wait_ready(self) -> dict[int, Any]:
        return self.wait_replies(-1, "ready", set(self.remote_ranks), _STARTUP_TIMEOUT_S)


class _SpawnedWorkers(_RemoteWorkers):
    def __init__(self, config: EngineConfig, channel: _Channel) -> None:
        super().__init__(
            channel, list(range(config.parallel.tensor_parallel_size)), config.parallel.spin_wait_s
        )
        self.config = config
        self.procs: list[mp.process.BaseProcess] = []
        self.death_pipes: list[Any] = []

    def start(self, init_method: str | None) -> None:
        ctx = mp.get_context("spawn")
        addresses = WorkerAddresses(self.channel.broadcast_addr, self.channel.results_addr)
        for rank in self.remote_ranks:
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=run_worker_loop,
                args=(self.config, rank, rank, addresses, init_method, reader),
                name=f"tp-runtime-worker-{rank}",
                daemon=True,
            )
            proc.start()
            reader.close()
            self.procs.append(proc)
            self.death_pipes.append(writer)

    def check_alive(self, settle_s: float = 0.0) -> None:
        if self.closed:
            raise EngineClosedError(
                "the engine was shut down (after an error, or by shutdown()); create a new LLM"
            )
        dead = wait_for_sentinels([p.sentinel for p in self.procs], timeout=settle_s)
        if dead:
            rank = next(i for i, p in enumerate(self.procs) if p.sentinel in dead)
            code = self.procs[rank].exitcode
            detail = f"exit code {code}" if code is None or code >= 0 else f"killed by signal {-code}"
            raise WorkerDiedError(rank, f"{detail}; the engine is shutting the other workers down")

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def stop(self, grace_s: float) -> None:
        """Wait up to grace_s for workers to leave after the Shutdown message, then SIGTERM, then SIGKILL."""
        self.closed = True
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        for w in self.death_pipes:
            w.close()


class MultiprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.ipc_dir = tempfile.mkdtemp(prefix="tp-runtime-")
        tag = uuid.uuid4().hex[:8]
        self.channel = _Channel(f"ipc://{self.ipc_dir}/bcast-{tag}", f"ipc://{self.ipc_dir}/results-{tag}")
        self.workers = _SpawnedWorkers(config, self.channel)
        self._shut_down = False
        self.last_step_timings: dict[str, float] = {}
        self._last_sent_step: int | None = None  # a step with nothing sent after it yet

    def initialize(self) -> int:
        tp = self.config.parallel.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{_free_tcp_port('127.0.0.1')}" if tp > 1 else None
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
            raise EngineClosedError(
                "the engine was shut down (after an error, or by shutdown()); create a new LLM"
            )

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


class TorchrunExecutor:
    """Rank 0 of a torchrun job: hosts the driver and rank 0's worker; other ranks connect over TCP."""

    def __init__(self, config: EngineConfig, worker: Worker) -> None:
        self.config = config
        self.worker = worker
        tp = config.parallel.tensor_parallel_size
        host = config.parallel.driver_host
        self.channel = _Channel(f"tcp://{host}:0", f"tcp://{host}:0")
        self.remote = _RemoteWorkers(self.channel, list(range(1, tp)), config.parallel.spin_wait_s)
        self._shut_down = False
        self.last_step_timings: dict[str, float] = {}
        self.pending = _PendingSteps()

    def initialize(self) -> int:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        self.remote.wait_for_subscribers(deadline)
        self.remote.wait_ready()
        return _size_kv_cache(self)

    def _drain_errors(self) -> None:
        """A remote rank that failed has sent an error reply; surface it."""
        while self.channel.pull.poll(0):
            reply = self.channel.decoder.decode(self.channel.pull.recv())
            if reply.kind == "error":
                raise WorkerError(reply.rank, reply.error or "(no traceback)")

    def submit(self, so: SchedulerOutput) -> None:
        t0 = time.perf_counter()
        self._drain_errors()
        self.remote.broadcast(ExecuteModel(so))
        self.last_step_timings = {"encode_broadcast": time.perf_counter() - t0}
        self.pending.add(self.worker.execute_model(so))

    def wait_output(self, step_id: int) -> ModelRunnerOutput:
        # Ranks > 0 never answer a step; only an error reply can be waiting from them.
        return self.pending.resolve(step_id)

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        call_id = self.channel.next_call_id
        self.channel.next_call_id += 1
        self._drain_errors()
        self.remote.broadcast(ControlCall(call_id, method, list(args or [])))
        local = self.worker.call(method, list(args or []))
        results = self.remote.wait_replies(
            call_id, "result", set(self.remote.remote_ranks), self.config.parallel.step_timeout_s
        )
        return [local] + [results[r] for r in sorted(results)]

    def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        try:
            self.remote.broadcast(Shutdown())
            time.sleep(0.2)  # let the shutdown message leave before the socket closes
        except zmq.ZMQError:
            pass
        self.channel.close()
        self.worker.shutdown()


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
    worker = Worker(config, rank, local_rank)
    worker.init_device("env://")
    executor = TorchrunExecutor(config, worker) if rank == 0 else None
    # Share rank 0's socket addresses through the process group (raw bytes, nothing unpickled).
    payload = (
        f"{executor.channel.broadcast_addr} {executor.channel.results_addr}".encode() if executor else None
    )
    broadcast_addr, results_addr = worker.tp.broadcast_bytes(payload, worker.device).decode().split(" ")
    worker.load_model()
    if executor is not None:
        return executor
    run_worker_loop(
        config, rank, local_rank, WorkerAddresses(broadcast_addr, results_addr), None, worker=worker
    )
    return None


def executor_kind(config: EngineConfig) -> str:
    kind = config.parallel.executor
    if kind == "auto":
        if os.environ.get("TORCHELASTIC_RUN_ID") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return "torchrun"
        return "inprocess" if config.parallel.tensor_parallel_size == 1 else "multiprocess"
    return kind
