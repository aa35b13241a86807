"""torchrun mode: torchrun started every rank; rank 0 runs the driver plus its own worker in-process,
ranks > 0 run the worker loop and connect to rank 0."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hmac
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq

from tp_runtime.config import EngineConfig, torchrun_rank
from tp_runtime.errors import (
    ConfigError,
    EngineClosedError,
    TPRuntimeError,
    WorkerDiedError,
    WorkerError,
)
from tp_runtime.executor.base import PendingSteps, T, size_kv_cache
from tp_runtime.executor.remote import INTERRUPTED_MESSAGE, RemoteWorkers
from tp_runtime.ipc import QUIET_S, DriverChannel, ipc_channel, message_limits
from tp_runtime.messages import (
    PROTOCOL,
    ControlCall,
    ExecuteModel,
    GrammarMask,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
)
from tp_runtime.serialize import (
    check_curve,
    derive_job_key,
    key_check,
)
from tp_runtime.worker.worker import Worker, WorkerAddresses, run_worker_loop


class _TorchrunRemotes(RemoteWorkers):
    """Ranks > 0 of a torchrun job: no process handles, so a death shows as a closed heartbeat connection
    followed by silence (which takes up to QUIET_S to tell apart from a reconnect)."""

    settle_s = QUIET_S + 1.0

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
            death_shown = closed_at is not None and now - closed_at < settle_s + QUIET_S
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
        broadcast_limit, reply_limit = message_limits(config)
        if host == _ONE_HOST:
            # Every rank is on this host: ipc sockets in a 0700 folder, which no other user can reach
            # (a loopback TCP port would let any local user subscribe to the broadcasts and read them).
            self.ipc_dir, self.channel = ipc_channel(key, reply_limit, max_broadcast_bytes=broadcast_limit)
        else:
            addr = f"tcp://{host}:0"
            self.channel = DriverChannel(addr, addr, addr, key, reply_limit, broadcast_limit)
        self.channel.watchdog.hard_exit = True
        self.remote = _TorchrunRemotes(self.channel, list(range(1, tp)), config.parallel.spin_wait_s)
        self._shut_down = False
        self.last_step_timings: dict[str, float] = {}
        self.pending = PendingSteps()
        # Control calls of the start-up (KV-cache sizing: a profiling forward, compiles) are start-up.
        self._control_timeout_s = config.parallel.startup_timeout_s

    def initialize(self) -> int:
        try:
            self.remote.wait_ready(self.config.parallel.startup_timeout_s)
            num_blocks = size_kv_cache(self)
            self._release_socket_folder()
            self._control_timeout_s = self.config.parallel.step_timeout_s
            return num_blocks
        except BaseException:
            self.shutdown()
            raise

    def _guarded(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) and not self._shut_down:
                self.remote.closed_message = INTERRUPTED_MESSAGE  # named by the later calls' error
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
            # Steps never wait in RemoteWorkers._serve here, which drains the broadcast socket: do it now.
            self.channel.discard_inbound()
            self.remote.broadcast(ExecuteModel(so))
            if self.ipc_dir is not None:
                self._release_socket_folder()
            self.last_step_timings = {"encode_broadcast": time.perf_counter() - t0}
            launched = self._local(lambda: self.worker.execute_model(so))
            if launched is not None:  # else it waits for its grammar mask
                self.pending.add(launched)

        self._guarded(run)

    def submit_grammar_mask(self, mask: GrammarMask) -> None:
        def run() -> None:
            self._check_open()
            self.remote.broadcast(mask)
            self.pending.add(self._local(lambda: self.worker.apply_grammar_mask(mask)))

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
                call_id, "result", set(self.remote.remote_ranks), self._control_timeout_s
            )
            return [local] + [results[r] for r in sorted(results)]

        return self._guarded(run)

    def check_alive(self) -> None:
        def run() -> None:
            self._check_open()
            self.remote.check_alive()
            self.remote.poll_errors()
            self.channel.discard_inbound()

        self._guarded(run)

    def _check_open(self) -> None:
        if self._shut_down:
            raise EngineClosedError(self.remote.closed_message)

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
        self.close_channel()
        self.worker.shutdown()

    def close_channel(self) -> None:
        """Close the driver's sockets and watchdog and remove their folder."""
        self.channel.close()
        self._remove_socket_folder()

    def _release_socket_folder(self) -> None:
        """Once every rank's sockets are connected (their heartbeats' too, which connect on a thread of
        their own after the rank is ready), remove the socket files: open connections outlive them, and
        then none is left behind however rank 0 ends (torchrun's SIGTERM, after another rank failed,
        kills it). Until then each step checks again."""
        if self.channel.watchdog.connected_all():
            self._remove_socket_folder()

    def _remove_socket_folder(self) -> None:
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None


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
_PR_SET_PDEATHSIG = 1  # prctl(2)


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


