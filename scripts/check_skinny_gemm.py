"""Check and time the decode-step Triton matmuls (tp_runtime/layers/skinny_gemm_triton.py: one row, and 2-32
rows) against cuBLAS on one GPU, for the linear layers of a built-in model's shard at a TP size.

    PYTHONPATH=$PWD python scripts/check_skinny_gemm.py --model llama-3-8b --tp-sizes 1 2

For every layer shape (fused QKV, output projection, merged gate/up, down projection with and without
the SiLU-mul folded in, LM head) and row count, each launch shape of --configs (a sweep, or the one the
engine picks: `default`) is checked against a float64 matmul and timed as --calls matmuls in one CUDA
graph, each on its own copy of the weight (so nothing is served from L2), replayed --replays times.
cuBLAS (F.linear; for the folded down projection the SiLU-mul kernel then F.linear) is timed the same
way. Prints µs per call, the weight bandwidth, and the best launch shape; exit status 1 if any result is
off by more than a few units of the dtype's last place.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tp_runtime.layers.fused_triton import silu_and_mul
from tp_runtime.layers.skinny_gemm_triton import (
    SkinnyConfig,
    default_config,
    few_rows_config,
    few_rows_linear,
    skinny_linear,
)
from tp_runtime.presets import preset_hf_config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def layer_shapes(model: str, tp: int) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of this rank's weight."""
    c = preset_hf_config(model)
    head_dim = c.hidden_size // c.num_attention_heads
    q = c.num_attention_heads // tp * head_dim
    kv = max(c.num_key_value_heads // tp, 1) * head_dim
    inter = c.intermediate_size // tp
    return {
        "qkv": (q + 2 * kv, c.hidden_size),
        "o_proj": (c.hidden_size, q),
        "gate_up": (2 * inter, c.hidden_size),
        "down": (c.hidden_size, inter),
        "down+silu": (c.hidden_size, inter),
        "lm_head": (c.vocab_size // tp, c.hidden_size),
    }


SWEEP = [
    SkinnyConfig(bn, bk, warps, stages)
    for bn, bk, warps, stages in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (1, 2))
]


DOT_SWEEP = [
    SkinnyConfig(bn, bk, warps, stages)
    for bn, bk, warps, stages in itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 4))
]


def cublas_call(x: torch.Tensor, w: torch.Tensor, silu: bool) -> Callable[[], object]:
    if silu:
        return lambda: F.linear(silu_and_mul(x), w)
    return lambda: F.linear(x, w)


def triton_call(x: torch.Tensor, w: torch.Tensor, silu: bool, cfg: SkinnyConfig) -> Callable[[], object]:
    if x.shape[0] > 1:
        if silu:
            return lambda: few_rows_linear(silu_and_mul(x), w, None, cfg)
        return lambda: few_rows_linear(x, w, None, cfg)
    return lambda: skinny_linear(x, w, silu_mul=silu, config=cfg)


def time_graph(calls: list[Callable[[], object]], replays: int) -> float:
    """µs per call of `calls` captured in order in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1000 / (replays * len(calls))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["llama-3-8b"])
    p.add_argument("--tp-sizes", nargs="+", type=int, default=[1, 2])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 32])
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--layers", nargs="+", default=None, help="only these layer names")
    p.add_argument("--configs", default="sweep", choices=["sweep", "default"])
    p.add_argument("--calls", type=int, default=24)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args()
    dtype = DTYPES[args.dtype]
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    torch.manual_seed(0)
    results, failed = [], False
    for model, tp in itertools.product(args.model, args.tp_sizes):
        for name, (n, k) in layer_shapes(model, tp).items():
            if args.layers and name not in args.layers:
                continue
            silu = name == "down+silu"
            copies = max(2, -(-400 * 2**20 // (n * k * dtype.itemsize)))
            copies = min(copies, args.calls)
            weights = [torch.randn(n, k, device=dev, dtype=dtype) / k**0.5 for _ in range(copies)]
            gbytes = n * k * dtype.itemsize / 1e9
            for rows in args.rows:
                x = torch.randn(rows, 2 * k if silu else k, device=dev, dtype=dtype)
                xin = silu_and_mul(x) if silu else x
                ref = (xin.double() @ weights[0].double().T)
                scale = ref.abs().max().item()
                ulp = torch.finfo(dtype).eps
                calls = [cublas_call(x, weights[i % copies], silu) for i in range(args.calls)]
                base = time_graph(calls, args.replays)
                base_err = (F.linear(xin, weights[0]).double() - ref).abs().max().item() / scale
                row = {"model": model, "tp": tp, "layer": name, "n": n, "k": k, "rows": rows,
                       "cublas_us": base, "cublas_err": base_err, "triton": []}  # fmt: skip
                # The launch shape the engine uses (None: it keeps cuBLAS for this shape).
                if rows == 1:
                    dflt = default_config(n, sms)
                else:
                    dflt = few_rows_config(rows, n, k, dtype, sms, lm_head=name == "lm_head")
                if args.configs == "sweep":
                    configs = SWEEP if rows == 1 else DOT_SWEEP
                else:
                    configs = [dflt] if dflt else []
                for cfg in configs:
                    try:
                        got = triton_call(x, weights[0], silu, cfg)()
                        assert isinstance(got, torch.Tensor)
                        err = (got.double() - ref).abs().max().item() / scale
                        calls = [triton_call(x, weights[i % copies], silu, cfg) for i in range(args.calls)]
                        us = time_graph(calls, args.replays)
                    except Exception as exc:  # a launch shape the compiler rejects (shared memory)
                        print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                        continue
                    row["triton"].append({"config": cfg._asdict(), "us": us, "err": err})
                    if err > max(8 * ulp, 4 * base_err):
                        failed = True
                        print(f"  FAIL {model} tp{tp} {name} rows {rows} {cfg}: err {err:.2e}", flush=True)
                best = min(row["triton"], key=lambda r: r["us"]) if row["triton"] else None
                picked = dflt._asdict() if dflt else None
                dflt_us = next((r["us"] for r in row["triton"] if r["config"] == picked), math.nan)
                results.append(row)
                if not best:
                    print(f"{model} tp{tp} {name:9s} {n:6d}x{k:5d} rows {rows:2d}: cublas {base:7.2f} us")
                else:
                    print(
                        f"{model} tp{tp} {name:9s} {n:6d}x{k:5d} rows {rows:2d}: cublas {base:7.2f} us "
                        f"({gbytes / base * 1e6:5.0f} GB/s) | best {best['us']:7.2f} us "
                        f"({gbytes / best['us'] * 1e6:5.0f} GB/s) {tuple(best['config'].values())} | "
                        f"default {dflt_us:7.2f} us",
                        flush=True,
                    )
            del weights
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print("FAILED" if failed else "all results within tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
