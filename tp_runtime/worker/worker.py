"""A worker: one TP rank. Owns its device, its model shard, its KV cache and its model runner.

`Worker` is the in-process object (the in-process executor and torchrun's rank 0 call it directly);
`run_worker_loop` is the process main loop used by spawned workers and by torchrun ranks > 0:
receive a broadcast message -> execute -> rank 0 replies (control calls may ask every rank to reply).
With async scheduling, rank 0 answers a step whose ids are not on the host yet (a GPU step) only after it
has queued the next step (for a step sent with grammar_mask_follows: its forward, the driver needing the
answer to make the mask; the step's GrammarMask then samples it, and its answer is held in turn), or when
any other message (Flush, a control call, Shutdown) arrives, so the device always has the next step
before the host waits for the previous one's ids. A step whose ids are already there (CPU) is answered at
once.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from tp_runtime import distributed
from tp_runtime.config import EngineConfig
from tp_runtime.distributed import TPGroup
from tp_runtime.errors import ConfigError, ProtocolError
from tp_runtime.loader import init_dummy_weights, load_weights
from tp_runtime.messages import (
    ControlCall,
    ExecuteModel,
    Flush,
    GrammarMask,
    Hello,
    ReplyKind,
    SchedulerOutput,
    Shutdown,
    WorkerReply,
)
from tp_runtime.models.registry import architecture
from tp_runtime.serialize import (
    BROADCAST,
    DRIVER_ID,
    HEARTBEAT_INTERVAL_S,
    HEARTBEATS,
    REPLIES,
    FrameReader,
    FrameWriter,
    Signer,
    driver_message_codec,
    recv_spinning,
    secure_client,
    worker_reply_codec,
)
from tp_runtime.worker.kernel_precompile import triton_driver_starting
from tp_runtime.worker.kv_sizing import (
    CPU_KV_CACHE_RAM_SHARE,
    GpuMemoryPlan,
    available_memory_bytes,
    cpu_kv_cache_blocks,
)
from tp_runtime.worker.model_runner import ModelRunner, pick_kernels
from tp_runtime.worker.outputs import PendingOutput
from tp_runtime.worker.step_check import check_step

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# A torchrun worker whose driver's connection closed waits this long for a Shutdown message before it
# concludes that the driver died and exits.
_DRIVER_GONE_GRACE_S = 3.0


@dataclass(frozen=True)
class WorkerAddresses:
    """How a worker reaches its driver: the addresses, and the key that authenticates every frame (it
    travels only through the worker's stdin pipe or is derived from the torchrun secret; never printed)."""

    broadcast: str  # driver's XPUB; workers SUB-connect
    results: str  # driver's PULL; workers PUSH-connect
    key: bytes = field(repr=False)
    heartbeat: str | None = None  # driver's heartbeat PULL; None: no heartbeat thread
    # Largest frame the driver may broadcast (the executor derives it from the config); the SUB socket
    # drops the connection on anything larger rather than buffering it.
    max_broadcast_bytes: int = 1 << 30


# Set to 1 in a worker's environment (spawned workers and torchrun ranks inherit the driver's), it lets
# control calls reach FAULT_INJECTION_METHODS: hooks for the tests, refused in production.
FAULT_INJECTION_ENV = "TP_RUNTIME_FAULT_INJECTION"


def freeze_start_up_objects() -> None:
    """Move what start-up made (modules, the model, the graphs) out of the cyclic garbage collector's sight,
    as vLLM does after capture: a full collection would otherwise walk all of it, hundreds of milliseconds
    in the middle of serving. Objects made later are collected as before; shutdown unfreezes."""
    gc.collect()
    gc.freeze()


class Worker:
    # Methods a control call may name; nothing else is reachable from the socket.
    CONTROL_METHODS = frozenset(
        {"determine_num_kv_blocks", "allocate_kv_cache", "set_collect_timings", "set_bookkeeping_order",
         "decode_traffic"}
    )  # fmt: skip
    FAULT_INJECTION_METHODS = frozenset({"debug_raise"})

    def __init__(self, config: EngineConfig, rank: int, local_rank: int) -> None:
        self.control_methods = self.CONTROL_METHODS
        if os.environ.get(FAULT_INJECTION_ENV) == "1":
            self.control_methods |= self.FAULT_INJECTION_METHODS
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = config.parallel.tensor_parallel_size
        self.device = torch.device(f"cuda:{local_rank}" if config.device == "cuda" else "cpu")
        self.tp = TPGroup(rank, self.world_size)
        self.runner: ModelRunner | None = None
        self.num_kv_blocks: int | None = None  # set once the KV cache is allocated

    def init_device(self, init_method: str | None) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        elif torch.get_num_threads() > 1 and self.world_size > 1:
            # CPU ranks share the machine's cores; oversubscription makes every rank slower.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world_size))
        if self.world_size > 1:
            if init_method is None:
                raise ConfigError("internal: a TP>1 worker needs a process-group init method")
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            # Longer than the driver's step timeout, so a stuck rank is reported by the driver rather than
            # by a peer whose collective happened to time out first.
            timeout_s = self.config.parallel.step_timeout_s + 60.0
            # The largest decode-step all-reduce: a full batch of hidden states.
            max_message_bytes = (
                self.config.scheduler.max_num_seqs
                * self.config.model.hidden_size
                * _DTYPES[self.config.model.dtype].itemsize
            )
            self.tp = distributed.init_process_group(
                backend, init_method, self.rank, self.world_size, timeout_s, self.device,
                all_reduce_strategy=self.config.parallel.all_reduce, max_message_bytes=max_message_bytes,
                model_dtype=_DTYPES[self.config.model.dtype],
                join_timeout_s=self.config.parallel.startup_timeout_s,
            )  # fmt: skip

    def _report(self, text: str) -> None:
        """A start-up phase's line on stderr: rank 0, on GPUs (where start-up takes long enough to ask)."""
        if self.rank == 0 and self.device.type == "cuda":
            print(f"tp-runtime: {text}", file=sys.stderr, flush=True)

    def load_model(self) -> None:
        start = time.perf_counter()
        mc = self.config.model
        dtype = _DTYPES[mc.dtype]
        fused = pick_kernels(self.config.fused_kernels, self.device) == "triton"
        arch = architecture(mc.architecture)
        with triton_driver_starting(self.device):
            model = arch.model(mc, self.tp, dtype, self.device, fused=fused)
            if mc.load_format == "dummy":
                init_dummy_weights(model, self.config.seed, dtype, self.device)
            else:
                load_weights(model, mc.path, dtype, mc.quantization, arch.checkpoint_names)
        model.eval()
        self.runner = ModelRunner(self.config, model, self.device, self.rank)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            held = torch.cuda.memory_allocated(self.device) / 2**30
            self._report(f"loaded the model in {time.perf_counter() - start:.1f} s ({held:.2f} GiB a rank)")

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("internal: worker used before load_model()")
        return self.runner

    def determine_num_kv_blocks(self) -> int:
        """Blocks this rank can hold, agreed across ranks (the minimum)."""
        start = time.perf_counter()
        runner = self._runner()
        cache = self.config.cache
        per_block = runner.kv_bytes_per_block()
        plan = None
        if cache.num_kv_blocks is not None:
            blocks = cache.num_kv_blocks
        elif self.device.type == "cuda":
            before = torch.cuda.memory_allocated(self.device)
            peak = runner.profile_peak_memory()
            free, total = torch.cuda.mem_get_info(self.device)
            outside = max(0, total - free - torch.cuda.memory_reserved(self.device))
            # The profile runs a prefill; a decode step holds more on top (on the gather path a full
            # batch's keys and values at max_model_len, one layer at a time), and the mixed-step graphs
            # keep a prefill's activations of their own, so reserve both too rather than OOM mid-run.
            reserve = runner.decode_reserve_bytes() + runner.mixed_graph_pool_bytes(peak - before)
            plan = GpuMemoryPlan(total, cache.gpu_memory_utilization, before, peak, reserve, outside)
            blocks = plan.blocks(per_block)
        else:
            # What every sequence at full length needs, capped by the size asked for or a share of the RAM.
            if cache.cpu_kv_cache_gib is not None:
                # (a size past all memory is capped below anyway; held finite before the conversion)
                asked = min(cache.cpu_kv_cache_gib, float(1 << 40))
                available, share, ranks = int(asked * (1 << 30)), 1.0, 1
            else:
                available, share = available_memory_bytes(), CPU_KV_CACHE_RAM_SHARE
                ranks = self.config.parallel.tensor_parallel_size
            blocks = cpu_kv_cache_blocks(
                per_block, self.config.scheduler.max_num_seqs, runner.max_blocks, available, share, ranks
            )
        # The fewest blocks over the ranks, and the first rank with that few (one minimum of both).
        blocks, fewest_rank = divmod(
            self.tp.all_reduce_min_int(blocks * self.world_size + self.rank, self.device), self.world_size
        )
        if blocks < 0:  # every rank sees the minimum, so all of them stop here
            if plan is not None and fewest_rank == self.rank:
                raise plan.no_room(self.rank)
            raise ConfigError(
                f"no room for a KV cache on rank {fewest_rank}'s GPU; raise gpu_memory_utilization or lower "
                "max_num_batched_tokens, max_num_seqs or max_model_len"
            )
        self._report(f"sized the KV cache in {time.perf_counter() - start:.1f} s: {blocks} blocks of "
                     f"{cache.block_size} tokens ({blocks * per_block / 2**30:.2f} GiB a rank)")  # fmt: skip
        return blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache, then warm up: every CUDA graph is captured before the engine is ready."""
        runner = self._runner()
        # (0 is possible: too little memory for one block, which the engine then explains to the user)
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ProtocolError(f"allocate_kv_cache needs a number of blocks >= 0, got {num_blocks!r}")
        runner.allocate_kv_cache(num_blocks)
        self.num_kv_blocks = num_blocks
        runner.warm_up()
        if self.device.type == "cuda":
            freeze_start_up_objects()


    def set_collect_timings(self, enabled: bool) -> None:
        self._runner().collect_timings = bool(enabled)

    def set_bookkeeping_order(self, order: str) -> None:
        """Benchmark switch: "overlap" (value-free bookkeeping before the device->host sync, the default)
        or "sync_first" (wait for the sampled ids first, the order the runner replaced)."""
        if order not in ("overlap", "sync_first"):
            raise ValueError(f"bookkeeping order must be overlap|sync_first, got {order!r}")
        self._runner().sync_first = order == "sync_first"

    def decode_traffic(self) -> dict[str, float]:
        """What a decode step must read on this rank, and the device's measured copy bandwidth (for the
        latency benchmark's roofline)."""
        runner = self._runner()
        return {
            "weight_bytes": float(runner.model.decode_weight_bytes()),
            "kv_bytes_per_token": runner.kv_bytes_per_block() / runner.block_size,
            "copy_bandwidth": measure_copy_bandwidth(self.device),
        }

    def debug_raise(self, message: str, repeat: int = 1) -> None:
        """Raise inside the worker (tests check that remote errors reach the driver), with `message` repeated
        `repeat` times; a fault-injection method."""
        raise RuntimeError(message * repeat)

    def execute_model(self, so: SchedulerOutput) -> PendingOutput | None:
        """The step queued; None for one that waits for its GrammarMask (`apply_grammar_mask`)."""
        return self._runner().execute_model(so)

    def check_step(self, so: SchedulerOutput) -> None:
        """Refuse (ProtocolError) a step from the socket that this rank cannot run safely (check_step)."""
        check_step(so, self.config, self._runner().batch, self.num_kv_blocks)

    def apply_grammar_mask(self, mask: GrammarMask) -> PendingOutput:
        return self._runner().apply_grammar_mask(mask)

    def call(self, method: str, args: list[Any]) -> Any:
        if method not in self.control_methods:
            if method in self.FAULT_INJECTION_METHODS:
                raise ValueError(
                    f"control method {method!r} is a fault-injection hook for tests and is refused: the "
                    f"worker's environment does not set {FAULT_INJECTION_ENV}=1"
                )
            raise ValueError(f"unknown control method {method!r}")
        return getattr(self, method)(*args)

    def shutdown(self) -> None:
        # Drop the weights and KV cache now: an in-process engine's memory must not outlive shutdown().
        self.runner = None
        if self.device.type == "cuda":
            gc.unfreeze()  # what start-up froze can be collected again
            # A step sent ahead (async scheduling) may still be queued, collectives included; let it finish
            # before the process group goes. A rank stuck on a dead peer is ended by the driver's SIGTERM.
            torch.cuda.synchronize(self.device)
            gc.collect()  # the runner and its CUDA graphs reference each other
            torch.cuda.empty_cache()
        self.tp.strategy.close()
        if self.world_size > 1:  # the group this worker joined; at TP 1 any group is the host program's
            distributed.destroy_process_group()


def measure_copy_bandwidth(device: torch.device) -> float:
    """Bytes per second moved (read + written) by one large device-to-device copy, best of a few."""
    nbytes = 1 << 30 if device.type == "cuda" else 1 << 27
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        nbytes = min(nbytes, free // 4)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            elapsed = time.perf_counter() - t0
        best = min(best, elapsed)
    return 2 * nbytes / best


def _exit_when_parent_dies(parent_conn: Any, addresses: WorkerAddresses) -> None:
    """Block on the pipe from the driver; EOF means the driver is gone, so leave at once (no orphans),
    removing the driver's ipc socket folder, which a killed driver cannot remove itself."""
    with contextlib.suppress(EOFError, OSError):
        parent_conn.recv()
    if addresses.broadcast.startswith("ipc://"):
        shutil.rmtree(os.path.dirname(addresses.broadcast[len("ipc://") :]), ignore_errors=True)
    os._exit(1)


def _bind_collectives_to_loopback() -> None:
    """Spawned ranks share one host: make gloo and NCCL listen on the loopback interface, not on the
    address the host name resolves to (unless the user chose an interface)."""
    names = [name for _, name in socket.if_nameindex()]
    loopback = next((n for n in ("lo", "lo0") if n in names), None)
    if loopback is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)


def _send_heartbeats(
    ctx: zmq.Context[zmq.Socket[bytes]],
    addresses: WorkerAddresses,
    rank: int,
    stop: threading.Event,
    driver_monitor: zmq.Socket[bytes] | None,
    driver_gone: threading.Event | None = None,
) -> None:
    """Heartbeat thread: an authenticated empty frame every HEARTBEAT_INTERVAL_S on its own socket. With
    `driver_monitor` (torchrun ranks > 0, which have no pipe from the driver), it also ends the process
    when the driver's connection closes and no Shutdown follows: the driver died (`driver_gone` is set
    as soon as the connection closes)."""
    assert addresses.heartbeat is not None
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, 4)  # old heartbeats are worthless: never queue many
    push.setsockopt(zmq.MAXMSGSIZE, 64)  # it receives nothing
    secure_client(push, addresses.heartbeat, addresses.key)
    push.connect(addresses.heartbeat)
    signer = Signer(addresses.key, HEARTBEATS, rank)
    try:
        while True:
            with contextlib.suppress(zmq.Again):
                push.send(signer.seal(b""), zmq.NOBLOCK)
            if driver_monitor is not None and driver_monitor.poll(0):
                if driver_gone is not None:
                    driver_gone.set()
                if not stop.wait(_DRIVER_GONE_GRACE_S):
                    print(f"tp-runtime worker rank {rank}: the driver's connection closed; exiting",
                          file=sys.stderr, flush=True)  # fmt: skip
                    os._exit(1)
                return
            if stop.wait(HEARTBEAT_INTERVAL_S):
                return
    finally:
        push.close(linger=0)


