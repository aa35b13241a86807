"""Time the FP8 linear layer's CUDA paths (tp_runtime/layers/quantization/fp8.py) against bf16 cuBLAS on one
GPU, for the linear layers of a built-in model's shard, at decode and prefill row counts:

- `bf16`: F.linear on the bf16 weight (what the unquantized model runs);
- `fp8 default`: the engine's choice (CudaFp8Kernels.linear);
- `weight_only`: the weight-only Triton kernels (one row; few rows to 32);
- `quantize`: the per-token activation quantization alone;
- `down+silu` (one row): the down projection with the SiLU-mul inside the weight-only kernel, as the
  engine runs it, against the separate SiLU-mul kernel and the plain kernel;
- `fp8 triton best`: the fastest launch shape of the weight-only kernels in a sweep (1-32 rows);
- `w8a8`: per-token activation quantization (the engine's Triton kernel) + torch._scaled_mm at every row
  count;
- `triton_w8a8`: the same quantization + the Triton FP8 GEMM (fp8_gemm_triton.py), per-row scales;
- `block_*`: 128x128 block-scaled weights: the engine's path (`block_engine`), the Triton GEMM on
  per-128-column activation scales (`block_triton`), the weight-only kernels (to 32 rows) and the old
  dequantize-then-bf16 path (`block_dequant`);
- with `--sweep-gemm`, the fastest launch shape of the Triton GEMM at each row count.

    PYTHONPATH=$PWD python scripts/check_fp8_gemm.py --model llama-3-8b llama-3-70b

Each is timed as in scripts/check_skinny_gemm.py (one CUDA graph of calls, each on its own copy of the
weight, so nothing is served from L2). Prints µs per call and the weight bandwidth.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from tp_runtime.config import FP8_E4M3_MAX
from tp_runtime.layers.quantization.activation_quant_triton import quantize_groups_fp8, quantize_rows_fp8
from tp_runtime.layers.quantization.fp8 import CudaFp8Kernels, dequantize
from tp_runtime.layers.quantization.fp8_gemm_triton import Fp8GemmConfig, fp8_gemm
from tp_runtime.layers.skinny_gemm_triton import (
    SkinnyConfig,
    few_rows_linear,
    fp8_few_rows_config,
    skinny_linear,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_skinny_gemm import DOT_SWEEP, layer_shapes, time_graph


def w8a8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, fast: bool = False) -> torch.Tensor:
    xq, x_scale = quantize_rows_fp8(x)
    return torch._scaled_mm(
        xq, w.t(), scale_a=x_scale, scale_b=scale.reshape(1, -1), out_dtype=x.dtype, use_fast_accum=fast
    )


def gemm_sweep(rows: int, block: bool) -> list[Fp8GemmConfig]:
    """Launch shapes of the Triton FP8 GEMM worth trying at `rows` tokens (a token tile just covering
    them up to 64 rows, 64 or 128 past them; split K and 512-wide K tiles for few tokens, where a layer
    of 4,096 outputs has only 64 weight tiles for 132 SMs)."""
    tiles_m = [max(16, 1 << (rows - 1).bit_length())] if rows <= 64 else [64, 128]
    few = rows <= 64
    return [
        Fp8GemmConfig(block_n, block_m, block_k, warps, stages, split_k=split)
        for block_n in ((64, 128) if few else (32, 64, 128))
        for block_m in tiles_m
        for block_k in ((128,) if block else (128, 256, 512) if few else (128, 256))
        for stages in ((3, 4, 5, 6) if few else (3, 5))
        for warps in ((4, 8) if few else (8 if block_n * block_m >= 16384 else 4,))
        for split in ((1, 2, 4) if few else (1,))
        if (block_n + block_m) * block_k * stages <= 200_000
    ]


# One-row launch shapes for 1-byte weights, in the form the engine's FP8 rule uses (x in the weight tile's
# layout, 16-column partial sums): rows per tile and K tiles of 1-4 KB, 4 or 8 warps (stages change
# nothing: Triton does not pipeline these loads).
FP8_ROW_SWEEP = [
    SkinnyConfig(bn, bk, warps, 1, True, 16)
    for bn, bk, warps in itertools.product((2, 4, 8, 16, 32), (1024, 2048, 4096), (4, 8))
    if 4096 <= bn * bk <= 32768
]


def measure_layer(
    model: str, name: str, n: int, k: int, rows_list: list[int], replays: int, sweep: bool,
    kernels: CudaFp8Kernels, sweep_gemm: bool, prefill_variants: bool = False,
) -> list[dict[str, object]]:  # fmt: skip
    copies = max(2, math.ceil(400e6 / (n * k)))  # > L2 even at one byte per weight
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    scales = [w.abs().amax(dim=1, keepdim=True).float() / FP8_E4M3_MAX for w in w16]
    w8 = [(w / s).to(torch.float8_e4m3fn) for w, s in zip(w16, scales, strict=True)]
    # Block scales: timing does not depend on their values; the per-row scale over every block.
    blocks = [s.expand(n, -(-k // 128)).contiguous() for s in scales]
    out = []
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)

        def timed(fn: Callable[[torch.Tensor, int], object], x: torch.Tensor = x) -> float:
            return time_graph([lambda i=i: fn(x, i) for i in range(copies)], replays)

        row: dict[str, object] = {"model": model, "layer": name, "n": n, "k": k, "rows": rows}
        bf16 = timed(lambda x, i: F.linear(x, w16[i]))
        fp8 = timed(lambda x, i: kernels.linear(x, w8[i], scales[i], k, None, False))
        row.update(bf16_us=bf16, fp8_default_us=fp8, bf16_TBps=2 * n * k / bf16 / 1e6,
                   fp8_default_TBps=n * k / fp8 / 1e6)  # fmt: skip
        if n % 16 == 0 and k % 16 == 0:
            row["w8a8_us"] = timed(lambda x, i: w8a8(x, w8[i], scales[i]))
            if prefill_variants and rows >= 256:
                # The GEMM alone (x quantized beforehand), as the engine calls it (per-row scales) and
                # with cuBLASLt's per-tensor scales, each with and without fast accumulation (no periodic
                # promotion of the FP8 MMA's partial sums to float32).
                xq, x_scale = quantize_rows_fp8(x)
                one = torch.ones((), device="cuda")
                variants = {
                    "gemm_rowwise": (x_scale, [c.reshape(1, -1) for c in scales], False),
                    "gemm_rowwise_fast": (x_scale, [c.reshape(1, -1) for c in scales], True),
                    "gemm_tensor": (one, [one] * copies, False),
                    "gemm_tensor_fast": (one, [one] * copies, True),
                }
                for label, (sa, sb, fast) in variants.items():
                    try:
                        row[f"{label}_us"] = timed(
                            lambda x, i, xq=xq, sa=sa, sb=sb, fast=fast: torch._scaled_mm(
                                xq, w8[i].t(), scale_a=sa, scale_b=sb[i],
                                out_dtype=x.dtype, use_fast_accum=fast,
                            )
                        )  # fmt: skip
                    except RuntimeError as e:  # a combination this torch does not take
                        row[f"{label}_us"] = f"{type(e).__name__}: {str(e)[:120]}"

        def triton_w8a8(x: torch.Tensor, i: int, cfg: Fp8GemmConfig | None = None) -> torch.Tensor:
            xq, xs = quantize_rows_fp8(x)
            return fp8_gemm(
                xq, xs, w8[i], scales[i], k, x.dtype, None, cfg, kernels.num_sms, kernels.split_k_locks
            )

        def block_triton(x: torch.Tensor, i: int, cfg: Fp8GemmConfig | None = None) -> torch.Tensor:
            xq, xs = quantize_groups_fp8(x, 128)
            return fp8_gemm(
                xq, xs, w8[i], blocks[i], 128, x.dtype, None, cfg, kernels.num_sms, kernels.split_k_locks
            )

        row["triton_w8a8_us"] = timed(triton_w8a8)
        row["quantize_us"] = timed(lambda x, i: quantize_rows_fp8(x))
        if rows == 1:
            row["weight_only_us"] = timed(
                lambda x, i: skinny_linear(
                    x, w8[i], None, num_sms=kernels.num_sms, scale=scales[i], scale_block_k=k
                )
            )
            # The few-rows kernel at one row (tensor cores, float16 products, the row padded to 16).
            one_cfg = fp8_few_rows_config(n, 1, kernels.num_sms)
            row["few_rows_us"] = timed(
                lambda x, i, c=one_cfg: few_rows_linear(x, w8[i], None, c, scale=scales[i], scale_block_k=k)
            )
        elif rows <= 32:
            few_cfg = fp8_few_rows_config(n, rows, kernels.num_sms)
            row["weight_only_us"] = timed(
                lambda x, i, c=few_cfg: few_rows_linear(x, w8[i], None, c, scale=scales[i], scale_block_k=k)
            )
        row["block_engine_us"] = timed(lambda x, i: kernels.linear(x, w8[i], blocks[i], 128, None, False))
        row["block_triton_us"] = timed(block_triton)
        row["block_dequant_us"] = timed(lambda x, i: F.linear(x, dequantize(w8[i], blocks[i], 128, x.dtype)))
        if 2 <= rows <= 32:
            few = fp8_few_rows_config(n, rows, kernels.num_sms)
            row["block_weight_only_us"] = timed(
                lambda x, i, c=few: few_rows_linear(x, w8[i], None, c, scale=blocks[i], scale_block_k=128)
            )
        if sweep_gemm:
            paths = (("triton_w8a8", triton_w8a8, False), ("block_triton", block_triton, True))
            for label, fn, block in paths:
                best_gemm: tuple[float, Fp8GemmConfig | None] = (math.inf, None)
                for cfg in gemm_sweep(rows, block):
                    try:
                        us = timed(lambda x, i, c=cfg, f=fn: f(x, i, c))  # type: ignore[misc]
                    except Exception as e:  # a shape this GPU's shared memory cannot hold
                        print(f"# {label} {cfg}: {type(e).__name__}", flush=True)
                        continue
                    best_gemm = min(best_gemm, (us, cfg), key=lambda b: b[0])
                row[f"{label}_best_us"], row[f"{label}_best_config"] = best_gemm[0], list(best_gemm[1] or ())
        if sweep and rows <= 32:
            best: tuple[float, SkinnyConfig | None] = (math.inf, None)
            for cfg in FP8_ROW_SWEEP if rows == 1 else DOT_SWEEP:
                if rows == 1:
                    us = timed(lambda x, i, c=cfg: skinny_linear(x, w8[i], None, config=c, scale=scales[i],
                                                                 scale_block_k=k))  # fmt: skip
                else:
                    us = timed(lambda x, i, c=cfg: few_rows_linear(x, w8[i], None, c, scale=scales[i],
                                                                   scale_block_k=k))  # fmt: skip
                best = min(best, (us, cfg), key=lambda b: b[0])
            row["fp8_triton_best_us"], row["best_config"] = best[0], list(best[1] or ())
        shown = {key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()}
        print(json.dumps(shown), flush=True)
        out.append(row)
    return out


def measure_silu_row(
    model: str, n: int, k: int, replays: int, sweep: bool, kernels: CudaFp8Kernels
) -> dict[str, object]:
    """The down projection at one row as the engine runs it: x is the [1, 2K] gate|up output and the
    SiLU-mul is computed inside the weight-only kernel (`fp8_default_us`), against the separate fused
    SiLU-mul kernel then the plain one-row kernel (`separate_us`); with `sweep`, the best launch shape of
    the kernel with the SiLU-mul inside (each program recomputes it for its K tiles)."""
    from tp_runtime.layers.activation import silu_and_mul

    copies = max(2, math.ceil(400e6 / (n * k)))
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    scales = [w.abs().amax(dim=1, keepdim=True).float() / FP8_E4M3_MAX for w in w16]
    w8 = [(w / s).to(torch.float8_e4m3fn) for w, s in zip(w16, scales, strict=True)]
    del w16
    x = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)

    def timed(fn: Callable[[int], object]) -> float:
        return time_graph([lambda i=i: fn(i) for i in range(copies)], replays)

    row: dict[str, object] = {"model": model, "layer": "down+silu", "n": n, "k": k, "rows": 1}
    row["fp8_default_us"] = timed(lambda i: kernels.linear(x, w8[i], scales[i], k, None, True))
    row["separate_us"] = timed(
        lambda i: skinny_linear(silu_and_mul(x, fused=True), w8[i], None, num_sms=kernels.num_sms,
                                scale=scales[i], scale_block_k=k)
    )  # fmt: skip
    row["silu_only_us"] = timed(lambda i: silu_and_mul(x, fused=True))
    if sweep:
        best: tuple[float, SkinnyConfig | None] = (math.inf, None)
        for cfg in FP8_ROW_SWEEP:
            us = timed(lambda i, c=cfg: skinny_linear(x, w8[i], None, silu_mul=True, config=c,
                                                      scale=scales[i], scale_block_k=k))  # fmt: skip
            best = min(best, (us, cfg), key=lambda b: b[0])
        row["fp8_triton_best_us"], row["best_config"] = best[0], list(best[1] or ())
    print(json.dumps({key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["llama-3-8b"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 32, 64, 512])
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also time every launch shape of the Triton kernels")
    p.add_argument("--sweep-gemm", action="store_true", help="also sweep the Triton FP8 GEMM's launch shapes")
    p.add_argument(
        "--layers", nargs="+", default=None, help="only these layers (qkv o_proj gate_up down down+silu)"
    )
    p.add_argument(
        "--prefill-variants",
        action="store_true",
        help="from 256 rows also time _scaled_mm with fast accumulation and with per-tensor scales",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    kernels = CudaFp8Kernels.for_device(torch.device("cuda"))
    results = []
    for model in args.model:
        for name, (n, k) in layer_shapes(model, 1).items():
            if args.layers is not None and name not in args.layers:
                continue
            if name == "down+silu" and 1 in args.rows:
                results.append(measure_silu_row(model, n, k, args.replays, args.sweep, kernels))
                torch.cuda.empty_cache()
            elif name not in ("lm_head", "down+silu"):
                results += measure_layer(
                    model, name, n, k, args.rows, args.replays, args.sweep, kernels, args.sweep_gemm,
                    args.prefill_variants,
                )  # fmt: skip
                torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
