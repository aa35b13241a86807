"""Check and time the all-reduce strategies on GPUs: symmetric memory (one-shot, two-shot, the strategy's
own size dispatch) against NCCL, eager and captured in CUDA graphs.

Run one process per GPU (NVLink multicast stays off: init_process_group forces the variables):

    PYTHONPATH=$PWD python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        scripts/check_all_reduce.py --out all_reduce.json

For every dtype (bf16, fp32), hidden size (4096, 8192) and row count (1 .. 256), plus one prefill-sized
message per dtype, each method's sum is compared with NCCL's (and with a float64 sum of every rank's
input, which each rank regenerates from the seeds): eager, and replayed from a CUDA graph captured on a
static input. With 2 ranks a + b is commutative, so the sums should be bit-equal. Then each method is
timed: eager (back-to-back calls, CUDA events) and graph (--graph-calls all-reduces captured in one
graph, replayed --replays times), in microseconds per all-reduce. Rank 0 prints a table and writes JSON
to --out. Exit status 1 if any sum differs beyond one unit in the last place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tp_runtime.distributed import (
    NCCL,
    ONE_SHOT,
    ONE_SHOT_MAX_BYTES,
    TWO_SHOT,
    TWO_SHOT_MAX_BYTES,
    DistAllReduce,
    SymmMemAllReduce,
    disable_nvlink_multicast,
    init_process_group,
)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
Fn = Callable[[torch.Tensor], torch.Tensor]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="all_reduce.json", help="JSON results (written by rank 0)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--hidden", nargs="+", type=int, default=[4096, 8192])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--prefill-tokens", type=int, default=4096, help="rows of the large message (hidden 4096)")
    p.add_argument("--max-rows", type=int, default=256, help="decode rows the symmetric buffer is sized for")
    p.add_argument(
        "--strategy",
        default="auto",
        choices=["auto", "symm_mem", "nccl"],
        help="symm_mem: fail if unavailable (with 1 GPU: a smoke test of the kernels)",
    )
    p.add_argument("--eager-iters", type=int, default=200)
    p.add_argument("--graph-calls", type=int, default=64, help="all-reduces captured in one graph")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3, help="timings per method (median reported)")
    p.add_argument("--no-timing", action="store_true", help="correctness only")
    return p.parse_args()


def barrier(device: torch.device) -> None:
    torch.cuda.synchronize(device)
    dist.barrier()
    torch.cuda.synchronize(device)


def rank_input(shape: tuple[int, ...], dtype: torch.dtype, rank: int, seed: int) -> torch.Tensor:
    """Rank `rank`'s input for case `seed`, on the CPU (any rank can rebuild any other rank's)."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, Any]:
    diff = (got.float() - want.float()).abs()
    eps = torch.finfo(want.dtype).eps
    ok = bool((diff <= eps * want.float().abs()).all())  # at most one unit in the last place
    return {"bit_equal": bool(torch.equal(got, want)), "max_abs_diff": float(diff.max()), "ok": ok}


def in_graph(fn: Fn, static: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(static.clone())  # warm-up (lazy init) on a side stream, as the decode graphs do
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static)
    return graph, out


