"""Paged attention as Triton kernels: keys and values are read straight from the cache blocks.

The PyTorch path gathers every sequence's blocks into a padded copy before SDPA, which costs a write and a
second read of the whole KV context per layer. These kernels walk the block tables instead, so the context
is read once. Only used on CUDA; `TRITON_INTERPRET=1` runs them on CPU tensors for testing.

Decode is split-KV ("flash-decoding"): one program per (sequence, KV head, split). One program per
(sequence, KV head) alone leaves most of an H200's 132 SMs idle at small batches and long contexts, so each
sequence's KV tiles are shared out over `num_splits` programs, each writing a partial softmax state (max,
sum, unnormalised output) in float32; a small second kernel merges the splits. Every program handles all
query heads of its KV head (GQA), so each KV tile is loaded once per split.

Prefill (`paged_prefill_attention`) is a flash-attention forward for one sequence's chunk whose keys and
values, and those of all earlier context, are already in the cache (chunked-prefill continuation, a
preempted request resuming).

Conventions shared by both: caches are [num_blocks, block_size, kv_heads, head_dim], in the queries' dtype
or FP8 (e4m3, converted to the queries' dtype on load, exactly; the layer's key scale joins the softmax
scale and its value scale the output, layers/kv_fp8.py); query head h uses KV
head h // (heads // kv_heads); a sliding window w > 0 lets a query at position p see keys k with
p - w < k <= p. Head dims that are not powers of two are padded (HEAD_DIM_PAD) and masked. Scores are kept
in base 2 (scaled by log2(e)) so the softmax uses exp2. A soft-cap c > 0 (Gemma 2) replaces each scaled score
s by c * tanh(s / c) before masking, as transformers does.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tp_runtime.layers import pdl
from tp_runtime.layers.fused_triton import to_float16_clamped
from tp_runtime.layers.kv_fp8 import is_fp8
from tp_runtime.layers.pdl import release_and_wait

# Tuning knobs (H200 defaults, barely tuned). Tile sizes count tokens per loop iteration, independent
# of the cache block size; they must be powers of two >= 16 (tl.dot's minimum). They are the sizes for
# rows of up to 256 bytes (bf16 head_dim <= 128); `_tile` halves them for wider rows (head_dim 256, float32).
#
# Decode is bandwidth bound: a 64-token tile of K and V at bf16 head_dim 128 is 32 KiB. With indirect
# (block-table) loads Triton's pipeliner needs 3 stages to keep the next tile's K/V in flight while this one
# is computed (2 stages only prefetch the block ids); that is ~40 KiB of shared memory and ~112 registers a
# program (sm_90, Triton 3.6 compile), so several programs fit on an SM. 4 warps: the 16-row GQA tile
# gives more warps nothing to do. One H200 run (bf16, 32/8 heads, head_dim 128, cache blocks of 16): 4.3 TB/s
# (the card's copy rate) at batch 64 x 2k and 256 x 1k tokens; with choose_num_splits 3.9 TB/s at 16 x 4k,
# 3.5 at 4 x 16k, 3.1 at 1 x 32k (32 splits; 64 gave 3.4).
DECODE_BLOCK_N = 64
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
# choose_num_splits aims for this many decode programs per SM, never splits further than this (bounds the
# float32 scratch and the merge) and gives each split at least this many KV tiles.
DECODE_PROGRAMS_PER_SM = 2
DECODE_MAX_SPLITS = 32
DECODE_MIN_TILES_PER_SPLIT = 1
# Prefill is compute bound: the usual flash-attention forward shape (64x64 tiles, 4 warps = one Hopper
# warpgroup for BLOCK_M 64, K/V double-buffered with 3 stages).
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64
PREFILL_NUM_WARPS = 4
PREFILL_NUM_STAGES = 3

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # float32 models want exact products, not TF32.
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _tanh(x):
    """tanh from exp2 (libdevice's tanh does not run in Triton's interpreter): within ~1e-7 of it."""
    t = tl.exp2(-2.885390081777927 * tl.abs(x))  # exp(-2|x|)
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _scores(q, k, qk_scale, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """Scores in base 2. SOFTCAP > 0: qk_scale is the plain softmax scale, and the scaled scores are capped
    (c * tanh(s / c)) before the change of base; else qk_scale already holds log2(e)."""
    s = _dot(q, tl.trans(k), IEEE) * qk_scale
    if SOFTCAP > 0:
        s = _tanh(s / SOFTCAP) * (SOFTCAP * 1.4426950408889634)
    return s


@triton.jit
def _fp8_cache_queries(q, KV_FP8: tl.constexpr):
    """The queries in the dtype an FP8 cache's tiles are converted to: float16 for bfloat16 queries (with
    tiles converted to bfloat16 the decode loop was bound by conversions at half the bf16 cache's
    bandwidth, H200)."""
    if KV_FP8 and q.dtype == tl.bfloat16:
        return to_float16_clamped(q)
    else:
        return q


@triton.jit
def _token_offsets(table_row_ptr, pos, valid, stride_block, stride_token, BLOCK_SIZE: tl.constexpr):
    """Cache offsets of the tokens at positions pos: one block-table entry per token, so a tile may span
    several cache blocks or part of one. Masked-off tokens get block 0 without reading the table, which may
    end before them."""
    block_id = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block_id * stride_block + (pos % BLOCK_SIZE) * stride_token


# Runtime ints are not specialised on their value (Triton would otherwise compile extra variants for 1 and
# multiples of 16): the window and prefill's lengths change from call to call, and the block-table and
# length strides differ between the decode graphs (rows of their input buffer) and eager steps (a table as
# wide as the step needs, which may be 1), so without this an eager step could compile a variant of its
# own in the middle of serving. They only offset scalar loads.
@triton.jit(do_not_specialize=["window", "stride_table", "stride_len"])
def _decode_kernel(
    q_ptr,  # [seqs, heads, head_dim] (strides given, last dim contiguous)
    k_cache_ptr,  # [blocks, block_size, kv_heads, head_dim]; v_cache has the same strides
    v_cache_ptr,
    block_tables_ptr,  # [seqs, >= blocks of the longest sequence] (row stride given)
    seq_lens_ptr,  # [seqs] (stride given)
    out_ptr,  # NUM_SPLITS == 1: the output [seqs, heads, head_dim]; else partial acc [seqs, heads, splits, d]
    m_ptr,  # [seqs, heads, splits] float32 running max (base 2); unused when NUM_SPLITS == 1
    l_ptr,  # [seqs, heads, splits] float32 softmax denominators
    qk_scale,  # softmax scale * key scale * log2(e) (SOFTCAP > 0: without log2(e))
    v_scale,  # the value scale (FP8 caches; else 1)
    window,  # <= 0: no sliding window
    stride_q_seq,
    stride_q_head,
    stride_table,
    stride_len,
    stride_block,
    stride_token,
    stride_kv_head,
    stride_out_seq,
    stride_out_head,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two >= 16 for tl.dot
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size
    BLOCK_N: tl.constexpr,  # KV tile
    NUM_SPLITS: tl.constexpr,
    SOFTCAP: tl.constexpr,  # attention logit soft-cap; 0: off
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,  # the caches hold e4m3
    PDL: tl.constexpr,  # launched with programmatic dependent launch (layers/pdl.py)
):
    release_and_wait(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq * stride_len).to(tl.int32)
    # This sequence's own tile range (tiles wholly before the window skipped), shared out evenly over the
    # splits; short sequences leave trailing splits empty rather than reading padding.
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    first_tile = start // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    tile_lo = first_tile + num_tiles * split // NUM_SPLITS
    tile_hi = first_tile + num_tiles * (split + 1) // NUM_SPLITS

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    q = _fp8_cache_queries(q, KV_FP8)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table_row = block_tables_ptr + seq * stride_table
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + offs_n
        valid = (pos >= start) & (pos < seq_len)
        # Masked loads also keep never-written cache slots (possibly NaN bits) out of the sums.
        kv_offs = (
            _token_offsets(table_row, pos, valid, stride_block, stride_token, BLOCK_SIZE)[:, None]
            + kv_head * stride_kv_head
            + dims[None, :]
        )
        kv_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)  # FP8 caches: exact
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        s = _scores(q, k, qk_scale, SOFTCAP, IEEE)
        s = tl.where(valid[None, :], s, float("-inf"))
        # Every tile in range holds a valid key, so m_new is finite from the first tile on.
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m = m_new

    acc = acc * v_scale
    if NUM_SPLITS == 1:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]  # l == 0 only for an empty context: output 0
        tl.store(
            out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        # An empty split stores m = -inf, l = 0, acc = 0; the merge weighs it by exp2(-inf) = 0.
        part = (seq * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split
        tl.store(m_ptr + part, m, mask=row_ok)
        tl.store(l_ptr + part, l, mask=row_ok)
        tl.store(
            out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :]
        )


@triton.jit
def _combine_kernel(
    m_ptr,  # [seqs, heads, splits]
    l_ptr,
    acc_ptr,  # [seqs, heads, splits, head_dim]
    out_ptr,  # [seqs, heads, head_dim]
    stride_out_seq,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """Log-sum-exp merge of one (sequence, head)'s splits."""
    release_and_wait(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    base = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    m = tl.load(m_ptr + base + splits, mask=split_ok, other=float("-inf"))
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty: avoid -inf - -inf = NaN
    l_total = tl.sum(tl.load(l_ptr + base + splits, mask=split_ok, other=0.0) * tl.exp2(m - m_max), 0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    # One split at a time: registers stay at one head_dim row however many splits there are.
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for s in range(NUM_SPLITS):
        weight = tl.exp2(tl.load(m_ptr + base + s) - m_max)
        acc += weight * tl.load(acc_ptr + (base + s) * HEAD_DIM + dims, mask=dim_ok, other=0.0)
    out = acc / tl.where(l_total > 0, l_total, 1.0)
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


@triton.jit(do_not_specialize=["window", "context_len", "chunk_len"])
def _prefill_kernel(
    q_ptr,  # [chunk_len, heads, head_dim] (strides given, last dim contiguous)
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,  # [blocks] covering context_len + chunk_len tokens
    out_ptr,  # [chunk_len, heads, head_dim] contiguous
    qk_scale,
    v_scale,
    window,
    context_len,
    chunk_len,
    stride_q_tok,
    stride_q_head,
    stride_block,
    stride_token,
    stride_kv_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    tile_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = context_len + rows
    row_ok = rows < chunk_len
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(
        q_ptr + rows[:, None] * stride_q_tok + head * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    q = _fp8_cache_queries(q, KV_FP8)
    # Keys this query tile can see: from the first query's window start to the last valid query.
    end = tl.minimum(context_len + (tile_m + 1) * BLOCK_M, context_len + chunk_len)
    start = tl.where(window > 0, tl.maximum(context_len + tile_m * BLOCK_M - window + 1, 0), 0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(start // BLOCK_N * BLOCK_N, end, BLOCK_N):
        pos = tile_start + offs_n
        valid = (pos >= start) & (pos < end)
        kv_offs = (
            _token_offsets(block_table_ptr, pos, valid, stride_block, stride_token, BLOCK_SIZE)[:, None]
            + kv_head * stride_kv_head
            + dims[None, :]
        )
        kv_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)  # FP8 caches: exact
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        s = _scores(q, k, qk_scale, SOFTCAP, IEEE)
        allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        allowed &= (window <= 0) | (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        # With a window a row can see no key of this tile yet: keep its max finite (no -inf - -inf).
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m = m_new
    out = acc * v_scale / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(
        out_ptr + (rows[:, None] * tl.num_programs(1) + head) * HEAD_DIM + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def _head_dim_pad(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _tile(block: int, head_dim_pad: int, dtype: torch.dtype) -> int:
    """Halve a tile for each doubling of a row past 256 bytes (bf16 head_dim 128), so registers and shared
    memory per program stay about the same for head_dim 256 and for float32."""
    row_bytes = head_dim_pad * dtype.itemsize
    while row_bytes > 256 and block > 16:
        block, row_bytes = block // 2, row_bytes // 2
    return block


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor) -> tuple[int, int, int]:
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "caches need equal layouts"
    if not k_cache.dtype == v_cache.dtype in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"KV caches of {k_cache.dtype}/{v_cache.dtype} for {q.dtype} queries: they must be "
                         "the queries' dtype or float8_e4m3fn")  # fmt: skip
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


def _kernel_scales(
    scale: float, softcap: float | None, kv_scales: tuple[float, float], k_cache: torch.Tensor
) -> tuple[float, float, float]:
    """The kernels' (qk_scale, v_scale, SOFTCAP) arguments. An FP8 cache's key scale multiplies every score,
    so it joins the softmax scale (and its value scale the output) instead of each key and value; other
    caches hold the values themselves, whatever scales the checkpoint brought."""
    k_scale, v_scale = kv_scales if is_fp8(k_cache) else (1.0, 1.0)
    if softcap:
        return scale * k_scale, v_scale, float(softcap)
    return scale * k_scale * LOG2E, v_scale, 0.0


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, num_blocks: int, block_size: int, num_sms: int
) -> int:
    """Splits per (sequence, KV head) for a decode batch whose longest context spans num_blocks blocks.

    1 when the (sequence, KV head) programs already give every SM DECODE_PROGRAMS_PER_SM of them; else
    enough splits to get there, but no more than the longest context has KV tiles (per
    DECODE_MIN_TILES_PER_SPLIT) nor DECODE_MAX_SPLITS, each bound rounded down to a power of two. Each
    split count is a kernel of its own (NUM_SPLITS is a compile-time constant), so the powers of two keep
    them to six, all compiled at start-up. Tiles are counted at DECODE_BLOCK_N tokens (an FP8 cache's tiles
    are twice as wide, so its shortest contexts may leave a split empty).
    Pure and deterministic, so a CUDA graph captured for a batch shape can fix it.
    """
    programs = max(1, num_seqs * num_kv_heads)
    target = DECODE_PROGRAMS_PER_SM * max(1, num_sms)
    if programs >= target:
        return 1
    tiles = math.ceil(max(1, num_blocks) * block_size / DECODE_BLOCK_N)
    wanted = min(math.ceil(target / programs), tiles // DECODE_MIN_TILES_PER_SPLIT, DECODE_MAX_SPLITS)
    return 1 << (max(1, wanted).bit_length() - 1)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    num_splits: int = 1,
    *,
    softcap: float | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """q: [seqs, heads, head_dim], one query per sequence at position seq_len - 1 -> [seqs, heads, head_dim].
    `softcap`: attention logit soft-cap (None or 0: off). `kv_scales`: an FP8 cache's (key, value) scales
    (the caches hold e4m3; any other cache dtype must be q's, and ignores them).

    block_tables: [seqs, width] (any row stride); seq_lens: [seqs] (any stride), each >= 1. Launches depend
    only on shapes and num_splits (no host sync), so this can be captured in a CUDA graph.
    """
    seqs, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.empty((seqs, heads, head_dim), dtype=q.dtype, device=q.device)
    if seqs == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    stride_block, stride_token, stride_kv_head = _cache_strides(k_cache, v_cache, q)
    head_dim_pad = _head_dim_pad(head_dim)
    block_n = _tile(DECODE_BLOCK_N, head_dim_pad, q.dtype)
    kv_fp8 = is_fp8(k_cache)
    if kv_fp8:
        block_n *= 2  # 1-byte rows: twice the tokens for a tile's bytes (H200: 16 % faster at 8k context)
    num_splits = max(1, num_splits)
    if num_splits == 1:
        acc = m = l = out  # the kernel writes the output directly; m and l are unused
    else:
        acc = torch.empty((seqs, heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        m = torch.empty((seqs, heads, num_splits), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
    qk_scale, v_scale, cap = _kernel_scales(scale, softcap, kv_scales, k_cache)
    _decode_kernel[(seqs, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, acc, m, l, qk_scale, v_scale, sliding_window or 0,
        q.stride(0), q.stride(1), block_tables.stride(0), seq_lens.stride(0),
        stride_block, stride_token, stride_kv_head, out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, SOFTCAP=cap, IEEE=q.dtype == torch.float32, KV_FP8=kv_fp8,
        **pdl.launch_args(q),
        num_warps=DECODE_NUM_WARPS, num_stages=DECODE_NUM_STAGES,
    )  # fmt: skip
    if num_splits > 1:
        _combine_kernel[(seqs, heads)](
            m, l, acc, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            **pdl.launch_args(q),
            num_warps=1 if head_dim_pad <= 128 else 2, num_stages=1,
        )  # fmt: skip
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None,
    *,
    softcap: float | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """One sequence's prefill chunk, causal: q [chunk_len, heads, head_dim] holds positions context_len ..
    context_len + chunk_len - 1, whose keys/values are already in the cache with all earlier context;
    block_table [blocks] covers them all. -> [chunk_len, heads, head_dim]. `softcap` and `kv_scales` as
    for decode."""
    chunk_len, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty((chunk_len, heads, head_dim), dtype=q.dtype, device=q.device)
    if chunk_len == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    block_table = block_table.contiguous()
    stride_block, stride_token, stride_kv_head = _cache_strides(k_cache, v_cache, q)
    head_dim_pad = _head_dim_pad(head_dim)
    block_m = _tile(PREFILL_BLOCK_M, head_dim_pad, q.dtype)
    qk_scale, v_scale, cap = _kernel_scales(scale, softcap, kv_scales, k_cache)
    _prefill_kernel[(triton.cdiv(chunk_len, block_m), heads)](
        q, k_cache, v_cache, block_table, out, qk_scale, v_scale, sliding_window or 0, context_len,
        chunk_len,
        q.stride(0), q.stride(1), stride_block, stride_token, stride_kv_head,
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=_tile(PREFILL_BLOCK_N, head_dim_pad, q.dtype), SOFTCAP=cap,
        IEEE=q.dtype == torch.float32, KV_FP8=is_fp8(k_cache),
        num_warps=PREFILL_NUM_WARPS, num_stages=PREFILL_NUM_STAGES,
    )  # fmt: skip
    return out
