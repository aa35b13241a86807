"""Attention over the paged KV cache, behind one small interface chosen once per model runner.

`AttentionMetadata` is built once per step by the model runner (or the decode graphs) and shared by every
layer; it carries the backend object the runner chose at start-up. Keys/values of the step are written into
their cache slots before attention runs. Decode tokens (one query per sequence) come first in the batch and
run as one batched call; a continuation chunk (one with context in the cache) runs its own call, and fresh
prompts run in batches of similar lengths (below).

Backends:
- `TorchAttention` (any device): decode gathers each sequence's blocks and runs one SDPA, query heads
  grouped per KV head so keys are never repeated; prefill chunks run SDPA over their gathered blocks.
- `TritonAttention` (CUDA; CPU tensors under TRITON_INTERPRET=1): split-KV paged decode that reads the
  cache blocks in place, splitting each context across programs when the batch alone cannot fill the
  GPU; continuation prefill chunks run a paged prefill kernel.
Either way, fresh prompts (nothing cached before them) in a layer with no sliding window and no soft-cap
attend to their own keys (no cache read), by a `FreshPromptAttention` chosen at start-up: on CUDA, where
FlashAttention's varlen kernel takes the model's dtype and head_dim, every fresh prompt of a step in one
varlen call over the packed tokens (`PackedVarlen`: no padding, and no per-shape set-up, where SDPA on
Hopper picks cuDNN, which builds a plan for every new shape); elsewhere, and for steps of 4,096 fresh
tokens or more, causal SDPA batched: prompts of similar length run as one [prompts, heads, longest, d]
call (`FreshPromptBatch`), which fills the GPU where one call per prompt would not (eight 1000-token
prompts: 155 us in one call against 355 us in eight on an H200).

The sliding window and the attention logit soft-cap (scores -> cap * tanh(scores / cap), before masking,
as Gemma 2) are properties of the layer, which passes them to `paged_attention`: layers of one model may
differ (Gemma 2 alternates windowed and global layers). SDPA has no soft-cap, so with one the PyTorch paths
compute the scores explicitly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from tp_runtime.layers import kv_fp8


@dataclass
class PrefillChunk:
    start: int  # token range of this chunk in the step's batch
    end: int
    context_len: int  # tokens of the sequence already in the cache before this chunk
    block_table: torch.Tensor  # [blocks] covering context_len + chunk length tokens


@dataclass
class FreshPromptBatch:
    """Fresh prompts attended in one causal SDPA call as a [prompts, heads, max_len, d] batch, each padded on
    the right to the longest. The padding is exact under the causal mask: a query never sees the keys after
    it, and the padding's own query rows are dropped."""

    max_len: int
    starts: list[int]  # each prompt's first token in the step's batch
    lengths: list[int]
    # [prompts * max_len] the batch token behind each padded row; None when the prompts have one length and
    # lie back to back in the batch, so the padded batch is a view of it.
    gather: torch.Tensor | None = None
    tokens: torch.Tensor | None = None  # [sum(lengths)] the prompts' tokens in the step's batch...
    padded_rows: torch.Tensor | None = None  # ... and each one's row in the padded batch


# A prompt joins a fresh-prompt batch while it is at least this share of the batch's longest prompt, so
# padding adds at most 1 / FRESH_BATCH_MIN_FILL**2 - 1 (31 %) to a prompt's attention work.
FRESH_BATCH_MIN_FILL = 7 / 8


