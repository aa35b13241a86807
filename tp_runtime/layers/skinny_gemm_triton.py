"""The matmuls of a decode step at small batch as Triton kernels. One row: y = x W^T (+ b), optionally with
the SiLU-and-mul of the merged [gate | up] projection computed from x on the fly (the down projection).

A one-row linear layer only streams its weight once. cuBLAS picks split-K for most of these shapes (a
second, reduce kernel after the matmul) and its tiles leave part of the GPU idle at the tail; the separate
SiLU-mul kernel before the down projection is one more launch. Here each program owns BLOCK_N output
features and walks the whole of K, float32 products summed once at the end, so there is no split-K pass,
and the activation is applied to x where it is loaded (each program recomputes it for its K tile from L2;
the weight dominates the bytes). On an H200 this reads the Llama-3-8B layers' weights 5-25 % faster than
cuBLAS at one row (scripts/check_skinny_gemm.py; BENCHMARKS.md).

From 2 to 32 rows (decode at small and medium batch) `few_rows_linear` reads each weight tile once for
every row with tensor-core products, where that measured faster than cuBLAS (`few_rows_config`).

Only used on CUDA; `TRITON_INTERPRET=1` runs it on CPU tensors for testing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tp_runtime.layers import pdl
from tp_runtime.layers.fused_triton import silu_mul_value, to_float16_clamped
from tp_runtime.layers.pdl import release_and_wait, release_dependents, wait_for_previous


@triton.jit
def _load_x(
    x_row, k, k_mask, K, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr
):  # fmt: skip
    """x[k] as float32; with SILU_MUL, silu(x[k]) * x[K + k] rounded as fused_triton.silu_and_mul rounds."""
    if EVEN_K:
        gate = tl.load(x_row + k)
    else:
        gate = tl.load(x_row + k, mask=k_mask, other=0.0)
    if SILU_MUL:
        if EVEN_K:
            up = tl.load(x_row + K + k)
        else:
            up = tl.load(x_row + K + k, mask=k_mask, other=0.0)
        gate = silu_mul_value(gate, up)
    return gate


@triton.jit
def _load_w_tile(w_rows, k_start, n_mask, K, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    k = k_start + tl.arange(0, BLOCK_K)
    if EVEN:
        return tl.load(w_rows + k[None, :], eviction_policy="evict_first")
    w_mask = n_mask[:, None] & (k < K)[None, :]
    return tl.load(w_rows + k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _tile_products(
    w, x_row, k_start, n, n_mask, K, scale_ptr, scale_stride, SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SCALE: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
    X_TILE: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """The products of weight tile `w` (columns k_start...) and x's matching elements, each row's summed
    over runs of GROUP neighbouring columns: [BLOCK_N, BLOCK_K // GROUP] float32.

    X_TILE: x read as a [BLOCK_N, BLOCK_K] tile of one row (stride 0 down it), in the weight tile's own
    layout; a [BLOCK_K] vector is read in another and handed to each row's threads through shared memory,
    a barrier every tile. GROUP > 1 keeps that many fewer float32 partial sums in registers, so more
    programs, and more weight bytes, are in flight on each SM (each thread's GROUP columns are its own:
    the sums need no exchange)."""
    k = k_start + tl.arange(0, BLOCK_K)
    if X_TILE and not SILU_MUL:
        offs = tl.zeros([BLOCK_N], tl.int32)[:, None] + k[None, :]
        if EVEN_K:
            xk = tl.load(x_row + offs).to(tl.float32)
        else:
            xk = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
    else:
        xk = _load_x(x_row, k, k < K, K, SILU_MUL, EVEN_K).to(tl.float32)[None, :]
    p = w.to(tl.float32) * xk
    if GROUP > 1:
        p = tl.sum(tl.reshape(p, [BLOCK_N, BLOCK_K // GROUP, GROUP]), axis=2)
    if SCALE == 2:
        s = tl.load(scale_ptr + n.to(tl.int64) * scale_stride + k_start // SCALE_BLOCK_K, mask=n_mask)
        p = p * s[:, None]
    return p


@triton.jit
def _skinny_row_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, scale_ptr, N, K, x_stride, w_stride, out_stride, scale_stride,
    SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, SCALE: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, X_TILE: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """One program per (BLOCK_N output features, row). SCALE (FP8 weights): 1, one scale per row, applied
    to the sum; 2, one per row and SCALE_BLOCK_K columns (a multiple of BLOCK_K), applied per tile. PDL:
    launched with programmatic dependent launch (layers/pdl.py); the first weight tile is loaded before
    waiting for the kernel before, which no kernel of a step writes, so that load overlaps its end.
    X_TILE, GROUP: _tile_products."""
    release_dependents(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1)
    n_mask = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * w_stride
    w = _load_w_tile(w_rows, 0, n_mask, K, BLOCK_K, EVEN_N and EVEN_K)
    wait_for_previous(PDL)
    x_row = x_ptr + row.to(tl.int64) * x_stride
    acc = _tile_products(
        w, x_row, 0, n, n_mask, K, scale_ptr, scale_stride, SILU_MUL, BLOCK_N, BLOCK_K, EVEN_K, SCALE,
        SCALE_BLOCK_K, X_TILE, GROUP,
    )  # fmt: skip
    for k_start in range(BLOCK_K, K, BLOCK_K):
        w = _load_w_tile(w_rows, k_start, n_mask, K, BLOCK_K, EVEN_N and EVEN_K)
        acc += _tile_products(
            w, x_row, k_start, n, n_mask, K, scale_ptr, scale_stride, SILU_MUL, BLOCK_N, BLOCK_K, EVEN_K,
            SCALE, SCALE_BLOCK_K, X_TILE, GROUP,
        )  # fmt: skip
    y = tl.sum(acc, axis=1)
    if SCALE == 1:
        y *= tl.load(scale_ptr + n.to(tl.int64) * scale_stride, mask=n_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)  # added before the one rounding
    tl.store(out_ptr + row.to(tl.int64) * out_stride + n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _few_rows_dot_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, scale_ptr, M, N, K, x_stride, w_stride, out_stride, scale_stride,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, FP32: tl.constexpr, SCALE: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr, F16_PRODUCTS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per BLOCK_N output features for all (up to BLOCK_M) rows: tensor-core products (exact
    float32 products for float32, no TF32), each weight tile read once. FP8 weights (SCALE 1 or 2, as in
    _skinny_row_kernel) are converted to x's dtype in registers; F16_PRODUCTS (FP8 under a bfloat16 x): to
    float16 instead, and x too (fused_triton.to_float16_clamped): at one row an H200 ran the Llama-3-8B and
    70B layers through this kernel 1.26-1.45x faster so."""
    release_and_wait(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    x_rows = x_ptr + m.to(tl.int64)[:, None] * x_stride
    w_rows = w_ptr + n.to(tl.int64)[:, None] * w_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k = k_start + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xk = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if F16_PRODUCTS:
            xk = to_float16_clamped(xk)
        if EVEN_N and EVEN_K:
            w = tl.load(w_rows + k[None, :], eviction_policy="evict_first")
        else:
            w_mask = n_mask[:, None] & k_mask[None, :]
            w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        w = w.to(xk.dtype)
        if FP32:
            part = tl.dot(xk, tl.trans(w), input_precision="ieee")
        else:
            part = tl.dot(xk, tl.trans(w))
        if SCALE == 2:
            s = tl.load(scale_ptr + n.to(tl.int64) * scale_stride + k_start // SCALE_BLOCK_K, mask=n_mask)
            acc += part * s[None, :]
        else:
            acc += part
    if SCALE == 1:
        acc *= tl.load(scale_ptr + n.to(tl.int64) * scale_stride, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + m.to(tl.int64)[:, None] * out_stride + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


class SkinnyConfig(NamedTuple):
    """One launch shape of the kernel. `x_tile` and `group`: the one-row kernel's _tile_products (the
    few-rows kernel ignores them)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1
    x_tile: bool = False
    group: int = 1


def default_config(n: int, num_sms: int, k: int = 0, weight_bytes: int = 2) -> SkinnyConfig:
    """The one-row kernel's launch shape for an [n, k] weight of `weight_bytes`-byte elements on a GPU with
    `num_sms` multiprocessors.

    16-bit weights: measured on an H200 for the Llama-3 8B and 70B shards at TP 1 and 2
    (scripts/check_skinny_gemm.py). FP8 weights: 2 KB of each row per tile, x in the tile's layout and
    16-column partial sums (_tile_products), from a sweep of the Llama-3-8B layers on an H100 (.exp-style
    script; BENCHMARKS.md "GPU: FP8"): the wide merged gate/up in 8-row tiles, the narrow layers in 4-row
    ones, 16-row ones where K is long (the down projection), against 4-16 rows of 256-1024 columns with
    16-bit weights' kernel before (o_proj 9.2 -> 6.5 us, down 27.0 -> 21.0 us)."""
    if weight_bytes == 1:
        if n >= 12288:
            return SkinnyConfig(8, 2048, 8, 1, True, 16)
        if k >= 8192:
            return SkinnyConfig(16, 2048, 8, 1, True, 16)
        return SkinnyConfig(4, 2048, 4, 1, True, 16)
    if n >= 12288:  # wide (merged gate/up, LM head): 16-row tiles are plenty of programs
        return SkinnyConfig(16, 256, 4)
    # Four rows per program, unless that leaves a short last wave (about 8 such programs fit on an SM):
    # then twice the rows per program and twice the warps.
    waves = triton.cdiv(n, 4) / (8 * num_sms)
    if 1.0 < waves < 1.8:
        return SkinnyConfig(8, 512, 8)
    return SkinnyConfig(4, 1024, 4)


def _check(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x_width: int, scale: torch.Tensor | None
) -> None:
    if x.dim() != 2 or x.shape[1] != x_width:
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need unit column stride")
    fp8 = weight.dtype == torch.float8_e4m3fn
    if (x.dtype != weight.dtype and not fp8) or x.device != weight.device or fp8 != (scale is not None):
        raise ValueError(
            f"x ({x.dtype}, {x.device}) and weight ({weight.dtype}, {weight.device}) differ, or an FP8 "
            "weight comes without its scales"
        )
    if scale is not None and (
        scale.dtype != torch.float32
        or scale.dim() != 2
        or scale.shape[0] != weight.shape[0]
        or scale.stride(1) != 1
    ):
        raise ValueError(
            f"FP8 scales {tuple(scale.shape)} {scale.dtype} do not fit weight {tuple(weight.shape)}"
        )
    if bias is not None and (bias.shape != weight.shape[:1] or bias.stride(0) != 1):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")


def _scale_mode(scale: torch.Tensor | None, scale_block_k: int, block_k: int) -> tuple[int, int]:
    """(SCALE, the BLOCK_K to launch with): 0 no scales, 1 one per row, 2 one per row and scale_block_k
    columns (BLOCK_K lowered to divide scale_block_k)."""
    if scale is None:
        return 0, block_k
    if scale.shape[1] == 1:
        return 1, block_k
    if scale_block_k & (scale_block_k - 1):
        raise ValueError(f"FP8 scale blocks of {scale_block_k} columns: a power of two is needed")
    return 2, min(block_k, scale_block_k)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu_mul: bool = False,
    config: SkinnyConfig | None = None,
    num_sms: int = 132,
    scale: torch.Tensor | None = None,
    scale_block_k: int = 0,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias), float32 accumulation, rounded once to x's dtype. Meant for M = 1:
    each row reads the weight again.
    `silu_mul`: x is the [M, 2K] gate|up projection output and silu(gate) * up (rounded as the separate
    SiLU-mul kernel rounds) is multiplied instead.
    `scale`: an FP8 weight's float32 scales [N, cdiv(K, scale_block_k)] (layers/quantization/fp8.py)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-d, got {tuple(weight.shape)}")
    n, k = weight.shape
    _check(x, weight, bias, 2 * k if silu_mul else k, scale)
    rows = x.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    if k == 0:  # the kernel reads a first weight tile unconditionally
        return out.zero_() if bias is None else out.copy_(bias.expand(rows, n))
    cfg = config or default_config(n, num_sms, k, weight.element_size())
    tile_k = cfg.block_k
    if cfg.x_tile:  # (FP8's 2,048-column tiles) no wider than a small layer's K needs
        tile_k = min(tile_k, max(16, triton.next_power_of_2(k)))
    mode, block_k = _scale_mode(scale, scale_block_k, tile_k)
    group = min(cfg.group, block_k)
    _skinny_row_kernel[(triton.cdiv(n, cfg.block_n), rows)](
        x, weight, weight if bias is None else bias, out, weight if scale is None else scale, n, k,
        x.stride(0), weight.stride(0), out.stride(0), 0 if scale is None else scale.stride(0),
        SILU_MUL=silu_mul, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        EVEN_N=n % cfg.block_n == 0, EVEN_K=k % block_k == 0, SCALE=mode, SCALE_BLOCK_K=max(scale_block_k, 1),
        X_TILE=cfg.x_tile, GROUP=group, **pdl.launch_args(x), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


# Rows up to which few_rows_linear can run (its tile holds every row); more go to cuBLAS.
MAX_FEW_ROWS = 32


def few_rows_config(
    rows: int, n: int, k: int, dtype: torch.dtype, num_sms: int, lm_head: bool = False
) -> SkinnyConfig | None:
    """The launch shape of few_rows_linear for 2..MAX_FEW_ROWS rows, or None where cuBLAS is as fast or
    faster (measured on an H200 for the Llama-3-8B shards at TP 1 and 2, 4-32 rows: the single pass wins
    for the LM head and for layers of at most one 32-feature tile per SM with K >= 4096; cuBLAS keeps the
    merged gate/up and the wide QKV). 16-bit dtypes only: float32 tensor-core products would be TF32."""
    if not 2 <= rows <= MAX_FEW_ROWS or dtype not in (torch.bfloat16, torch.float16):
        return None
    if lm_head:
        return SkinnyConfig(64, 128, 4, 3) if n >= 32768 else None
    if n <= 32 * num_sms and k >= 4096:
        return SkinnyConfig(32, 512 if k >= 7168 else 256, 4, 4)
    return None


def fp8_few_rows_config(n: int, rows: int, num_sms: int) -> SkinnyConfig:
    """few_rows_linear's launch shape for an FP8 weight (there is no cuBLAS weight-only FP8 to fall back
    to; block scales lower BLOCK_K to their block). Up to 16 rows: the fastest of a sweep over the
    Llama-3-8B layers at 4 and 16 rows on an H200 (scripts/check_fp8_gemm.py --sweep; BENCHMARKS.md),
    32-feature tiles and 512-wide K tiles (256 for the wide merged gate/up). More rows: 256-wide K tiles
    and 16-feature tiles where 32 would leave SMs idle (the sweep's shape made batch-32 decode 11 %
    slower end to end)."""
    if rows <= 16:
        return SkinnyConfig(32, 256 if n >= 16384 else 512, 4, 3)
    return SkinnyConfig(32 if n >= 32 * num_sms else 16, 256, 4, 4)


def few_rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig,
    scale: torch.Tensor | None = None,
    scale_block_k: int = 0,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) for M <= MAX_FEW_ROWS in one pass over the weight (tensor cores;
    float32 products exact, as F.linear's without TF32), float32 accumulation rounded once. `scale`: as
    in skinny_linear."""
    n, k = weight.shape
    _check(x, weight, bias, k, scale)
    rows = x.shape[0]
    if rows > MAX_FEW_ROWS:
        raise ValueError(f"few_rows_linear takes at most {MAX_FEW_ROWS} rows, got {rows}")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    mode, block_k = _scale_mode(scale, scale_block_k, config.block_k)
    _few_rows_dot_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, weight if bias is None else bias, out, weight if scale is None else scale, rows, n, k,
        x.stride(0), weight.stride(0), out.stride(0), 0 if scale is None else scale.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=max(16, triton.next_power_of_2(rows)),
        BLOCK_N=config.block_n, BLOCK_K=block_k, EVEN_N=n % config.block_n == 0,
        EVEN_K=k % block_k == 0, FP32=x.dtype == torch.float32, SCALE=mode,
        SCALE_BLOCK_K=max(scale_block_k, 1),
        F16_PRODUCTS=scale is not None and x.dtype == torch.bfloat16, **pdl.launch_args(x),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