def _join(config: EngineConfig, make_driver: bool) -> tuple[Worker, TorchrunExecutor | None, WorkerAddresses]:
    """Every rank: start its worker and the process group, and agree on the driver's addresses and key
    (rank 0 creates the driver's sockets and sends their addresses through the process group)."""
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
    if host != _ONE_HOST:
        check_curve()  # every rank, before the process group: the TCP sockets need CURVE
    worker = Worker(config, rank, local_rank)
    worker.init_device("env://")
    executor = None
    payload = None
    if make_driver:
        # A fresh nonce per job: with a secret, frames of another job using the same secret are rejected;
        # without one (one host), the nonce is the key, shared only through the process group.
        nonce = secrets.token_bytes(32)
        key = derive_job_key(secret, nonce)
        executor = TorchrunExecutor(config, worker, host, key)
        ch = executor.channel
        fields = [ch.broadcast_addr, ch.results_addr, ch.watchdog.address, nonce.hex(), key_check(key).hex()]
        payload = "\n".join(fields).encode()  # ipc paths may hold spaces
    with _termination_as_exit(executor is not None) as termination:
        try:
            return _agree_and_load(config, worker, executor, payload, secret)
        except BaseException:
            termination.deferred = True  # a SIGTERM now must not cut the clean-up short
            if executor is not None:  # its sockets, watchdog and socket folder go with the failed start
                executor.close_channel()
            # The process group and the weights go too: the program may start another engine.
            with contextlib.suppress(Exception):  # the start's own error is the one to report
                worker.shutdown()
            raise


class _Termination:
    deferred = False


@contextlib.contextmanager
def _termination_as_exit(enabled: bool) -> Iterator[_Termination]:
    """While rank 0 starts: SIGTERM raises SystemExit, so the driver's socket folder is removed when torchrun
    ends the job because another rank failed (its default action would kill the process first); once the
    failed start is cleaning up (`deferred`), a SIGTERM is ignored: the process is exiting already."""
    termination = _Termination()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield termination
        return

    def stop(signum: int, frame: object) -> None:
        if not termination.deferred:
            raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield termination
    finally:
        signal.signal(signal.SIGTERM, previous)


def _agree_and_load(
    config: EngineConfig, worker: Worker, executor: TorchrunExecutor | None, payload: bytes | None,
    secret: bytes | None,
) -> tuple[Worker, TorchrunExecutor | None, WorkerAddresses]:  # fmt: skip
    """_join's rest: every rank takes rank 0's addresses, checks that the ranks agree, and loads the model."""
    broadcast_addr, results_addr, heartbeat_addr, nonce_hex, check_hex = (
        worker.tp.broadcast_bytes(payload, worker.device).decode().split("\n")
    )
    # Every rank must speak rank 0's messages: msgpack arrays of another layout decode into wrong fields.
    rank0_protocol = worker.tp.broadcast_bytes(PROTOCOL.encode(), worker.device).decode()
    if worker.tp.all_reduce_min_int(int(rank0_protocol == PROTOCOL), worker.device) == 0:
        raise ConfigError(
            "the ranks of this torchrun job run tp_runtime code whose driver-worker messages differ (another "
            "version of the package on some node); install the same version on every node"
        )
    # Every rank must run the engine rank 0's driver schedules for: other engine arguments on one rank
    # (a seed, a dtype, a block size) would give wrong tokens or a hang, never an error.
    differs = _differing_settings(config, worker)
    if differs:
        raise ConfigError(
            f"the ranks of this torchrun job were given different engine arguments (settings that differ "
            f"from rank 0's on some rank: {', '.join(differs)}); pass the same arguments to every rank"
        )
    key = derive_job_key(secret, bytes.fromhex(nonce_hex))
    same_key = hmac.compare_digest(key_check(key), bytes.fromhex(check_hex))
    if worker.tp.all_reduce_min_int(int(same_key), worker.device) == 0:
        raise ConfigError(
            "the ranks of this torchrun job hold different shared secrets; set the same TP_RUNTIME_SECRET "
            "(or TP_RUNTIME_SECRET_FILE contents) on every node"
        )
    worker.load_model()
    addresses = WorkerAddresses(broadcast_addr, results_addr, key, heartbeat_addr, message_limits(config)[0])
    return worker, executor, addresses


