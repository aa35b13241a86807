"""W8A8 FP8 matmuls of mixture-of-experts experts in Triton: the (token, expert) pairs of a step, sorted by
expert, each multiplied by its expert's FP8 weight on FP8 tensor cores, with no host sync (so a decode
step's experts run inside its CUDA graph).

`route_tiles` cuts the sorted pairs into tiles of at most BLOCK_M rows of one expert each, on the device:
the number of tiles is bounded by cdiv(pairs, BLOCK_M) + min(experts, pairs), which the grid covers; the
programs of tiles past the real count return at once. `fp8_moe_gemm` then runs, per (tile, BLOCK_N weight
rows), the tile of fp8_gemm_triton.py's kernel ("swap AB": the weight's rows on the MMA's M side, tokens
on its N side), reading the tile's activation rows through an index (the token of each pair, for the
gate/up projection) and writing its output rows through another (each pair's place, for the down
projection), so neither gather nor scatter is a pass of its own. Scales are per row on both sides, or per
row and block of columns (block-scaled checkpoints), as in fp8_gemm.

Only used on CUDA; `TRITON_INTERPRET=1` runs it on CPU tensors for testing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_moe_gemm_kernel(
    a_ptr, as_ptr, a_rows_ptr, w_ptr, ws_ptr, out_ptr, out_rows_ptr, tile_expert_ptr, tile_row_ptr,
    expert_end_ptr, N, K, NUM_EXPERTS,
    a_stride, as_stride, w_expert_stride, w_stride, ws_expert_stride, ws_stride, out_stride,
    GATHER: tl.constexpr, SCATTER: tl.constexpr, BLOCK_SCALES: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= NUM_EXPERTS:  # past the step's real tiles
        return
    row_end = tl.load(expert_end_ptr + expert)
    m = tl.load(tile_row_ptr + tile) + tl.arange(0, BLOCK_M)  # rows of the sorted pairs
    m_ok = m < row_end
    # Rows past the expert's last pair read its last one instead of masking every load; not stored.
    m_in = tl.minimum(m, row_end - 1)
    if GATHER:
        a_row = tl.load(a_rows_ptr + m_in).to(tl.int64)
    else:
        a_row = m_in.to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = tl.minimum(n, N - 1).to(tl.int64)
    e = expert.to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + e * w_expert_stride + n_in[:, None] * w_stride + kk[None, :]
    a_tile = a_ptr + a_row[:, None] * a_stride + kk[None, :]
    w_scales = ws_ptr + e * ws_expert_stride + n_in * ws_stride
    a_scales = as_ptr + a_row * as_stride
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_tile)
            a = tl.load(a_tile)
        else:
            k_mask = (k_start + kk) < K
            w = tl.load(w_tile, mask=k_mask[None, :], other=0.0)
            a = tl.load(a_tile, mask=k_mask[None, :], other=0.0)
        part = tl.dot(w, tl.trans(a))
        if BLOCK_SCALES:  # BLOCK_K divides SCALE_BLOCK_K: the tile lies in one scale block
            block = k_start // SCALE_BLOCK_K
            acc += part * tl.load(w_scales + block)[:, None] * tl.load(a_scales + block)[None, :]
        else:
            acc += part
        w_tile += BLOCK_K
        a_tile += BLOCK_K
    if not BLOCK_SCALES:
        acc *= tl.load(w_scales)[:, None] * tl.load(a_scales)[None, :]
    if SCATTER:
        out_row = tl.load(out_rows_ptr + m_in).to(tl.int64)
    else:
        out_row = m.to(tl.int64)
    out = out_ptr + out_row[None, :] * out_stride + n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(n < N)[:, None] & m_ok[None, :])


class MoeTiles(NamedTuple):
    """A step's pairs sorted by expert and cut into tiles (`route_tiles`), all on the device.
    order: pair index (token·k + slot) of each sorted row; tile_expert / tile_row: each tile's expert
    (num_experts past the real tiles) and first sorted row; expert_end: one past each expert's last
    sorted row."""

    order: torch.Tensor
    tile_expert: torch.Tensor
    tile_row: torch.Tensor
    expert_end: torch.Tensor
    block_m: int


def tile_rows(pairs: int, num_experts: int) -> int:
    """Tokens per tile: about the pairs an expert gets (wider tiles only re-read the weight less)."""
    per_expert = -(-pairs // max(1, min(num_experts, pairs)))
    return min(128, max(16, triton.next_power_of_2(per_expert)))


@triton.jit
def _route_tiles_kernel(
    ids_ptr, order_ptr, tile_expert_ptr, tile_row_ptr, expert_end_ptr, PAIRS, NUM_EXPERTS, MAX_TILES,
    BLOCK_M: tl.constexpr, PAIRS_PAD: tl.constexpr, EXPERTS_PAD: tl.constexpr, TILE_CHUNK: tl.constexpr,
):  # fmt: skip
    """route_tiles' torch ops as one program: a sort of (expert, pair) keys, a histogram and cumsums."""
    p = tl.arange(0, PAIRS_PAD)
    # Padding pairs get expert NUM_EXPERTS: they sort last and count in a bin no expert has.
    e = tl.load(ids_ptr + p, mask=p < PAIRS, other=NUM_EXPERTS).to(tl.int32)
    key = tl.sort(e * PAIRS_PAD + p)
    tl.store(order_ptr + p, key % PAIRS_PAD, mask=p < PAIRS)
    counts = tl.histogram(e, EXPERTS_PAD)
    experts = tl.arange(0, EXPERTS_PAD)
    counts = tl.where(experts < NUM_EXPERTS, counts, 0)
    expert_end = tl.cumsum(counts, 0)
    tl.store(expert_end_ptr + experts, expert_end, mask=experts < NUM_EXPERTS)
    tiles = (counts + (BLOCK_M - 1)) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    for first in range(0, MAX_TILES, TILE_CHUNK):
        t = first + tl.arange(0, TILE_CHUNK)
        # A tile's expert: how many experts' tiles end at or before it (NUM_EXPERTS past the last).
        ended = (tile_end[None, :] <= t[:, None]) & (experts[None, :] < NUM_EXPERTS)
        expert = tl.sum(ended.to(tl.int32), axis=1)
        mine = experts[None, :] == expert[:, None]
        first_row = tl.sum(tl.where(mine, (expert_end - counts)[None, :], 0), axis=1)
        first_tile = tl.sum(tl.where(mine, (tile_end - tiles)[None, :], 0), axis=1)
        tl.store(tile_expert_ptr + t, expert, mask=t < MAX_TILES)
        tl.store(tile_row_ptr + t, first_row + (t - first_tile) * BLOCK_M, mask=t < MAX_TILES)


