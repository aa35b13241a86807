"""`tp-runtime bench messaging`: the cost of the driver <-> worker messages, without a model.

1. Encode+decode time and size of a ModelRunnerOutput's sampled ids for N requests: msgspec list[int]
   (what the runtime sends), a pickled torch tensor, and numpy bytes.
2. Per-step round trip through the real sockets, codecs and authenticated frames (HMAC-SHA256 and
   sequence checks on both sides, worker heartbeats running): the driver broadcasts a SchedulerOutput to
   TP worker processes running the real worker loop with a stub model; rank 0 replies with a
   ModelRunnerOutput of the same size. Shapes: empty step, decode steps of 64 and 256 requests, and a
   prefill of 8 x 1000-token prompts (the workloads of the reference figures in BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import secrets
import shutil
import time
from typing import Any

import numpy as np

from tp_runtime.bench import write_json
from tp_runtime.errors import ConfigError
from tp_runtime.messages import (
    CachedRequests,
    ExecuteModel,
    ModelRunnerOutput,
    NewRequest,
    RequestSampling,
    SchedulerOutput,
)


class _StubPending:
    """A step whose output is already on the host (what a CPU worker returns)."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output
        self.step_id = output.step_id

    def ready(self) -> bool:
        return True

    def resolve(self) -> ModelRunnerOutput:
        return self.output