def fresh_prompt_batches(chunks: list[PrefillChunk], device: torch.device) -> list[FreshPromptBatch]:
    """The step's fresh chunks (context_len 0), every one in exactly one batch: longest first, each batch
    taking prompts while they reach FRESH_BATCH_MIN_FILL of its first."""
    fresh = sorted(
        ((c.end - c.start, c.start) for c in chunks if c.context_len == 0), key=lambda f: -f[0]
    )  # stable: equal lengths keep their batch order, so back-to-back prompts stay a view

    def to_device(array: np.ndarray) -> torch.Tensor:
        # Pageable memory: the driver stages the copy before returning, so the array may go at once.
        return torch.from_numpy(array).to(device, non_blocking=True)

    batches = []
    i = 0
    while i < len(fresh):
        longest = fresh[i][0]
        j = i + 1
        while j < len(fresh) and fresh[j][0] >= FRESH_BATCH_MIN_FILL * longest:
            j += 1
        lengths = [n for n, _ in fresh[i:j]]
        starts = [s for _, s in fresh[i:j]]
        batch = FreshPromptBatch(max_len=longest, starts=starts, lengths=lengths)
        back_to_back = all(s == starts[0] + k * longest for k, s in enumerate(starts))
        if min(lengths) != longest or not back_to_back:
            offsets = np.arange(longest)
            first = np.asarray(starts)[:, None]
            batch.gather = to_device((first + np.minimum(offsets, np.asarray(lengths)[:, None] - 1)).ravel())
            batch.tokens = to_device(
                np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
            )
            batch.padded_rows = to_device(
                np.concatenate([np.arange(k * longest, k * longest + n) for k, n in enumerate(lengths)])
            )
        batches.append(batch)
        i = j
    return batches


@dataclass
class FreshPromptsPacked:
    """A step's fresh prompts packed back to back (in batch order) for one varlen attention call."""

    start: int  # when `rows` is None: the prompts lie back to back in batch rows [start, end)
    end: int
    rows: torch.Tensor | None  # [tokens] else: the batch row of each packed token
    cu_seqlens: torch.Tensor  # [prompts + 1] int32: each prompt's first packed token, then the total
    max_len: int
    num_tokens: int
    same_lengths: bool = False  # two or more prompts, all of one length


def pack_fresh_prompts(chunks: list[PrefillChunk], device: torch.device) -> FreshPromptsPacked:
    fresh = [(c.start, c.end) for c in chunks if c.context_len == 0]
    lengths = [end - start for start, end in fresh]
    cu = np.zeros(len(fresh) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    cu_seqlens = torch.from_numpy(cu).to(device, non_blocking=True)
    first = fresh[0][0] if fresh else 0
    same = len(lengths) > 1 and len(set(lengths)) == 1
    if all(start == first + int(cu[i]) for i, (start, _) in enumerate(fresh)):
        total = int(cu[-1])
        longest = max(lengths, default=0)
        return FreshPromptsPacked(first, first + total, None, cu_seqlens, longest, total, same)
    rows = np.concatenate([np.arange(start, end) for start, end in fresh])
    return FreshPromptsPacked(0, 0, torch.from_numpy(rows).to(device, non_blocking=True), cu_seqlens,
                              max(lengths), int(cu[-1]), same)  # fmt: skip


class FreshPromptAttention(Protocol):
    """How fresh prompts attend to their own keys in a layer with no window and no soft-cap: causal,
    written into their rows of `out`. Chosen once at start-up."""

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float,
        out: torch.Tensor,
    ) -> None: ...  # fmt: skip


class PaddedSDPA:
    """Prompts of similar length in one causal SDPA call each (`FreshPromptBatch`). Works anywhere; on
    Hopper torch picks cuDNN, which builds an execution plan for every new shape (66 ms once)."""

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float,
        out: torch.Tensor,
    ) -> None:  # fmt: skip
        for batch in meta.fresh_batches:
            _fresh_batch_attention(q, k, v, batch, scale, out)


# (q [tokens, heads, d], k, v [tokens, kv_heads, d], cu_seqlens [n + 1] int32, max_len, scale) -> like q
VarlenKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