# Pairs up to which route_tiles runs as one Triton program (a decode step's): past it, torch's sort and
# scans, whose ~12 kernels cost little next to the step's matmuls.
ROUTE_KERNEL_MAX_PAIRS = 1024


def route_tiles(
    expert_ids: torch.Tensor, num_experts: int, block_m: int | None = None, kernel: bool | None = None
) -> MoeTiles:
    """expert_ids [tokens, k] -> the tiles of its (token, slot) pairs by expert, with no host sync (the
    tile count's bound is known from the shapes alone). `kernel`: one Triton program (the default on
    CUDA up to ROUTE_KERNEL_MAX_PAIRS pairs) or torch ops; the two give the same tiles."""
    flat = expert_ids.flatten()
    pairs = flat.numel()
    block_m = block_m or tile_rows(pairs, num_experts)
    max_tiles = -(-pairs // block_m) + min(num_experts, pairs)
    if kernel is None:
        kernel = flat.is_cuda and 0 < pairs <= ROUTE_KERNEL_MAX_PAIRS
    if kernel and pairs:
        device = flat.device
        order = torch.empty(pairs, dtype=torch.int32, device=device)
        tile_expert = torch.empty(max_tiles, dtype=torch.int32, device=device)
        tile_row = torch.empty(max_tiles, dtype=torch.int32, device=device)
        expert_end = torch.empty(num_experts, dtype=torch.int32, device=device)
        _route_tiles_kernel[(1,)](
            flat, order, tile_expert, tile_row, expert_end, pairs, num_experts, max_tiles,
            BLOCK_M=block_m, PAIRS_PAD=triton.next_power_of_2(pairs),
            EXPERTS_PAD=triton.next_power_of_2(num_experts + 1), TILE_CHUNK=64, num_warps=4,
        )  # fmt: skip
        return MoeTiles(order, tile_expert, tile_row, expert_end, block_m)
    order = flat.argsort(stable=True).to(torch.int32)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    expert_end = counts.cumsum(0, dtype=torch.int32)
    tiles = (counts + (block_m - 1)) // block_m
    tile_end = tiles.cumsum(0, dtype=torch.int32)
    index = torch.arange(max_tiles, dtype=torch.int32, device=flat.device)
    tile_expert = torch.searchsorted(tile_end, index, right=True).to(torch.int32)
    e = tile_expert.clamp(max=num_experts - 1).long()
    tile_row = (expert_end - counts)[e] + (index - (tile_end - tiles)[e]) * block_m
    return MoeTiles(order, tile_expert, tile_row.to(torch.int32), expert_end, block_m)


class Fp8MoeConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_config(block_m: int, block_scales: bool) -> Fp8MoeConfig:
    """As fp8_gemm's: 64 weight rows (one wgmma's M), a deep K pipeline for few tokens, a K tile of at
    most the scale blocks' 128 columns."""
    if block_m > 32:
        return Fp8MoeConfig(64, 128, 4, 3)
    return Fp8MoeConfig(64, 128 if block_scales else 256, 4, 5)


def fp8_moe_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    scale_block_k: int,
    tiles: MoeTiles,
    out_dtype: torch.dtype,
    a_rows: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
    config: Fp8MoeConfig | None = None,
) -> torch.Tensor:
    """Row r of the sorted pairs (expert e): out[out_rows[r]] = (a[a_rows[r]] * scales) @ (weight[e] *
    scales)^T. a [R, K] e4m3 with a_scale [R, G] float32; weight [E, N, K] e4m3 with w_scale [E, N, G]
    float32; G = 1 (per-row scales) or cdiv(K, scale_block_k) (blocks of a power of two, at least 32,
    columns on both sides). a_rows: None for a in sorted order; out_rows: None for the output in sorted
    order. Returns [pairs, N] in `out_dtype`, float32 accumulation rounded once."""
    pairs = tiles.order.numel()
    experts, n, k = weight.shape
    groups = w_scale.shape[2] if w_scale.dim() == 3 else -1
    block_scales = groups > 1
    fp8 = torch.float8_e4m3fn
    rows = a.shape[0]
    if (
        a.dtype != fp8
        or weight.dtype != fp8
        or a.dim() != 2
        or a.shape[1] != k
        or a.stride(1) != 1
        or weight.stride(2) != 1
        or w_scale.shape[:2] != (experts, n)
        or a_scale.shape != (rows, groups)
        or a_scale.dtype != torch.float32
        or w_scale.dtype != torch.float32
        or (block_scales and (groups != -(-k // scale_block_k) or scale_block_k & (scale_block_k - 1)))
        or (block_scales and scale_block_k < 32)
        or (block_scales and (w_scale.stride(2) != 1 or a_scale.stride(1) != 1))
        or (a_rows is None and rows != pairs)
        or tiles.expert_end.numel() != experts
    ):
        raise ValueError(
            f"fp8_moe_gemm: a {tuple(a.shape)} {a.dtype} with scales {tuple(a_scale.shape)}, weight "
            f"{tuple(weight.shape)} {weight.dtype} with scales {tuple(w_scale.shape)} in blocks of "
            f"{scale_block_k} columns, {pairs} pairs over {tiles.expert_end.numel()} experts do not fit"
        )
    out = torch.empty((pairs, n), dtype=out_dtype, device=a.device)
    if pairs == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = config or default_config(tiles.block_m, block_scales)
    block_k = min(cfg.block_k, scale_block_k) if block_scales else cfg.block_k
    index = tiles.order  # any int32 tensor: the kernel reads it only where GATHER / SCATTER says
    grid = (triton.cdiv(n, cfg.block_n), tiles.tile_expert.numel())
    _fp8_moe_gemm_kernel[grid](
        a, a_scale, index if a_rows is None else a_rows, weight, w_scale, out,
        index if out_rows is None else out_rows, tiles.tile_expert, tiles.tile_row, tiles.expert_end,
        n, k, experts, a.stride(0), a_scale.stride(0), weight.stride(0), weight.stride(1),
        w_scale.stride(0), w_scale.stride(1), out.stride(0),
        GATHER=a_rows is not None, SCATTER=out_rows is not None, BLOCK_SCALES=block_scales,
        SCALE_BLOCK_K=max(scale_block_k, 1), BLOCK_N=cfg.block_n, BLOCK_M=tiles.block_m, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