class _StubWorker:
    """Stands in for Worker in the real worker loop: answers each step with one token per request."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def check_step(self, so: SchedulerOutput) -> None:
        pass  # the steps here are made up, and this benchmark times the transport, not the rank's checks

    def execute_model(self, so: SchedulerOutput) -> _StubPending:
        ids = so.scheduled_req_ids
        output = ModelRunnerOutput(step_id=so.step_id, req_ids=ids, sampled_token_ids=[7] * len(ids))
        return _StubPending(output)

    def call(self, method: str, args: list[Any]) -> Any:
        return None

    def shutdown(self) -> None:
        pass


def _stub_worker_main(rank: int, addresses: Any, parent_conn: Any, spin_wait_s: float) -> None:
    from tp_runtime.config import ParallelConfig
    from tp_runtime.worker.worker import run_worker_loop

    run_worker_loop(
        _StubConfig(ParallelConfig(spin_wait_s=spin_wait_s)),  # type: ignore[arg-type]
        rank, rank, addresses, None, parent_conn, worker=_StubWorker(rank),  # type: ignore[arg-type]
    )  # fmt: skip


class _StubConfig:
    """The only part of EngineConfig the worker loop reads when handed a ready worker."""

    def __init__(self, parallel: Any) -> None:
        self.parallel = parallel
        self.async_scheduling = False  # one round trip per step: what this benchmark measures


def decode_step(num_reqs: int, step_id: int) -> SchedulerOutput:
    ids = list(range(num_reqs))
    # Every 16th request crosses a block boundary and gets one new block, as in steady decoding.
    blocks = [[1000 + i] if i % 16 == step_id % 16 else [] for i in ids]
    return SchedulerOutput(
        step_id=step_id,
        new_requests=[],
        cached_requests=CachedRequests(req_ids=ids, new_block_ids=blocks),
        scheduled_req_ids=ids,
        num_scheduled_tokens=[1] * num_reqs,
        freed_req_ids=[],
    )


def prefill_step(num_reqs: int, prompt_len: int, step_id: int) -> SchedulerOutput:
    sampling = RequestSampling(1.0, 1.0, 0, 0.0, None, 0, [], -1)
    rng = np.random.default_rng(0)
    new = [
        NewRequest(
            req_id=i,
            token_ids=rng.integers(0, 128000, size=prompt_len).tolist(),
            num_output_tokens=0,
            sampling=sampling,
            block_ids=list(range(i * 64, i * 64 + -(-prompt_len // 16))),
        )
        for i in range(num_reqs)
    ]
    return SchedulerOutput(
        step_id=step_id,
        new_requests=new,
        cached_requests=CachedRequests(req_ids=[], new_block_ids=[]),
        scheduled_req_ids=list(range(num_reqs)),
        num_scheduled_tokens=[prompt_len] * num_reqs,
        freed_req_ids=[],
    )


def _time_per_call(fn: Any, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def payload_formats(num_reqs: int, repeats: int) -> dict[str, dict[str, float]]:
    import msgspec
    import torch

    from tp_runtime.serialize import Codec

    tokens = np.random.default_rng(0).integers(0, 128000, size=num_reqs)
    out_list = ModelRunnerOutput(step_id=1, req_ids=list(range(num_reqs)), sampled_token_ids=tokens.tolist())
    codec: Codec[ModelRunnerOutput] = Codec(ModelRunnerOutput, "ModelRunnerOutput")
    tensor = torch.from_numpy(tokens)
    array = tokens.astype(np.int64)
    encoder = msgspec.msgpack.Encoder()
    results = {}
    data = codec.encode(out_list)
    results["msgspec list[int] (ModelRunnerOutput)"] = {
        "bytes": len(data),
        "encode_decode_us": 1e6 * _time_per_call(lambda: codec.decode(codec.encode(out_list)), repeats),
    }
    pickled = pickle.dumps(tensor)
    results["pickled torch tensor"] = {
        "bytes": len(pickled),
        "encode_decode_us": 1e6 * _time_per_call(lambda: pickle.loads(pickle.dumps(tensor)), repeats),
    }
    raw = encoder.encode(array.tobytes())
    results["numpy int64 bytes in msgpack"] = {
        "bytes": len(raw),
        "encode_decode_us": 1e6
        * _time_per_call(
            lambda: np.frombuffer(msgspec.msgpack.decode(encoder.encode(array.tobytes())), dtype=np.int64),
            repeats,
        ),
    }
    return results


def round_trips(tp: int, steps: int, spin_wait_s: float) -> dict[str, float]:
    from tp_runtime.executor.remote import RemoteWorkers
    from tp_runtime.ipc import ipc_channel
    from tp_runtime.worker.worker import WorkerAddresses

    max_bytes = 64 << 20  # far above the largest message here (the prefill step, ~45 KB)
    ipc_dir, channel = ipc_channel(secrets.token_bytes(32), max_bytes, prefix="tp-runtime-bench-")
    ctx = mp.get_context("spawn")
    procs, pipes = [], []
    addresses = WorkerAddresses(
        channel.broadcast_addr, channel.results_addr, channel.key, channel.watchdog.address, max_bytes
    )
    for rank in range(tp):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_stub_worker_main, args=(rank, addresses, reader, spin_wait_s), daemon=True)
        proc.start()
        reader.close()
        procs.append(proc)
        pipes.append(writer)
    remote = RemoteWorkers(channel, list(range(tp)), spin_wait_s)
    results = {}
    try:
        remote.wait_ready(timeout_s=120)
        shapes = {
            "empty step": lambda i: decode_step(0, i),
            "decode, 64 requests": lambda i: decode_step(64, i),
            "decode, 256 requests": lambda i: decode_step(256, i),
            "prefill, 8 x 1000 tokens": lambda i: prefill_step(8, 1000, i),
        }
        step_id = 0
        for name, make in shapes.items():
            messages = [make(step_id + i + 1) for i in range(steps + 10)]
            timings = []
            for so in messages:
                start = time.perf_counter()
                remote.broadcast(ExecuteModel(so))
                remote.submitted(so.step_id)
                remote.wait_output(so.step_id, 60.0)
                timings.append(time.perf_counter() - start)
            step_id += len(messages)
            results[name] = 1e6 * float(np.median(timings[10:]))
    finally:
        for w in pipes:
            w.close()  # workers exit on EOF
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        channel.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=2, help="stub worker processes")
    parser.add_argument("--num-requests", type=int, default=256, help="requests in the payload comparison")
    parser.add_argument("--steps", type=int, default=500, help="round trips timed per step shape")
    parser.add_argument("--spin-wait-us", type=float, default=0.0, help="busy-poll before blocking (us)")
    parser.add_argument(
        "--output-json", default=None, help="also write every figure to this JSON file (default: no file)"
    )


_MAX_TP = 64  # one process per rank on this host


def check(args: argparse.Namespace) -> None:
    """Range checks of the flags; raises ConfigError naming the flag (the CLI prints it as one line)."""
    checks = [
        ("-tp/--tensor-parallel-size", args.tensor_parallel_size, 1 <= args.tensor_parallel_size <= _MAX_TP,
         f"an int in [1, {_MAX_TP}]"),
        ("--num-requests", args.num_requests, args.num_requests >= 1, "at least 1"),
        ("--steps", args.steps, args.steps >= 1, "at least 1"),
        ("--spin-wait-us", args.spin_wait_us, 0 <= args.spin_wait_us <= 1e6, "in [0, 1000000]"),
    ]  # fmt: skip
    for flag, value, ok, want in checks:
        if not ok:
            raise ConfigError(f"argument {flag}: must be {want}, got {value:g}")


def main(args: argparse.Namespace) -> None:
    check(args)
    formats = payload_formats(args.num_requests, repeats=2000)
    print(f"ModelRunnerOutput sampled ids for {args.num_requests} requests: encode+decode, bytes")
    for name, r in formats.items():
        print(f"  {name:<40}{r['encode_decode_us']:8.1f} us {int(r['bytes']):8d} B")
    trips = round_trips(args.tensor_parallel_size, args.steps, args.spin_wait_us * 1e-6)
    print(
        f"\nBroadcast + rank-0 reply round trip, TP={args.tensor_parallel_size}, "
        f"median of {args.steps} steps:"
    )
    for name, us in trips.items():
        print(f"  {name:<40}{us:8.1f} us")
    if args.output_json:
        settings = {k: v for k, v in vars(args).items() if not callable(v)}  # not func, check
        write_json(args.output_json, {"payload_formats": formats, "round_trip_us": trips, "args": settings})
