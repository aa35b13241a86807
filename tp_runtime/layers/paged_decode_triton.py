"""Paged decode attention as a Triton kernel: reads keys and values straight from the cache blocks.

The PyTorch path gathers every sequence's blocks into a padded copy before SDPA, which costs a write and a
second read of the whole KV context per layer. Here one program per (sequence, KV head) walks the
sequence's block table and keeps an online softmax for all query heads that share the KV head (GQA), so
the context is read once. Only used on CUDA; `TRITON_INTERPRET=1` runs it on CPU tensors for testing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [seqs, heads, head_dim]
    k_cache_ptr,  # [blocks, block_size, kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [seqs, table_width] (row stride given)
    seq_lens_ptr,  # [seqs]
    out_ptr,  # [seqs, heads, head_dim]
    scale,
    table_stride,
    window,  # <= 0: no sliding window
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to 16 for tl.dot
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IEEE: tl.constexpr,  # float32 models: exact dot products instead of TF32
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    offs = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    q = tl.load(
        q_ptr + (seq * KV_HEADS * GROUP + heads[:, None]) * HEAD_DIM + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    # With a sliding window, blocks wholly before it are skipped (same types on both sides for the compiler).
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0) // BLOCK_SIZE, 0)
    for block in range(first, tl.cdiv(seq_len, BLOCK_SIZE)):
        block_id = tl.load(block_tables_ptr + seq * table_stride + block).to(tl.int64)
        pos = block * BLOCK_SIZE + offs
        kv_offs = ((block_id * BLOCK_SIZE + offs[:, None]) * KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
        k = tl.load(k_cache_ptr + kv_offs)
        v = tl.load(v_cache_ptr + kv_offs)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        valid = (pos < seq_len) & ((window <= 0) | (pos > seq_len - 1 - window))
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / l[:, None]
    tl.store(
        out_ptr + (seq * KV_HEADS * GROUP + heads[:, None]) * HEAD_DIM + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """q: [seqs, heads, head_dim] (one query per sequence) -> [seqs, heads, head_dim]."""
    seqs, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.empty_like(q)
    q = q.contiguous()
    seq_lens = seq_lens.contiguous()  # the decode graphs pass a strided column of their input buffer
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    _paged_decode_kernel[(seqs, kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, out, scale, block_tables.stride(0),
        sliding_window or 0,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, IEEE=q.dtype == torch.float32,
    )  # fmt: skip
    return out