class PackedVarlen:
    """Every fresh prompt in one varlen call over the packed tokens (no padding, no per-shape set-up):
    FlashAttention's varlen kernel, whose cost depends only on the work (0.10 ms for a first-seen length
    against 0.08 ms for a repeat, where cuDNN's SDPA takes 66 ms, on an H200).

    A step of `padded_from_tokens` fresh tokens or more whose prompts all have one length runs padded SDPA
    instead: cuDNN's Hopper kernel is faster once its plan for a shape exists (1,000 tokens: 0.06 against
    0.11 ms a layer, 27 ms over a batch-32, 1,000-token prefill), and such a batch is a shape that comes
    back (fixed-length batches), so its plan, 66 ms once, pays. Prompts of mixed lengths make a new padded
    shape nearly every step: on an H200, 256 prompts of 100-1,000 tokens in steps of 8,192 tokens took
    11.6 s on their first pass and 5.5 s on the next, the difference mostly plans. (So in bf16 a prompt's
    output may differ in the last bits with the step it prefills in.)"""

    def __init__(self, kernel: VarlenKernel, *, padded_from_tokens: int = 4096) -> None:
        self.kernel = kernel
        self.padded = PaddedSDPA()
        self.padded_from_tokens = padded_from_tokens

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float,
        out: torch.Tensor,
    ) -> None:  # fmt: skip
        packed = meta.fresh_packed
        if packed.max_len == 0:
            return
        if packed.num_tokens >= self.padded_from_tokens and packed.same_lengths:
            self.padded(q, k, v, meta, scale, out)
            return
        if packed.rows is None:
            rows = slice(packed.start, packed.end)
            out[rows] = self.kernel(q[rows], k[rows], v[rows], packed.cu_seqlens, packed.max_len, scale)
            return
        pick = packed.rows
        attended = self.kernel(
            q.index_select(0, pick), k.index_select(0, pick), v.index_select(0, pick), packed.cu_seqlens,
            packed.max_len, scale,
        )  # fmt: skip
        out.index_copy_(0, pick, attended)


def flash_varlen_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int, group: int
) -> VarlenKernel | None:
    """FlashAttention's varlen forward, which takes fewer KV heads than query heads natively, where this
    torch and GPU run it for `dtype` and `head_dim`; None elsewhere. aten's op is called directly: torch's
    public `varlen_attn` wraps it (and takes `enable_gqa` only from torch 2.13) at a cost per call. It is
    checked once, on two sequences of different lengths with two KV heads, against SDPA."""
    forward = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or forward is None:
        return None

    def kernel(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
    ) -> torch.Tensor:
        return forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)[0]

    try:
        g = torch.Generator(device=device).manual_seed(0)
        lengths = (5, 11)
        q, k, v = (
            torch.randn((sum(lengths), heads, head_dim), generator=g, device=device, dtype=dtype)
            for heads in (2 * group, 2, 2)
        )
        cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device=device)
        got = kernel(q, k, v, cu, max(lengths), head_dim**-0.5)
        torch.cuda.synchronize(device)
        for a, b in ((0, lengths[0]), (lengths[0], sum(lengths))):
            qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
            want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True).transpose(0, 1)
            if not torch.allclose(got[a:b].float(), want.float(), atol=2e-2, rtol=2e-2):
                return None
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    return kernel


@dataclass
class AttentionMetadata:
    backend: AttentionBackend
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each token's key/value
    num_decode_tokens: int  # the first tokens of the batch: one query per decoding sequence
    decode_block_tables: torch.Tensor | None = None  # [num_decode, blocks] (padding: block 0)
    decode_seq_lens: torch.Tensor | None = None  # [num_decode] context length after this step
    decode_num_splits: int = 1  # split-KV programs per (sequence, KV head), fixed per batch shape
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Set while the mixed-step graphs record or run their pieces (worker/mixed_graphs.py): every layer's
    # attention call goes to it instead, and it returns the tensor that will hold the attention output.
    piece_boundary: AttentionBoundary | None = None

    @cached_property
    def fresh_packed(self) -> FreshPromptsPacked:
        """The prefills with context_len 0 as one varlen batch; made by the first layer that asks."""
        return pack_fresh_prompts(self.prefills, self.slot_mapping.device)

    @cached_property
    def fresh_batches(self) -> list[FreshPromptBatch]:
        """The prefills with context_len 0, batched (every fresh chunk in one); made by the first layer
        that asks, so a model whose layers all window or soft-cap never builds them."""
        return fresh_prompt_batches(self.prefills, self.slot_mapping.device)


class AttentionBoundary(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float, window: int | None, softcap: float | None, kv_scales: tuple[float, float],
    ) -> torch.Tensor: ...  # fmt: skip