def _comparable_config(config: EngineConfig) -> bytes:
    """The engine configuration as every rank must hold it: all of it but the model's folder (and the
    generation config file's path in it) and the tokenizer's, which may sit at another path on each host
    (only rank 0 reads the tokenizer), and the driver's host, which each node names by its own
    MASTER_ADDR (only rank 0 binds it)."""
    model = config.model
    local = dataclasses.replace(
        config,
        tokenizer=None,
        model=dataclasses.replace(
            model, path="", generation_defaults=dataclasses.replace(model.generation_defaults, source=None)
        ),
        parallel=dataclasses.replace(config.parallel, driver_host=""),
    )
    return msgspec.json.encode(local)


def _settings(decoded: Any, prefix: str = "") -> dict[str, Any]:
    """A decoded configuration as dotted setting name -> value."""
    if not isinstance(decoded, dict):
        return {prefix: decoded}
    out: dict[str, Any] = {}
    for key, value in decoded.items():
        out.update(_settings(value, f"{prefix}.{key}"))
    return out


def _differing_settings(config: EngineConfig, worker: Worker) -> list[str]:
    """The settings (dotted names) in which some rank's configuration differs from rank 0's; the same
    list on every rank."""
    encoded = _comparable_config(config)
    rank0 = _settings(msgspec.json.decode(worker.tp.broadcast_bytes(encoded, worker.device, 1 << 20)))
    mine = _settings(msgspec.json.decode(encoded))
    names = sorted(rank0)
    agree = [int(n in mine and mine[n] == rank0[n]) for n in names]
    same = worker.tp.all_reduce_min_ints(agree, worker.device)
    return [n.lstrip(".") for n, ok in zip(names, same, strict=True) if not ok]


def connect_torchrun_driver(config: EngineConfig) -> TorchrunExecutor:
    """Rank 0 of a torchrun job: the executor its driver uses, with rank 0's own worker in-process."""
    _, executor, _ = _join(config, make_driver=True)
    assert executor is not None
    return executor


def serve_worker_rank(config: EngineConfig, *, driver_drains: bool = False) -> None:
    """A rank > 0 of a torchrun job: serve as a worker of rank 0's driver until it shuts down. Every rank
    must pass the same configuration (the same engine arguments) as rank 0.

    `driver_drains` (`tp-runtime serve`): once started, this rank ignores SIGTERM and SIGINT. torchrun
    passes a signal it gets to every rank at once, but rank 0's server answers it by draining: its
    requests in flight still need this rank, which it shuts down when it is done (and this rank leaves
    by itself if the driver dies; torchrun SIGKILLs it after its own grace)."""
    rank = torchrun_rank()
    if rank is None or rank == 0:
        raise ConfigError(
            "run_torchrun_worker is for ranks > 0 of a torchrun job; rank 0 (and a process outside "
            "torchrun) creates the LLM instead"
        )
    worker, _, addresses = _join(config, make_driver=False)
    if driver_drains and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        if sys.platform.startswith("linux"):
            # The launcher's death reaches a rank as SIGTERM (PR_SET_PDEATHSIG, tp_runtime/launch.py),
            # ignored now: it is SIGKILL instead, so no rank outlives a launcher killed outright.
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    run_worker_loop(
        config, worker.rank, worker.local_rank, addresses, None, worker=worker, exit_if_driver_leaves=True
    )
