"""W8A8 FP8 matmul on FP8 tensor cores in Triton: y = (xq * x_scale) @ (wq * w_scale)^T (+ bias).

It takes what torch._scaled_mm does not (fp8.py):
- block-scaled weights (Qwen3-FP8, DeepSeek-V3: one scale per 128x128 block, in fp8.py's layout of one
  row of block scales per weight row) with activations quantized per row and group of the same columns
  (`quantize_groups_fp8`): each K block's partial sum is scaled by its weight and activation scales;
- per-row-scaled weights under float16 or float32 activations (scaled_mm's row-wise scaling writes
  bfloat16 only), the two per-row scales applied once to the sum.

Each program computes a [BLOCK_N, BLOCK_M] tile of y^T = W x^T: the weight's rows are the MMA's M side
(at least 64 rows for Hopper's wgmma) and the tokens its N side (8 to 256), so a call with few tokens
still runs full MMA tiles (the "swap AB" of small-batch FP8 GEMMs). Both operands are read along K,
the layout FP8 MMAs take. Programs walk the tiles in groups of GROUP_M token blocks, so a weight tile
read for one token block is still in L2 for the next ones.

Only used on CUDA; `TRITON_INTERPRET=1` runs it on CPU tensors for testing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, partial_ptr, lock_ptr, M, N, K, K_PER_SPLIT,
    x_stride, xs_stride, w_stride, ws_stride, out_stride,
    BLOCK_SCALES: tl.constexpr, SCALE_BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """SPLIT_K > 1: program (tile, split) sums K_PER_SPLIT columns (a multiple of BLOCK_K) into a
    float32 partial; the tile's last program to finish (counted on its lock, which it then resets to 0)
    adds the partials in split order, so the result does not depend on which finishes last."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_in_group = GROUP_M * tiles_n
    first_m = (pid // tiles_in_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_in_group) % group_m
    pid_n = (pid % tiles_in_group) // group_m

    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # Out-of-range rows read the last row instead of masking every load; their results are not stored.
    n_in = tl.minimum(n, N - 1).to(tl.int64)
    m_in = tl.minimum(m, M - 1).to(tl.int64)
    k_first = split * K_PER_SPLIT
    kk = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + n_in[:, None] * w_stride + (k_first + kk)[None, :]
    x_tile = x_ptr + m_in[:, None] * x_stride + (k_first + kk)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k_start in range(k_first, tl.minimum(k_first + K_PER_SPLIT, K), BLOCK_K):
        if EVEN_K:
            w = tl.load(w_tile)
            x = tl.load(x_tile)
        else:
            k_mask = (k_start + kk) < K
            w = tl.load(w_tile, mask=k_mask[None, :], other=0.0)
            x = tl.load(x_tile, mask=k_mask[None, :], other=0.0)
        part = tl.dot(w, tl.trans(x))
        if BLOCK_SCALES:  # BLOCK_K divides SCALE_BLOCK_K: the tile lies in one scale block
            block = k_start // SCALE_BLOCK_K
            w_s = tl.load(ws_ptr + n_in * ws_stride + block)
            x_s = tl.load(xs_ptr + m_in * xs_stride + block)
            acc += part * w_s[:, None] * x_s[None, :]
        else:
            acc += part
        w_tile += BLOCK_K
        x_tile += BLOCK_K
    if SPLIT_K == 1:
        _epilogue(acc, n, m, n_in, m_in, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, xs_stride, ws_stride,
                  out_stride, BLOCK_SCALES, HAS_BIAS)  # fmt: skip
    else:
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        partials = partial_ptr + pid.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M) + tile
        tl.store(partials + split * (BLOCK_N * BLOCK_M), acc)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        if tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel") == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for other in range(SPLIT_K):
                acc += tl.load(partials + other * (BLOCK_N * BLOCK_M), cache_modifier=".cg")
            tl.atomic_xchg(lock_ptr + pid, 0)
            _epilogue(acc, n, m, n_in, m_in, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, xs_stride,
                      ws_stride, out_stride, BLOCK_SCALES, HAS_BIAS)  # fmt: skip


@triton.jit
def _epilogue(
    acc, n, m, n_in, m_in, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, xs_stride, ws_stride, out_stride,
    BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    if not BLOCK_SCALES:
        acc *= tl.load(ws_ptr + n_in * ws_stride)[:, None] * tl.load(xs_ptr + m_in * xs_stride)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n_in).to(tl.float32)[:, None]
    out = out_ptr + m.to(tl.int64)[None, :] * out_stride + n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(n < N)[:, None] & (m < M)[None, :])


class Fp8GemmConfig(NamedTuple):
    """One launch shape: weight rows and tokens per program, the K tile, pipeline depth."""

    block_n: int
    block_m: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    split_k: int = 1