class AttentionBackend(Protocol):
    fresh_prompts: FreshPromptAttention
    # Whether decode reads a row's whole block table, padding included (the gather path), rather than
    # stopping at the row's length: the decode graphs pad tables more finely when it does.
    reads_table_padding: bool

    def num_decode_splits(self, num_seqs: int, num_blocks: int) -> int:
        """Split-KV programs per (sequence, KV head) for a decode batch whose longest context spans
        `num_blocks` cache blocks (a pure function of the shape, so CUDA graphs can capture it)."""
        ...

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """q: [num_decode, heads, d] -> [num_decode, heads, d]. `kv_scales`: the layer's (key, value)
        scales, applied where the caches are FP8 (layers/kv_fp8.py)."""
        ...

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk: PrefillChunk,
        window: int | None,
        scale: float,
        softcap: float | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """A continuation chunk (or any chunk under a sliding window or soft-cap whose block table the
        runner gave): q [chunk, heads, d], whose keys and values are already in the cache with the context
        before them -> [chunk, heads, d]."""
        ...


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:  # fmt: skip
    """Caches are [num_blocks, block_size, kv_heads, head_dim]; k/v are [num_tokens, kv_heads, head_dim].
    FP8 caches store k / k_scale and v / v_scale (layers/kv_fp8.py)."""
    for cache, x, scale in ((k_cache, k, kv_scales[0]), (v_cache, v, kv_scales[1])):
        if kv_fp8.is_fp8(cache):
            x = kv_fp8.quantize(x, scale)
        kv_fp8.as_bytes(cache).view(-1, *cache.shape[2:]).index_copy_(0, slots, kv_fp8.as_bytes(x))


def _gather(
    cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype, scale: float
) -> torch.Tensor:
    """[seqs, blocks] -> [seqs, kv_heads, blocks * block_size, head_dim] in `dtype` (an FP8 cache
    dequantized with its `scale`)."""
    seqs, blocks = block_tables.shape
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    # index_select copies whole contiguous blocks, much faster than advanced indexing's per-element gather.
    rows = kv_fp8.as_bytes(cache).view(num_blocks, -1).index_select(0, block_tables.reshape(-1))
    if kv_fp8.is_fp8(cache):
        rows = kv_fp8.dequantize(rows.view(cache.dtype), scale, dtype)
    return rows.view(seqs, blocks * block_size, kv_heads, head_dim).transpose(1, 2)