def time_eager(fn: Fn, x: torch.Tensor, iters: int, device: torch.device) -> float:
    for _ in range(5):
        fn(x)
    barrier(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def time_graph(fn: Fn, x: torch.Tensor, calls: int, replays: int, device: torch.device) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(x)
    graph.replay()
    barrier(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    us = start.elapsed_time(end) * 1000.0 / (replays * calls)
    del graph
    return us


def main() -> int:
    args = parse_args()
    disable_nvlink_multicast()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    max_bytes = args.max_rows * max(args.hidden) * max(DTYPES[d].itemsize for d in args.dtypes)
    tp = init_process_group(
        "nccl", "env://", rank, world, 600.0, device,
        all_reduce_strategy=args.strategy, max_message_bytes=max_bytes,
    )  # fmt: skip
    strategy = tp.strategy
    if world == 1 and args.strategy == "symm_mem":
        # One GPU: build the symmetric-memory strategy anyway, to smoke-test the kernels, the dispatch
        # and graph capture (every sum is x itself; the timings say nothing about NVLink).
        strategy = SymmMemAllReduce.create(device, max_bytes)
    nccl = DistAllReduce()
    symm = strategy if isinstance(strategy, SymmMemAllReduce) else None
    methods: dict[str, Fn] = {NCCL: nccl, "auto": strategy}
    if symm is not None:
        if symm.ops.has_one_shot:
            methods[ONE_SHOT] = lambda x: symm.run_method(ONE_SHOT, x)
            if symm.ops.one_shot_copy_out is not None and symm.ops.one_shot_out is not None:
                # The same buffer with copy_ + one_shot_all_reduce_out instead of the fused copy kernel.
                unfused = SymmMemAllReduce(
                    symm.buffer, symm.group_name, world, nccl,
                    dataclasses.replace(symm.ops, one_shot_copy_out=None), handle=symm,
                )  # fmt: skip
                methods["one_shot_unfused"] = lambda x: unfused.run_method(ONE_SHOT, x)
        if symm.ops.has_two_shot:
            methods[TWO_SHOT] = lambda x: symm.run_method(TWO_SHOT, x)
    if rank == 0:
        print(f"torch {torch.__version__}, {world} x {torch.cuda.get_device_name(device)}", flush=True)
        print(f"strategy: {strategy.describe()}", flush=True)
        if symm is not None:
            found = {f.name: getattr(symm.ops, f.name) is not None for f in dataclasses.fields(symm.ops)}
            print(f"torch.ops.symm_mem found: {found}", flush=True)

    cases = [(d, r, h) for d in args.dtypes for h in args.hidden for r in args.rows]
    cases += [(d, args.prefill_tokens, 4096) for d in args.dtypes]
    results: list[dict[str, Any]] = []
    all_ok = True
    for seed, (dname, rows, hidden) in enumerate(cases):
        dtype = DTYPES[dname]
        shape = (rows, hidden)
        nbytes = rows * hidden * dtype.itemsize
        inputs = [rank_input(shape, dtype, r, seed) for r in range(world)]
        exact = torch.stack([t.double() for t in inputs]).sum(0).to(dtype).to(device)
        x = inputs[rank].to(device)
        ref = nccl(x.clone())
        row: dict[str, Any] = {
            "dtype": dname, "rows": rows, "hidden": hidden, "bytes": nbytes,
            "auto_method": symm.method_for(x) if symm is not None else strategy.name,
            "nccl_vs_float64_sum": compare(ref, exact), "check": {}, "eager_us": {}, "graph_us": {},
        }  # fmt: skip
        for name, fn in methods.items():
            fits = symm is None or name in (NCCL, "auto") or nbytes <= symm.capacity_bytes
            if not fits:
                continue
            eager = compare(fn(x.clone()), ref)
            static = torch.zeros_like(x)
            graph, out = in_graph(fn, static)
            static.copy_(x)
            graph.replay()
            captured = compare(out.clone(), ref)
            del graph
            row["check"][name] = {"eager": eager, "graph": captured}
            all_ok &= eager["ok"] and captured["ok"]
        if not args.no_timing:
            for name, fn in methods.items():
                if name not in row["check"]:
                    continue
                z = torch.zeros_like(x)  # stays zero however often it is summed
                calls = args.graph_calls if nbytes <= (1 << 22) else max(4, args.graph_calls // 8)
                eager_t = [time_eager(fn, z, args.eager_iters, device) for _ in range(args.repeats)]
                graph_t = [time_graph(fn, z, calls, args.replays, device) for _ in range(args.repeats)]
                row["eager_us"][name] = round(statistics.median(eager_t), 2)
                row["graph_us"][name] = round(statistics.median(graph_t), 2)
        results.append(row)
        if rank == 0:
            print_row(row, list(methods))

    if symm is not None and symm.fuses_add_rms_norm:
        norm_rows = check_add_rms_norm(symm, args, device, rank)
        all_ok &= all(r["ok"] for r in norm_rows)
        results.extend(norm_rows)

    # Every rank's verdict: a failure anywhere fails the run.
    ok_t = torch.tensor([1 if all_ok else 0], device=device)
    dist.all_reduce(ok_t, op=dist.ReduceOp.MIN)
    all_ok = bool(ok_t.item())
    if rank == 0 and not args.no_timing:
        for key, value in suggest_thresholds(results).items():
            print(f"suggested {key}: {value}", flush=True)
    if rank == 0:
        report = {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device),
            "world_size": world,
            "strategy": strategy.describe(),
            "one_shot_max_bytes": ONE_SHOT_MAX_BYTES,
            "two_shot_max_bytes": TWO_SHOT_MAX_BYTES,
            "graph_calls": args.graph_calls,
            "replays": args.replays,
            "all_ok": all_ok,
            "suggested": suggest_thresholds(results) if not args.no_timing else {},
            "results": results,
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"{'PASS' if all_ok else 'FAIL'}: sums vs NCCL; results in {args.out}", flush=True)
    strategy.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all_ok else 1


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def check_add_rms_norm(
    symm: SymmMemAllReduce, args: argparse.Namespace, device: torch.device, rank: int
) -> list[dict[str, Any]]:
    """The fused all-reduce + residual add + RMSNorm against the all-reduce followed by the add + RMSNorm
    kernel (what the model runs without the fusion): outputs and residuals bit-equal at 2 ranks (beyond,
    torch's kernels may round a bf16 sum after each addition, the fused one once), eager and from a
    graph; then both timed in a graph (microseconds per call)."""
    from tp_runtime.layers.fused_triton import rms_norm

    eps = 1e-5

    def fused(residual: torch.Tensor, weight: torch.Tensor) -> Fn:
        def fn(t: torch.Tensor) -> torch.Tensor:
            out = symm.add_rms_norm(t, residual, weight, eps)
            assert out is not None, "the fused path declined a message it took before"
            return out

        return fn

    def unfused(residual: torch.Tensor, weight: torch.Tensor) -> Fn:
        return lambda t: rms_norm(symm(t), weight, eps, residual)

    rows_out: list[dict[str, Any]] = []
    cases = [(d, r, h) for d in args.dtypes for h in args.hidden for r in args.rows]
    for seed, (dname, rows, hidden) in enumerate(cases):
        dtype = DTYPES[dname]
        symm.prepare_fused_norm(dtype)  # collective: every region emptied for this case's rows
        x = rank_input((rows, hidden), dtype, rank, 10_000 + seed).to(device)
        residual = rank_input((rows, hidden), dtype, 999, 10_000 + seed).to(device)  # same on every rank
        weight = rank_input((hidden,), dtype, 998, 10_000 + seed).to(device)
        res_unfused = residual.clone()
        want = unfused(res_unfused, weight)(x.clone())
        res_fused = residual.clone()
        if symm.add_rms_norm(x.clone(), res_fused.clone(), weight, eps) is None:
            continue  # too large for the fused path
        got = fused(res_fused, weight)(x.clone())
        exact = symm.world_size == 2 or dtype == torch.float32
        same = torch.equal if exact else _close
        ok = same(got, want) and same(res_fused, res_unfused)
        static_x, static_res = torch.zeros_like(x), residual.clone()
        graph, out = in_graph(fused(static_res, weight), static_x)
        static_x.copy_(x)
        static_res.copy_(residual)
        graph.replay()
        ok &= same(out, want) and same(static_res, res_unfused)
        del graph
        row: dict[str, Any] = {"case": "all_reduce_add_rms_norm", "dtype": dname, "rows": rows,
                               "hidden": hidden, "ok": bool(ok), "graph_us": {}}  # fmt: skip
        if not args.no_timing:
            z, r = torch.zeros_like(x), residual.clone()  # adding zero leaves the residual as it is
            for name, fn in (("unfused", unfused(r, weight)), ("fused", fused(r, weight))):
                calls, replays = args.graph_calls, args.replays
                times = [time_graph(fn, z, calls, replays, device) for _ in range(args.repeats)]
                row["graph_us"][name] = round(statistics.median(times), 2)
        rows_out.append(row)
        if rank == 0:
            g = row["graph_us"]
            timing = f"graph us: unfused {g['unfused']:.1f}, fused {g['fused']:.1f}" if g else ""
            verdict = "equal" if ok else "DIFFERENT"
            print(f"add_rms_norm {dname} {rows}x{hidden}: {verdict}  {timing}", flush=True)
    return rows_out


def suggest_thresholds(results: list[dict[str, Any]]) -> dict[str, int | None]:
    """From the graph timings: the largest size up to which one-shot beats two-shot at every size, and
    up to which the symmetric-memory path (the faster of the two) beats NCCL (None: not measured)."""

    def last_win(fast: Callable[[dict[str, float]], float | None], slow: str) -> int | None:
        best: int | None = None
        for row in sorted((r for r in results if "bytes" in r), key=lambda r: r["bytes"]):
            g = row["graph_us"]
            f = fast(g)
            if f is None or slow not in g:
                continue
            if f > g[slow]:
                break
            best = row["bytes"]
        return best

    def symm(g: dict[str, float]) -> float | None:
        times = [g[m] for m in (ONE_SHOT, TWO_SHOT) if m in g]
        return min(times) if times else None

    return {
        "one_shot_max_bytes": last_win(lambda g: g.get(ONE_SHOT), TWO_SHOT),
        "two_shot_max_bytes": last_win(symm, NCCL),
    }


_header_done = False


def print_row(row: dict[str, Any], names: list[str]) -> None:
    """One line per case: worst difference to NCCL, whether every sum was bit-equal, then each method's
    eager | graph microseconds per all-reduce."""
    global _header_done
    if not _header_done:
        cols = " ".join(f"{n[:16]:>16}" for n in names)
        head = f"{'case':<16} {'KiB':>7} {'auto->':>9} {'max diff':>9} {'bit':>3}"
        print(f"{head}  {'us eager|graph:':>15}{cols}", flush=True)
        _header_done = True
    checks = row["check"]
    worst = max((c[k]["max_abs_diff"] for c in checks.values() for k in ("eager", "graph")), default=0.0)
    bit = all(c[k]["bit_equal"] for c in checks.values() for k in ("eager", "graph"))
    cells = []
    for n in names:
        e, g = row["eager_us"].get(n), row["graph_us"].get(n)
        cells.append("-".rjust(16) if e is None else f"{e:.1f}|{g:.1f}".rjust(16))
    case = f"{row['dtype']} {row['rows']}x{row['hidden']}"
    kib = row["bytes"] / 1024
    line = f"{case:<16} {kib:>7.0f} {row['auto_method']:>9} {worst:>9.2g} {'y' if bit else 'N':>3}"
    print(f"{line}  {'':>15}{' '.join(cells)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
