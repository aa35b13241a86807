"""Triton kernels that fuse the small elementwise ops around the matmuls: residual add + RMSNorm, rotary
embedding, SiLU-and-mul.

In a decode step these ops run on a handful of rows, so each PyTorch op is a kernel launch that moves
almost no data: a Llama layer issued ~40 of them, ~1,300 per 8B step and ~40 % of a batch-1 step's device
time. Each kernel here does one of those groups in one pass and rounds intermediate results to the model
dtype exactly where the PyTorch code (and transformers) does, so only the order of the RMSNorm sum differs.
Only used on CUDA; `TRITON_INTERPRET=1` runs them on CPU tensors for testing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,  # read and overwritten with x + residual when HAS_RESIDUAL
    weight_ptr,
    out_ptr,
    x_stride,
    residual_stride,
    out_stride,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the add rounds to the model dtype
        tl.store(residual_ptr + row * residual_stride + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    normed = (h * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """weight * RMSNorm(x [+ residual]); with a residual, it is updated in place to x + residual first."""
    rows, n_cols = x.shape
    out = torch.empty_like(x)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x, x if residual is None else residual, weight, out,
            x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0), n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols),
        )  # fmt: skip
    return out


@triton.jit
def _rotary_kernel(
    x_ptr,  # [tokens, heads, head_dim], rotated in place; token stride given, heads contiguous
    cos_ptr,  # [tokens, head_dim] float32
    sin_ptr,
    x_stride,
    table_stride,
    heads,
    half,
    HALF_BLOCK: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    h = tl.arange(0, HEADS_BLOCK)[:, None]
    d = tl.arange(0, HALF_BLOCK)[None, :]
    mask = (h < heads) & (d < half)
    base = x_ptr + token * x_stride + h * (2 * half)
    x1 = tl.load(base + d, mask=mask, other=0.0)
    x2 = tl.load(base + half + d, mask=mask, other=0.0)
    dtype = x1.dtype
    # cos/sin are cast to the model dtype first, and every product and sum rounds to it, as in PyTorch.
    table = token * table_stride + d
    c1 = tl.load(cos_ptr + table, mask=d < half, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + table + half, mask=d < half, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + table, mask=d < half, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + table + half, mask=d < half, other=0.0).to(dtype).to(tl.float32)
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # rotate_half(x) = [-x2, x1]
    out1 = (a1 * c1).to(dtype).to(tl.float32) + (-a2 * s1).to(dtype).to(tl.float32)
    out2 = (a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)
    tl.store(base + d, out1.to(dtype), mask=mask)
    tl.store(base + half + d, out2.to(dtype), mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] in place (x * cos + rotate_half(x) * sin); returns x."""
    tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim or cos.stride(1) != 1 or head_dim % 2:
        raise ValueError("rotary_ needs contiguous heads and an even head_dim")
    if tokens:
        _rotary_kernel[(tokens,)](
            x, cos, sin, x.stride(0), cos.stride(0), heads, head_dim // 2,
            HALF_BLOCK=triton.next_power_of_2(head_dim // 2), HEADS_BLOCK=triton.next_power_of_2(heads),
        )  # fmt: skip
    return x


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, in_stride, out_stride, n_cols, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * in_stride + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * in_stride + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu rounds to the model dtype before the mul
    out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    n_cols = width // 2
    out = torch.empty((rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n_cols, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n_cols, BLOCK=block
        )
    return out