def _allowed(q_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[queries, keys] True where a query at q_pos may attend to a key at key_pos (causal + window)."""
    mask = key_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > q_pos[:, None] - window
    return mask


class TorchAttention:
    """Gathered blocks + SDPA; runs anywhere. Masks are built on the device from the sequence lengths."""

    reads_table_padding = True

    def __init__(self, fresh: FreshPromptAttention | None = None) -> None:
        self.fresh_prompts: FreshPromptAttention = fresh or PaddedSDPA()

    def num_decode_splits(self, num_seqs: int, num_blocks: int) -> int:
        return 1

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        tables, seq_lens = meta.decode_block_tables, meta.decode_seq_lens
        assert tables is not None and seq_lens is not None, "internal: decode metadata missing"
        keys = _gather(k_cache, tables, q.dtype, kv_scales[0])
        values = _gather(v_cache, tables, q.dtype, kv_scales[1])
        key_pos = torch.arange(keys.shape[2], device=q.device)
        # Row i's query sits at position seq_lens[i] - 1; a padding row attends to key 0 only.
        mask = _allowed(seq_lens - 1, key_pos, window)
        if softcap is not None:
            return _sdpa(q.unsqueeze(2), keys, values, mask[:, None, None, :], scale, softcap).squeeze(2)
        # GQA without repeating keys: the query heads sharing a KV head become that head's query rows
        # (head h uses KV head h // group, as transformers' repeat_kv lays them out).
        seqs, heads, d = q.shape
        grouped = q.view(seqs, keys.shape[1], heads // keys.shape[1], d)
        out = F.scaled_dot_product_attention(
            grouped, keys, values, attn_mask=mask[:, None, None, :], scale=scale
        )
        return out.reshape(seqs, heads, d)

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk: PrefillChunk,
        window: int | None,
        scale: float,
        softcap: float | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        keys = _gather(k_cache, chunk.block_table.unsqueeze(0), q.dtype, kv_scales[0])
        values = _gather(v_cache, chunk.block_table.unsqueeze(0), q.dtype, kv_scales[1])
        n = q.shape[0]
        q_pos = torch.arange(chunk.context_len, chunk.context_len + n, device=q.device)
        mask = _allowed(q_pos, torch.arange(keys.shape[2], device=q.device), window)
        out = _sdpa(q.transpose(0, 1).unsqueeze(0), keys, values, mask[None, None], scale, softcap)
        return out[0].transpose(0, 1)


class TritonAttention:
    """Triton kernels that read the cache blocks in place (layers/paged_decode_triton.py)."""

    reads_table_padding = False

    def __init__(
        self, num_kv_heads: int, block_size: int, num_sms: int, split_kv: bool,
        fresh: FreshPromptAttention | None = None,
    ) -> None:  # fmt: skip
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.num_sms = num_sms
        self.split_kv = split_kv
        self.fresh_prompts: FreshPromptAttention = fresh or PaddedSDPA()

    def num_decode_splits(self, num_seqs: int, num_blocks: int) -> int:
        if not self.split_kv:
            return 1
        from tp_runtime.layers.paged_decode_triton import choose_num_splits

        return choose_num_splits(num_seqs, self.num_kv_heads, num_blocks, self.block_size, self.num_sms)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        from tp_runtime.layers.paged_decode_triton import paged_decode_attention

        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        return paged_decode_attention(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale, window,
            meta.decode_num_splits, softcap=softcap, kv_scales=kv_scales,
        )  # fmt: skip

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk: PrefillChunk,
        window: int | None,
        scale: float,
        softcap: float | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        from tp_runtime.layers.paged_decode_triton import paged_prefill_attention

        return paged_prefill_attention(
            q, k_cache, v_cache, chunk.block_table, chunk.context_len, scale, window, softcap=softcap,
            kv_scales=kv_scales,
        )  # fmt: skip


def make_attention_backend(
    choice: str, device: torch.device, num_kv_heads: int, block_size: int, *, num_heads: int | None = None,
    head_dim: int | None = None, dtype: torch.dtype | None = None,
) -> AttentionBackend:  # fmt: skip
    """`choice` from config.ATTENTION_BACKENDS. "auto": split-KV Triton on CUDA when Triton is installed, else
    PyTorch. "triton_one_split": the Triton kernels with one program per (sequence, KV head). With the
    Triton kernels, fresh prompts run FlashAttention's varlen kernel where it takes the model's dtype and
    head_dim (given), else SDPA."""
    if choice == "auto":
        import importlib.util

        use_triton = device.type == "cuda" and importlib.util.find_spec("triton") is not None
        choice = "triton" if use_triton else "torch"
    if choice == "torch":  # PyTorch ops throughout: the reference the other paths are compared with
        return TorchAttention()
    fresh: FreshPromptAttention | None = None
    if num_heads is not None and head_dim is not None and dtype is not None:
        kernel = flash_varlen_kernel(device, dtype, head_dim, max(1, num_heads // max(1, num_kv_heads)))
        fresh = PackedVarlen(kernel) if kernel is not None else None
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return TritonAttention(num_kv_heads, block_size, num_sms, split_kv=choice == "triton", fresh=fresh)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [seqs, heads, q_len, d]; k/v: [seqs, kv_heads, kv_len, d]; mask: None (causal, q_len == kv_len)
    or boolean, broadcastable to [seqs, 1, q_len, kv_len]."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
    # Soft-capped scores, in transformers' eager order: (q @ k^T) * scale, / cap, tanh, * cap, mask,
    # softmax in float32. The query heads sharing a KV head are grouped, so keys are never repeated; query
    # rows go in slices that keep each [heads, rows, keys] temporary near _SOFTCAP_SCORES elements.
    seqs, heads, q_len, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    grouped = q.view(seqs, kv_heads, heads // kv_heads, q_len, d)
    keys_t, values = k.unsqueeze(2).transpose(-1, -2), v.unsqueeze(2)
    out = torch.empty((seqs, kv_heads, heads // kv_heads, q_len, d), dtype=q.dtype, device=q.device)
    rows = max(1, _SOFTCAP_SCORES // max(1, seqs * heads * kv_len))
    for r0 in range(0, q_len, rows):
        r1 = min(r0 + rows, q_len)
        if mask is None:  # causal, queries and keys aligned
            allowed = _allowed(
                torch.arange(r0, r1, device=q.device), torch.arange(kv_len, device=q.device), None
            )
        else:
            allowed = mask[..., r0:r1, :]
        scores = torch.matmul(grouped[..., r0:r1, :], keys_t) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed.unsqueeze(-3), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[..., r0:r1, :] = torch.matmul(probs, values)
    return out.view(seqs, heads, q_len, d)


# Score elements per slice of the soft-capped attention path (2**26: 256 MiB in float32).
_SOFTCAP_SCORES = 1 << 26


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """q: [tokens, heads, d]; k/v: this step's [tokens, kv_heads, d] (already in the cache). `window`: this
    layer's sliding window (None: the whole context); `softcap`: its attention logit soft-cap (None: off).
    `out`: where to write the result (returned), else a new tensor. `kv_scales`: the layer's (key, value)
    scales of an FP8 cache."""
    if meta.piece_boundary is not None:
        return meta.piece_boundary(q, k, v, k_cache, v_cache, scale, window, softcap, kv_scales)
    num_decode = meta.num_decode_tokens
    backend = meta.backend
    if num_decode == q.shape[0] and not meta.prefills:
        decoded = backend.decode(q, k_cache, v_cache, meta, scale, window, softcap, kv_scales)
        return decoded if out is None else out.copy_(decoded)
    if out is None:
        out = torch.empty_like(q)
    if num_decode:
        out[:num_decode] = backend.decode(
            q[:num_decode], k_cache, v_cache, meta, scale, window, softcap, kv_scales
        )
    if kv_fp8.is_fp8(k_cache) and any(chunk.context_len == 0 for chunk in meta.prefills):
        # fresh prompts read their own keys as the cache holds them
        k, v = kv_fp8.round_trip(k, kv_scales[0]), kv_fp8.round_trip(v, kv_scales[1])
    own_keys_only = window is None and softcap is None
    if own_keys_only:  # fresh prompts attend only to their own keys here (no cache read)
        backend.fresh_prompts(q, k, v, meta, scale, out)
    for chunk in meta.prefills:
        fresh = chunk.context_len == 0
        if fresh and own_keys_only:
            continue  # in a fresh-prompt batch above
        q_chunk = q[chunk.start : chunk.end]
        if fresh and chunk.block_table.numel() == 0:
            # A fresh prompt the runner gave no block table (its config has no sliding window, or the
            # memory-profiling run): its own keys, with this layer's window and soft-cap.
            chunk_out = _own_keys_attention(q_chunk, k, v, chunk, window, scale, softcap)
        else:
            chunk_out = backend.prefill(q_chunk, k_cache, v_cache, chunk, window, scale, softcap, kv_scales)
        out[chunk.start : chunk.end] = chunk_out
    return out


def _fresh_batch_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: FreshPromptBatch, scale: float,
    out: torch.Tensor,
) -> None:  # fmt: skip
    """Causal SDPA of a batch of fresh prompts over their own keys, written into their rows of `out`."""
    n, length = len(batch.starts), batch.max_len

    def padded(x: torch.Tensor) -> torch.Tensor:  # [tokens, heads, d] -> [prompts, heads, max_len, d]
        if batch.gather is None:
            x = x[batch.starts[0] : batch.starts[0] + n * length]
        else:
            x = x.index_select(0, batch.gather)
        return x.view(n, length, *x.shape[1:]).transpose(1, 2)

    attended = _sdpa(padded(q), padded(k), padded(v), None, scale).transpose(1, 2)
    if batch.gather is None:
        out[batch.starts[0] : batch.starts[0] + n * length].view(attended.shape).copy_(attended)
    else:
        assert batch.tokens is not None and batch.padded_rows is not None, "internal: batch indices missing"
        rows = attended.reshape(n * length, *attended.shape[2:]).index_select(0, batch.padded_rows)
        out.index_copy_(0, batch.tokens, rows)


def _own_keys_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunk: PrefillChunk,
    window: int | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """A fresh prompt's chunk q [n, heads, d] over the step's own keys/values of that chunk."""
    keys = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
    values = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
    mask = None
    if window is not None:
        pos = torch.arange(q.shape[0], device=q.device)
        mask = _allowed(pos, pos, window)[None, None]
    return _sdpa(q.transpose(0, 1).unsqueeze(0), keys, values, mask, scale, softcap)[0].transpose(0, 1)
