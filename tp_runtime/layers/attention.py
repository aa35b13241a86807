"""Attention over the paged KV cache, behind one small interface.

`AttentionMetadata` is built once per step by the model runner and shared by every layer. The backend here
is plain PyTorch (CPU and CUDA): keys/values of the step are written into their cache slots; decode tokens
(one query per sequence, placed first in the batch) run as one batched SDPA over each sequence's gathered
blocks; each prefill chunk runs its own SDPA, so no sequence is padded to another's length. A faster GPU
kernel can replace `paged_attention` without touching the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # token range of this chunk in the step's batch
    end: int
    # None: the chunk is a whole fresh prompt and attends to its own keys only (no cache read).
    block_table: torch.Tensor | None
    # [1, 1, chunk_len, kv_len] True where attention is allowed; None: plain causal over its own tokens.
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each token's key/value
    num_decode_tokens: int  # the first tokens of the batch: one query per decoding sequence
    decode_block_tables: torch.Tensor | None  # [num_decode, blocks] (padding: block 0)
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, blocks * block_size]
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Decode kernel: "torch" (gathered blocks + SDPA, any device) or "triton" (reads the cache blocks in
    # place; needs decode_seq_lens).
    decode_kernel: str = "torch"
    decode_seq_lens: torch.Tensor | None = None  # [num_decode] context length after this step
    sliding_window: int | None = None


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Caches are [num_blocks, block_size, kv_heads, head_dim]; k/v are [num_tokens, kv_heads, head_dim]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[seqs, blocks] -> [seqs, kv_heads, blocks * block_size, head_dim]."""
    seqs, blocks = block_tables.shape
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    # index_select copies whole contiguous blocks, much faster than advanced indexing's per-element gather.
    rows = cache.view(num_blocks, -1).index_select(0, block_tables.reshape(-1))
    return rows.view(seqs, blocks * block_size, kv_heads, head_dim).transpose(1, 2)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q: [seqs, heads, q_len, d]; k/v: [seqs, kv_heads, kv_len, d]."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [tokens, heads, d]; k/v: this step's [tokens, kv_heads, d] (already in the cache)."""
    out = torch.empty_like(q)
    num_decode = meta.num_decode_tokens
    if num_decode and meta.decode_kernel == "triton":
        from tp_runtime.layers.paged_decode_triton import paged_decode_attention

        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        out[:num_decode] = paged_decode_attention(
            q[:num_decode], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
            meta.sliding_window,
        )  # fmt: skip
    elif num_decode:
        assert meta.decode_block_tables is not None
        keys = _gather(k_cache, meta.decode_block_tables)
        values = _gather(v_cache, meta.decode_block_tables)
        # GQA without repeating keys: the query heads sharing a KV head become that head's query rows
        # (head h uses KV head h // group, as transformers' repeat_kv lays them out).
        group = q.shape[1] // keys.shape[1]
        grouped = q[:num_decode].view(num_decode, keys.shape[1], group, q.shape[2])
        decode_out = F.scaled_dot_product_attention(
            grouped, keys, values, attn_mask=meta.decode_mask, scale=scale
        )
        out[:num_decode] = decode_out.reshape(num_decode, q.shape[1], q.shape[2])
    for chunk in meta.prefills:
        q_chunk = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        if chunk.block_table is None:
            keys = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            values = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        else:
            keys = _gather(k_cache, chunk.block_table.unsqueeze(0))
            values = _gather(v_cache, chunk.block_table.unsqueeze(0))
        out[chunk.start : chunk.end] = _sdpa(q_chunk, keys, values, chunk.mask, scale)[0].transpose(0, 1)
    return out