def _connect(
    ctx: zmq.Context[zmq.Socket[bytes]], addresses: WorkerAddresses
) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """The worker's SUB socket (the driver's broadcast) and PUSH socket (its replies)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.MAXMSGSIZE, addresses.max_broadcast_bytes)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    secure_client(sub, addresses.broadcast, addresses.key)
    sub.connect(addresses.broadcast)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.setsockopt(zmq.MAXMSGSIZE, 64)  # it receives nothing
    secure_client(push, addresses.results, addresses.key)
    push.connect(addresses.results)
    return sub, push


# Characters of a reply's error text kept (its start and end): the driver's socket drops a frame past its
# zmq.MAXMSGSIZE (ipc.message_limits leaves 1 MiB beside the largest output), and an error dropped so left
# the driver waiting for the step until step_timeout_s.
MAX_ERROR_CHARS = 1 << 16


def _bounded(text: str | None) -> str | None:
    if text is None or len(text) <= MAX_ERROR_CHARS:
        return text
    keep = MAX_ERROR_CHARS // 2
    return f"{text[:keep]}\n[... {len(text) - 2 * keep} characters left out ...]\n{text[-keep:]}"


class _Replies:
    """A rank's signed replies to the driver. With async scheduling, rank 0 holds back the answer of a step
    whose ids are not on the host yet until the next message arrives (see the module doc)."""

    def __init__(self, push: zmq.Socket[bytes], writer: FrameWriter, rank: int, hold_back: bool) -> None:
        self._push = push
        self._writer = writer
        self._rank = rank
        self._hold_back = hold_back
        self._held: PendingOutput | None = None  # a queued step not yet answered

    def send(self, call_id: int, kind: ReplyKind, **fields: Any) -> None:
        for key in ("error", "config_error"):
            if key in fields:
                fields[key] = _bounded(fields[key])
        reply = WorkerReply(rank=self._rank, call_id=call_id, kind=kind, **fields)
        self._push.send(self._writer.encode(reply))

    def step(self, launched: PendingOutput) -> None:
        """Rank 0 after queueing a step: answer the held one, then this one, or hold this one while its
        ids are still on their way to the host."""
        self.answer_held()
        if self._hold_back and not launched.ready():
            self._held = launched
        else:
            self._answer(launched)

    def answer_held(self) -> None:
        """Answer the held step; a failure is that step's error and does not stop the current message."""
        if self._held is None:
            return
        previous, self._held = self._held, None
        try:
            self._answer(previous)
        except Exception:
            self.send(previous.step_id, "error", error=traceback.format_exc())

    def _answer(self, pending: PendingOutput) -> None:
        self.send(pending.step_id, "output", output=pending.resolve())


