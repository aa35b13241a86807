"""All-reduce + residual add + RMSNorm in one kernel over symmetric memory (peer GPUs' buffers mapped into
each other's address space): the step that follows every row-parallel layer of a decoder at TP > 1.

One program per row. It copies its row of this rank's partial sums into this rank's symmetric buffer,
signals every peer, waits for every peer's signal, reads the row from every rank's buffer and sums it in
float32 (ranks in order 0..world-1, so every rank gets the same bits), rounds the sum to the model dtype
(as an all-reduce returns it), then adds the residual and normalises exactly as `_add_rms_norm_kernel`
(layers/fused_triton.py). It replaces an all-reduce kernel (two barriers) and an add + RMSNorm kernel.

Signals are epochs, not flags: each rank counts, per row, the calls that touched that row (`epochs`, in
its own memory) and a call's signal is that count stored into the peer's flag slot for (row, this rank).
A program waits until each peer's slot for its row has reached its own count. Rows alternate between two
data regions by the parity of that count, so a call never needs a closing barrier:

    A rank writes a row's region r again only in call k + 2 (for that row). Before that it waited in call
    k + 1 for every peer's signal, which a peer sends only after its call k, and every read of region r in
    it, has finished (kernels on a stream run in order).

Counts are int32 and compared by wrapping difference, so they may overflow. Every rank must make the same
sequence of fused calls with the same row counts, which tensor parallelism guarantees (the layers run the
same shapes on every rank). The argument holds per row only while rows keep their byte range: one row
width and dtype (SymmMemAllReduce declines another layout until every rank has synchronised). A program
waits for the same row's program on each peer, so the grid must be resident at once: at most one row per
SM (the strategy's max_rows). Only CUDA runs it across GPUs; `TRITON_INTERPRET=1` runs it on CPU tensors,
where a test plays the peers by filling their buffers and signals beforehand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _allreduce_add_rms_norm_kernel(
    x_ptr,  # [rows, n_cols] this rank's partial sums (model dtype)
    x_stride,
    data_ptrs,  # int64 [world, 2]: the address of each rank's two data regions
    flag_ptrs,  # int64 [world]: the address of each rank's flag slots, int32 [max_rows, world]
    epochs_ptr,  # int32 [max_rows] this rank's per-row call counts
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
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    epoch = tl.load(epochs_ptr + row) + 1
    tl.store(epochs_ptr + row, epoch)
    region = epoch & 1
    offset = row.to(tl.int64) * n_cols + cols

    own = tl.load(data_ptrs + rank * 2 + region).to(tl.pointer_type(dtype))
    tl.store(own + offset, tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0), mask=mask)
    # Every thread's copy is done before the signal, whose release makes it visible to the peers.
    tl.debug_barrier()
    for p in tl.static_range(WORLD):
        peer_flags = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(peer_flags + row * WORLD + rank, epoch, sem="release", scope="sys")
    own_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        # A peer may already be one call further on: wait until its count is at least ours.
        while tl.atomic_add(own_flags + row * WORLD + p, 0, sem="acquire", scope="sys") - epoch < 0:
            pass
    tl.debug_barrier()

    total = tl.zeros([BLOCK], tl.float32)
    for p in tl.static_range(WORLD):
        peer = tl.load(data_ptrs + p * 2 + region).to(tl.pointer_type(dtype))
        total += tl.load(peer + offset, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
    x = total.to(dtype)  # the all-reduced row, rounded as the all-reduce returns it

    r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
    x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # the add rounds to the model dtype
    tl.store(residual_ptr + row * residual_stride + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    normed = (h * tl.rsqrt(var + eps)).to(dtype)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


def allreduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    rank: int,
    world_size: int,
    data_ptrs: torch.Tensor,
    flag_ptrs: torch.Tensor,
    epochs: torch.Tensor,
) -> torch.Tensor:
    """weight * RMSNorm(all_reduce(x) + residual); `residual` is updated in place to all_reduce(x) +
    residual. x and residual are [rows, n_cols] with unit column stride; rows <= len(epochs) and each
    data region holds at least rows * n_cols elements (the caller checks both)."""
    rows, n_cols = x.shape
    out = torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(n_cols)
        _allreduce_add_rms_norm_kernel[(rows,)](
            x, x.stride(0), data_ptrs, flag_ptrs, epochs, residual, residual.stride(0), weight, out,
            out.stride(0), rank, n_cols, eps, WORLD=world_size, BLOCK=block,
            num_warps=4,  # as rms_norm's launch: the same reduction order, so the same bits
        )  # fmt: skip
    return out
