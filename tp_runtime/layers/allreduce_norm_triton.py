"""All-reduce + residual add + RMSNorm in one kernel over symmetric memory (peer GPUs' buffers mapped into
each other's address space): the step that follows every row-parallel layer of a decoder at TP > 1.

One program per row. It stores its row of this rank's partial sums straight into every rank's buffer
(slot `rank`), waits until every slot of its own buffer holds a row, sums the slots in float32 (ranks in
order 0..world-1, so every rank gets the same bits), rounds the sum to the model dtype (as an all-reduce
returns it), then adds the residual and normalises with the add + RMSNorm kernel's own row code
(`_add_rms_norm_row`, layers/fused_triton.py). It replaces an all-reduce kernel and an add + RMSNorm kernel.

No signals: an empty slot holds -0.0 in every element, and a row has arrived when none of its elements is
-0.0 (a sender turns its -0.0s into +0.0, which changes no sum but the sign of an exact zero). Each row
rotates over three regions by its call count (`epochs`, this rank's, kept modulo 3). A call refills the
region its row used in the previous call with -0.0, for the call after next:

    Peers write a row's region r again only in call k + 3, once they have finished call k + 2, which
    needs this rank's row of call k + 2, sent after its kernel of call k + 1 (which refilled r) ended.
    And this rank reads region r in call k + 3 only after that refill, so it never sees call k's rows.

Every rank must make the same sequence of fused calls with the same row counts, which tensor parallelism
guarantees (the layers run the same shapes on every rank), in one row layout (width and dtype) from a
synchronised start with every region empty (SymmMemAllReduce.prepare_fused_norm). A program waits for the
same row's program on each peer, so the grid must be resident at once: at most one row per SM (the
strategy's max_rows). Only CUDA runs it across GPUs; `TRITON_INTERPRET=1` runs it on CPU tensors, where a
test plays the peers by writing their rows beforehand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_runtime.layers.fused_triton import _add_rms_norm_row

REGIONS = 3


@triton.jit
def _empty_row(BLOCK: tl.constexpr, dtype: tl.constexpr, BITS: tl.constexpr):
    """A row of -0.0 (the empty marker), built from its bits."""
    if BITS == 16:
        return tl.full([BLOCK], -32768, tl.int16).to(dtype, bitcast=True)
    else:
        return tl.full([BLOCK], -2147483648, tl.int32).to(dtype, bitcast=True)


@triton.jit
def _is_empty(v, BITS: tl.constexpr):
    """Elements that hold -0.0 (the empty marker)."""
    if BITS == 16:
        return v.to(tl.int16, bitcast=True) == -32768
    else:
        return v.to(tl.int32, bitcast=True) == -2147483648


@triton.jit
def _allreduce_add_rms_norm_kernel(
    x_ptr,  # [rows, n_cols] this rank's partial sums (model dtype)
    x_stride,
    data_ptrs,  # int64 [world, 3]: the address of each rank's three regions, each [world slots, slot_elems]
    slot_elems,
    epochs_ptr,  # int32 [max_rows]: the region each row's next call uses, on this rank
    residual_ptr,  # [rows, n_cols] read, and overwritten with sum + residual
    residual_stride,
    weight_ptr,
    out_ptr,
    out_stride,
    rank,
    n_cols,
    eps,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    region = tl.load(epochs_ptr + row)
    tl.store(epochs_ptr + row, (region + 1) % 3)
    offset = row.to(tl.int64) * n_cols + cols

    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    x = tl.where(_is_empty(x, BITS), tl.zeros_like(x), x)
    for p in tl.static_range(WORLD):
        peer = tl.load(data_ptrs + p * 3 + region).to(tl.pointer_type(dtype))
        tl.store(peer + rank * slot_elems + offset, x, mask=mask)
    # Empty the row in the region of the previous call, for the call after next.
    stale = tl.load(data_ptrs + rank * 3 + (region + 2) % 3).to(tl.pointer_type(dtype))
    empty = _empty_row(BLOCK, dtype, BITS)
    for p in tl.static_range(WORLD):
        tl.store(stale + p * slot_elems + offset, empty, mask=mask)

    own = tl.load(data_ptrs + rank * 3 + region).to(tl.pointer_type(dtype))
    total = tl.zeros([BLOCK], tl.float32)
    for p in tl.static_range(WORLD):
        slot = own + p * slot_elems + offset
        v = tl.load(slot, mask=mask, other=0.0, volatile=True)
        while tl.sum((_is_empty(v, BITS) & mask).to(tl.int32), axis=0) > 0:
            v = tl.load(slot, mask=mask, other=0.0, volatile=True)
        total += v.to(tl.float32)
    x = total.to(dtype)  # the all-reduced row, rounded as the all-reduce returns it
    _add_rms_norm_row(
        x, residual_ptr + row * residual_stride, weight_ptr, out_ptr + row * out_stride, cols, mask, n_cols,
        eps, True, False,
    )  # fmt: skip


def allreduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    rank: int,
    world_size: int,
    data_ptrs: torch.Tensor,
    slot_elems: int,
    epochs: torch.Tensor,
) -> torch.Tensor:
    """weight * RMSNorm(all_reduce(x) + residual); `residual` is updated in place to all_reduce(x) +
    residual. x and residual are [rows, n_cols] with unit column stride, in a 16- or 32-bit float dtype;
    rows <= len(epochs) and rows * n_cols <= slot_elems (the caller checks both)."""
    rows, n_cols = x.shape
    out = torch.empty_like(x)
    if rows:
        _allreduce_add_rms_norm_kernel[(rows,)](
            x, x.stride(0), data_ptrs, slot_elems, epochs, residual, residual.stride(0), weight, out,
            out.stride(0), rank, n_cols, eps, WORLD=world_size, BLOCK=triton.next_power_of_2(n_cols),
            BITS=8 * x.element_size(),
            num_warps=4,  # as rms_norm's launch: the same reduction order, so the same bits
        )  # fmt: skip
    return out