def _serve(
    worker: Worker,
    rank: int,
    sub: zmq.Socket[bytes],
    reader: FrameReader,
    replies: _Replies,
    spin_s: float,
    exit_on_error: bool = False,
    driver_gone: threading.Event | None = None,
) -> None:
    """Execute the driver's messages until Shutdown. Frames that fail authentication are dropped (and logged,
    rate-limited); an error, an authentic frame that is not a valid message included, is reported to the
    driver, and the worker keeps serving; with `exit_on_error` (a torchrun rank > 0, whose driver may be
    blocked in a collective with it and cannot read the report) the process prints it and exits, which
    the driver's watchdog sees. An error while `driver_gone` is set, or soon after it (a collective broken
    by the driver's death), is that death's: one line, not the collective's traceback."""
    greeted = False
    while True:
        data = recv_spinning(sub, spin_s, -1)
        assert data is not None  # a blocking wait only returns with a message
        call_id = -1
        try:
            opened = reader.read(data)
            if opened is None:
                continue  # not from this engine's driver (or a replay): dropped and logged
            sender, message = opened
            if sender != DRIVER_ID:
                raise ProtocolError(f"an authentic broadcast frame from sender {sender}, not the driver")
            if isinstance(message, ExecuteModel):
                call_id = message.scheduler_output.step_id
                worker.check_step(message.scheduler_output)
                launched = worker.execute_model(message.scheduler_output)
                if rank == 0:
                    # A step waiting for its grammar mask: the previous step's answer (whose tokens the
                    # driver needs to make that mask) goes now.
                    if launched is None:
                        replies.answer_held()
                    else:
                        replies.step(launched)
                continue
            if isinstance(message, GrammarMask):
                call_id = message.step_id
                launched = worker.apply_grammar_mask(message)
                if rank == 0:
                    replies.step(launched)
                continue
            replies.answer_held()  # anything else first answers the held step
            if isinstance(message, Shutdown):
                return
            if isinstance(message, Hello):
                if not greeted:  # later copies were queued while this rank loaded its model
                    replies.send(-1, "ready", result=os.getpid())
                    greeted = True
                continue
            if isinstance(message, ControlCall):
                call_id = message.call_id
                result = worker.call(message.method, message.args)
                if message.all_ranks or rank == 0:
                    replies.send(call_id, "result", result=result)
            elif not isinstance(message, Flush):
                raise ProtocolError(f"unexpected driver message {type(message).__name__}")
        except Exception as exc:
            report = traceback.format_exc()
            # (asked before this rank's report goes: a driver that reads it may exit at once)
            if exit_on_error and driver_gone is not None and driver_gone.wait(_DRIVER_GONE_GRACE_S / 2):
                print(f"tp-runtime worker rank {rank}: the driver (rank 0) is gone; exiting",
                      file=sys.stderr, flush=True)  # fmt: skip
                os._exit(1)
            if isinstance(exc, ConfigError):  # the user's to fix (no room for the KV cache): no traceback
                replies.send(call_id, "error", error=str(exc), config_error=str(exc))
            else:
                replies.send(call_id, "error", error=report)
            if exit_on_error:
                print(f"tp-runtime: error: rank {rank} failed:\n{report}", file=sys.stderr, flush=True)
                time.sleep(0.5)  # let the report leave (a driver that is not blocked reads it)
                os._exit(1)  # no clean-up: this rank's queued collectives may never complete