def default_config(rows: int, n: int, k: int, block_scales: bool, num_sms: int) -> Fp8GemmConfig:
    """Few tokens: 64 weight rows (one wgmma's M) and a token tile just covering them.
    - Per-row scales: 256-wide K tiles 5 deep (the weight's bytes are the cost), K split in two where
      the tiles fill under half the SMs and K has 8,192 columns or more (Llama-3-8B's down projection:
      18.4 against 20.0 µs at 16 rows); past 16 rows a wide layer (16,384 outputs or more, the merged
      gate/up) takes 128-wide K tiles, 4 deep to 32 rows and 3 deep past them (8B gate_up at 32 rows:
      32.6 against 37.3 µs; 70B: 117.7 against 121.3).
    - Block scales: the blocks' 128-wide K tiles 3 deep, K split four ways unless the layer has twice as
      many tiles as SMs (the Llama-3 8B and 70B layer sets at 2-64 rows: 5-23 % less time than 5 deep
      with the per-row rule's split).
    Many tokens: 64x128 tiles. From sweeps over the Llama-3-8B and 70B layers on an H200
    (scripts/check_fp8_gemm.py --sweep-gemm; BENCHMARKS.md)."""
    if rows > 64:
        return Fp8GemmConfig(64, 128, 128, 4, 3)
    block_m = max(16, triton.next_power_of_2(rows))
    if block_scales:
        split = 4 if triton.cdiv(n, 64) < 2 * num_sms else 1
        return Fp8GemmConfig(64, block_m, 128, 4, 3, split_k=split)
    if n >= 16384 and rows > 16:
        return Fp8GemmConfig(64, block_m, 128, 4, 4 if rows <= 32 else 3)
    split = 2 if 2 * triton.cdiv(n, 64) <= num_sms and k >= 8192 else 1
    return Fp8GemmConfig(64, block_m, 256, 4, 5, split_k=split)


def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    scale_block_k: int,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: Fp8GemmConfig | None = None,
    num_sms: int = 132,
    locks: torch.Tensor | None = None,
) -> torch.Tensor:
    """xq [M, K] e4m3 with x_scale [M, G] float32, weight [N, K] e4m3 with w_scale [N, G] float32 ->
    [M, N] in `out_dtype`, float32 accumulation rounded once. G = 1: per-row scales; else G =
    cdiv(K, scale_block_k) scales of scale_block_k columns (a power of two, at least 32: an FP8 MMA's K)
    on both sides.
    `locks`: a zeroed int32 buffer for split-K (at least one entry per output tile), which each call
    leaves zeroed; calls sharing one must not run concurrently. Without it a split call allocates its
    own."""
    m, k = xq.shape
    n = weight.shape[0]
    groups = w_scale.shape[1]
    block_scales = groups > 1
    fp8 = torch.float8_e4m3fn
    if (
        xq.dtype != fp8
        or weight.dtype != fp8
        or weight.shape[1] != k
        or xq.stride(1) != 1
        or weight.stride(1) != 1
        or x_scale.shape != (m, groups)
        or w_scale.shape[0] != n
        or x_scale.dtype != torch.float32
        or w_scale.dtype != torch.float32
        or (block_scales and (groups != -(-k // scale_block_k) or scale_block_k & (scale_block_k - 1)))
        or (block_scales and scale_block_k < 32)
        or (block_scales and (w_scale.stride(1) != 1 or x_scale.stride(1) != 1))
    ):
        raise ValueError(
            f"fp8_gemm: x {tuple(xq.shape)} {xq.dtype} with scales {tuple(x_scale.shape)}, weight "
            f"{tuple(weight.shape)} {weight.dtype} with scales {tuple(w_scale.shape)} in blocks of "
            f"{scale_block_k} columns do not fit"
        )
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    cfg = config or default_config(m, n, k, block_scales, num_sms)
    block_k = min(cfg.block_k, scale_block_k) if block_scales else cfg.block_k
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
    k_steps = triton.cdiv(k, block_k)
    split = max(1, min(cfg.split_k, k_steps))
    k_per_split = triton.cdiv(k_steps, split) * block_k
    split = triton.cdiv(k, k_per_split)  # no split left without columns
    partials = out
    if split > 1:
        if locks is None:
            locks = torch.zeros(tiles, dtype=torch.int32, device=xq.device)
        elif (
            locks.dtype != torch.int32
            or locks.numel() < tiles
            or locks.device != xq.device
            or not locks.is_contiguous()
        ):
            raise ValueError(f"fp8_gemm: split-K locks {locks.dtype} {tuple(locks.shape)} for {tiles} tiles")
        tile_size = cfg.block_n * cfg.block_m
        partials = torch.empty((tiles, split, tile_size), dtype=torch.float32, device=xq.device)
    _fp8_gemm_kernel[(tiles, split)](
        xq, x_scale, weight, w_scale, weight if bias is None else bias, out, partials,
        out if locks is None else locks, m, n, k, k_per_split,
        xq.stride(0), x_scale.stride(0), weight.stride(0), w_scale.stride(0), out.stride(0),
        BLOCK_SCALES=block_scales, SCALE_BLOCK_K=max(scale_block_k, 1), HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=block_k, GROUP_M=cfg.group_m,
        EVEN_K=k % block_k == 0, SPLIT_K=split, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