def run_worker_loop(
    config: EngineConfig,
    rank: int,
    local_rank: int,
    addresses: WorkerAddresses,
    init_method: str | None,
    parent_conn: Any | None = None,
    worker: Worker | None = None,
    exit_if_driver_leaves: bool = False,
) -> None:
    """Main loop of a worker process. `worker` is given when the caller already initialised it (torchrun);
    `exit_if_driver_leaves` (torchrun ranks > 0) also ends the process on an error (see _serve)."""
    if parent_conn is not None:
        threading.Thread(target=_exit_when_parent_dies, args=(parent_conn, addresses), daemon=True).start()
    if worker is None and init_method is not None:
        _bind_collectives_to_loopback()
    ctx = zmq.Context()
    sub, push = _connect(ctx, addresses)
    reader = FrameReader(driver_message_codec(), addresses.key, BROADCAST, f"rank {rank}'s broadcast socket")
    writer = FrameWriter(worker_reply_codec(), addresses.key, REPLIES, rank)
    replies = _Replies(push, writer, rank, hold_back=config.async_scheduling)
    try:
        if worker is None:
            worker = Worker(config, rank, local_rank)
            worker.init_device(init_method)
            worker.load_model()
    except ConfigError as exc:
        # The user's to fix, and the same on every rank: the driver raises it as a ConfigError, and this
        # process ends without a traceback.
        replies.send(-1, "error", error=str(exc), config_error=str(exc))
        raise SystemExit(1) from None
    except Exception:
        replies.send(-1, "error", error=traceback.format_exc())
        raise

    stop_heartbeats = threading.Event()
    heartbeats = None
    monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED) if exit_if_driver_leaves else None
    driver_gone = threading.Event() if monitor is not None and addresses.heartbeat is not None else None
    if addresses.heartbeat is not None:
        heartbeats = threading.Thread(
            target=_send_heartbeats, args=(ctx, addresses, rank, stop_heartbeats, monitor, driver_gone),
            name=f"tp-runtime-heartbeat-{rank}", daemon=True,
        )  # fmt: skip
        heartbeats.start()

    spin_s = config.parallel.spin_wait_s
    _serve(worker, rank, sub, reader, replies, spin_s, exit_if_driver_leaves, driver_gone)
    stop_heartbeats.set()  # before anything slow: a torchrun rank must not take the driver's exit for a death
    if heartbeats is not None:
        heartbeats.join()
    if monitor is not None:
        sub.disable_monitor()
        monitor.close(linger=0)
    worker.shutdown()
    push.close()
    sub.close()
    ctx.term()
