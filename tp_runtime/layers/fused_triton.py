"""Triton kernels that fuse the small elementwise ops around the matmuls: residual add + RMSNorm, rotary
embedding, SiLU-and-mul (GELU-tanh-and-mul for GeGLU).

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

from tp_runtime.layers import pdl
from tp_runtime.layers.kv_fp8 import f32_reciprocal
from tp_runtime.layers.pdl import release_and_wait


@triton.jit
def fp8_scaled(v, inverse_scale, FP8_MAX: tl.constexpr):
    """v * inverse_scale (FP8_MAX / amax, one correctly rounded division a row or group) clamped to the
    e4m3 range; NaN kept (CUDA's plain max/min drop it). A correctly rounded division per element instead
    took a SiLU-mul quantization of 32 x 14,336 values 6.3 µs against 3.6 µs (H100); the product is
    within an ulp of float32 of the quotient, far below e4m3's step."""
    q = tl.maximum(v * inverse_scale, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(q, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _add_rms_norm_row(
    x, residual_row, weight_ptr, out_row, cols, mask, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr,
    scale_ptr=None, scale_index=0, QUANT: tl.constexpr = False, FP8_MAX: tl.constexpr = 448.0,
    MIN_AMAX: tl.constexpr = 1e-12,
):  # fmt: skip
    """One row: weight * RMSNorm(x [+ residual]) stored at out_row; with a residual, residual_row is
    overwritten with x + residual first. Also the tail of the fused all-reduce (allreduce_norm_triton).
    QUANT: the row (rounded to the model dtype) is quantized to FP8 instead, stored at out_row with its
    scale at scale_ptr + scale_index, by activation_quant_triton's per-row arithmetic (the next linear
    layer's W8A8 input, with no pass of its own)."""
    if HAS_RESIDUAL:
        r = tl.load(residual_row + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the add rounds to the model dtype
        tl.store(residual_row + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if UNIT_OFFSET:
        # Gemma: (1 + w) times the float32 normalised row, rounded once.
        out = (h * tl.rsqrt(var + eps) * (1.0 + w.to(tl.float32))).to(x.dtype)
    else:
        normed = (h * tl.rsqrt(var + eps)).to(x.dtype)
        out = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    if QUANT:
        v = out.to(tl.float32)
        row_max = tl.maximum(tl.max(tl.abs(v), axis=0), MIN_AMAX)
        # NaN propagates, as in activation_quant_triton (tl.max drops it).
        row_max = tl.where(tl.sum((v != v).to(tl.int32), axis=0) > 0, float("nan"), row_max)
        tl.store(scale_ptr + scale_index, tl.math.div_rn(row_max, FP8_MAX))
        q = fp8_scaled(v, tl.math.div_rn(FP8_MAX, row_max), FP8_MAX)
        tl.store(out_row + cols, q.to(out_row.dtype.element_ty), mask=mask)
    else:
        tl.store(out_row + cols, out, mask=mask)


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
    UNIT_OFFSET: tl.constexpr,
    scale_ptr=None,  # with QUANT: [rows] float32, each row's FP8 scale
    QUANT: tl.constexpr = False,
    FP8_MAX: tl.constexpr = 448.0,
    MIN_AMAX: tl.constexpr = 1e-12,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (layers/pdl.py)
):
    release_and_wait(PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride past 2**31 in a long step must not wrap
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    _add_rms_norm_row(
        x, residual_ptr + row * residual_stride, weight_ptr, out_ptr + row * out_stride, cols, mask, n_cols,
        eps, HAS_RESIDUAL, UNIT_OFFSET, scale_ptr, row, QUANT, FP8_MAX, MIN_AMAX,
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> torch.Tensor:
    """weight * RMSNorm(x [+ residual]); with a residual, it is updated in place to x + residual first.
    `unit_offset`: (1 + weight) * RMSNorm in float32, rounded once (layers/norm.py GemmaRMSNorm)."""
    out = torch.empty_like(x)
    launch_add_rms_norm(x, weight, eps, residual, unit_offset, out)
    return out


def launch_add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    unit_offset: bool,
    out: torch.Tensor,
    fp8_scale: torch.Tensor | None = None,
    fp8_max: float = 448.0,
    min_amax: float = 1e-12,
) -> None:
    """The add + RMSNorm kernel into `out`; with `fp8_scale` ([rows, 1] float32) each row is quantized to
    FP8 into `out` instead (activation_quant_triton.rms_norm_quantized)."""
    rows, n_cols = x.shape
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x, x if residual is None else residual, weight, out,
            x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0), n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols), UNIT_OFFSET=unit_offset,
            scale_ptr=fp8_scale, QUANT=fp8_scale is not None, FP8_MAX=fp8_max, MIN_AMAX=min_amax,
            **pdl.launch_args(x),
        )  # fmt: skip


@triton.jit
def _rope_cos_sin(cos_row, sin_row, half, HALF_BLOCK: tl.constexpr, dtype: tl.constexpr):
    """One token's cos/sin rows as [1, HALF_BLOCK] halves, cast to the model dtype first (as PyTorch's
    `cos.to(x.dtype)`), then held in float32 for the arithmetic."""
    d = tl.arange(0, HALF_BLOCK)[None, :]
    mask = d < half
    c1 = tl.load(cos_row + d, mask=mask, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_row + half + d, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin_row + d, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_row + half + d, mask=mask, other=0.0).to(dtype).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rope_heads_(row, heads, half, c1, c2, s1, s2, HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr):
    """Rotate one token's `heads` contiguous heads at `row` in place (x * cos + rotate_half(x) * sin);
    returns the rotated halves [HEADS_BLOCK, HALF_BLOCK] (model dtype), masked lanes 0."""
    h = tl.arange(0, HEADS_BLOCK)[:, None]
    d = tl.arange(0, HALF_BLOCK)[None, :]
    mask = (h < heads) & (d < half)
    ptrs = row + h * (2 * half) + d
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + half, mask=mask, other=0.0)
    dtype = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # rotate_half(x) = [-x2, x1]; every product and the sum round to the model dtype, as in PyTorch.
    out1 = ((a1 * c1).to(dtype).to(tl.float32) + (-a2 * s1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)).to(dtype)
    tl.store(ptrs, out1, mask=mask)
    tl.store(ptrs + half, out2, mask=mask)
    return out1, out2


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
    token = tl.program_id(0).to(tl.int64)  # token * stride past 2**31 must not wrap
    table = token * table_stride
    c1, c2, s1, s2 = _rope_cos_sin(cos_ptr + table, sin_ptr + table, half, HALF_BLOCK, x_ptr.dtype.element_ty)
    _rope_heads_(x_ptr + token * x_stride, heads, half, c1, c2, s1, s2, HEADS_BLOCK, HALF_BLOCK)


def _check_rotary_operand(x: torch.Tensor, cos: torch.Tensor, name: str) -> None:
    tokens, _, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim or head_dim % 2:
        raise ValueError(f"{name} needs contiguous heads and an even head_dim, got strides {x.stride()}")
    if cos.shape != (tokens, head_dim) or cos.stride(1) != 1:
        raise ValueError(f"cos/sin must be [{tokens}, {head_dim}] with unit column stride")


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] in place (x * cos + rotate_half(x) * sin); returns x."""
    tokens, heads, head_dim = x.shape
    _check_rotary_operand(x, cos, "rotary_")
    if sin.stride() != cos.stride():
        raise ValueError("cos and sin must have the same strides")
    if tokens:
        _rotary_kernel[(tokens,)](
            x, cos, sin, x.stride(0), cos.stride(0), heads, head_dim // 2,
            HALF_BLOCK=triton.next_power_of_2(head_dim // 2), HEADS_BLOCK=triton.next_power_of_2(heads),
            # No a * c + b * s contracted into one FMA (also in bf16/fp16: the compiler drops the product's
            # rounding there): on an H200 that left ~1/4 of the elements one step off PyTorch in every dtype.
            enable_fp_fusion=False,
        )  # fmt: skip
    return x


@triton.jit
def _rotary_and_cache_kernel(
    q_ptr,  # [tokens, heads, head_dim], rotated in place
    k_ptr,  # [tokens, kv_heads, head_dim], rotated in place and stored to k_cache
    v_ptr,  # [tokens, kv_heads, head_dim], read only, stored to v_cache
    cos_ptr,  # [tokens, head_dim] float32
    sin_ptr,
    k_cache_ptr,  # [slots, kv_heads, head_dim] (the [blocks, block_size, ...] cache seen flat)
    v_cache_ptr,
    slots_ptr,  # [tokens] flat slot = block * block_size + offset; < 0: no cache write
    q_stride,
    k_stride,
    v_stride,
    table_stride,
    k_slot_stride,
    v_slot_stride,
    heads,
    kv_heads,
    half,
    k_inv_scale,  # FP8 caches store k * k_inv_scale, v * v_inv_scale (saturated), as kv_fp8.quantize
    v_inv_scale,
    HALF_BLOCK: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
    KV_HEADS_BLOCK: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    release_and_wait(PDL)
    token = tl.program_id(0).to(tl.int64)  # token * stride past 2**31 must not wrap
    table = token * table_stride
    c1, c2, s1, s2 = _rope_cos_sin(cos_ptr + table, sin_ptr + table, half, HALF_BLOCK, q_ptr.dtype.element_ty)
    _rope_heads_(q_ptr + token * q_stride, heads, half, c1, c2, s1, s2, HEADS_BLOCK, HALF_BLOCK)
    k_row = k_ptr + token * k_stride
    k1, k2 = _rope_heads_(k_row, kv_heads, half, c1, c2, s1, s2, KV_HEADS_BLOCK, HALF_BLOCK)

    slot = tl.load(slots_ptr + token).to(tl.int64)
    h = tl.arange(0, KV_HEADS_BLOCK)[:, None]
    d = tl.arange(0, HALF_BLOCK)[None, :]
    mask = (h < tl.where(slot >= 0, kv_heads, 0)) & (d < half)  # a negative slot writes no head
    offs = h * (2 * half) + d
    k_dst = k_cache_ptr + slot * k_slot_stride + offs
    v_src = v_ptr + token * v_stride + offs
    v_dst = v_cache_ptr + slot * v_slot_stride + offs
    v1 = tl.load(v_src, mask=mask)
    v2 = tl.load(v_src + half, mask=mask)
    if KV_FP8:
        k1, k2 = _fp8_kv(k1, k_inv_scale), _fp8_kv(k2, k_inv_scale)
        v1, v2 = _fp8_kv(v1, v_inv_scale), _fp8_kv(v2, v_inv_scale)
    tl.store(k_dst, k1, mask=mask)
    tl.store(k_dst + half, k2, mask=mask)
    tl.store(v_dst, v1, mask=mask)
    tl.store(v_dst + half, v2, mask=mask)


@triton.jit
def _fp8_kv(x, inv_scale):
    y = x.to(tl.float32) * inv_scale
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")


def _check_cache(cache: torch.Tensor, like: torch.Tensor, name: str) -> None:
    _, block_size, kv_heads, head_dim = cache.shape
    dtype_ok = cache.dtype in (like.dtype, torch.float8_e4m3fn)
    if (kv_heads, head_dim) != like.shape[1:] or not dtype_ok or cache.device != like.device:
        raise ValueError(f"{name} {tuple(cache.shape)} {cache.dtype} does not fit k/v {tuple(like.shape)}")
    if cache.stride(3) != 1 or cache.stride(2) != head_dim or cache.stride(0) != block_size * cache.stride(1):
        raise ValueError(f"{name} must be addressable by flat slot, got strides {cache.stride()}")


def rotary_and_cache_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Rotary embedding of q and k plus the KV-cache write, in one launch (one program per token).

    In place: q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] are rotated
    (x * cos + rotate_half(x) * sin, rounded exactly as `rotary_` and the PyTorch ops round), and rotated
    k and v (unchanged) are written to k_cache/v_cache [num_blocks, block_size, kv_heads, head_dim] at
    flat slot `slots[t]` (= block * block_size + offset), like `write_kv`. A token whose slot is negative
    is rotated but not cached. k stays rotated so a prefill chunk can attend over its own keys. FP8 caches
    (float8_e4m3fn) store k / k_scale and v / v_scale of `kv_scales`, the same bytes as `write_kv`.

    q, k, v may be views into the fused QKV projection output (any token stride, contiguous heads and
    dims); cos/sin are [tokens, head_dim] float32 with unit column stride. Checks only tensor metadata,
    so it never syncs with the device and can be captured in a CUDA graph.
    """
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_rotary_operand(x, cos, name)
    if k.shape != v.shape or k.shape[::2] != q.shape[::2] or not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit together")
    if sin.stride() != cos.stride():
        raise ValueError("cos and sin must have the same strides")
    _check_cache(k_cache, k, "k_cache")
    _check_cache(v_cache, v, "v_cache")
    if slots.shape != (tokens,) or slots.dtype not in (torch.int32, torch.int64) or not slots.is_contiguous():
        raise ValueError(f"slots must be a contiguous [{tokens}] int32/int64 tensor")
    if tokens:
        _rotary_and_cache_kernel[(tokens,)](
            q, k, v, cos, sin, k_cache, v_cache, slots,
            q.stride(0), k.stride(0), v.stride(0), cos.stride(0), k_cache.stride(1), v_cache.stride(1),
            heads, kv_heads, head_dim // 2, f32_reciprocal(kv_scales[0]), f32_reciprocal(kv_scales[1]),
            HALF_BLOCK=triton.next_power_of_2(head_dim // 2), HEADS_BLOCK=triton.next_power_of_2(heads),
            KV_HEADS_BLOCK=triton.next_power_of_2(kv_heads), KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
            **pdl.launch_args(q),
            enable_fp_fusion=False,  # as in rotary_
        )  # fmt: skip


@triton.jit
def to_float16_clamped(x):
    """x in float16, magnitudes past its 65504 clamped rather than made infinite (float16 holds every
    bfloat16 value of magnitude 6e-5 to 65504 exactly). FP8 operands multiply in float16 where they meet a
    bfloat16 one: e4m3 becomes float16 in one instruction, bfloat16 only through float32."""
    return tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


@triton.jit
def silu_mul_value(gate, up):
    """silu(gate) * up in the model dtype of `gate`: F.silu rounds to the model dtype before the mul."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _gelu_tanh_mul_value(gate, up):
    """gelu_tanh(gate) * up in the model dtype of `gate`, F.gelu rounding before the mul.
    0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3): no cancellation near
    1 + tanh(u) = 0, and no tanh (libdevice's does not run in the interpreter). More exact than PyTorch's
    formula where the gate is very negative (there 1 + tanh(u) cancels)."""
    g = gate.to(tl.float32)
    u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    e = tl.exp(tl.minimum(-2.0 * u, 80.0))  # capped: no inf (the result is ~0 there either way)
    act = (g / (1.0 + e)).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _gated_act_and_mul_kernel(
    gate_up_ptr, out_ptr, in_stride, out_stride, n_cols, GELU_TANH: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    release_and_wait(PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride past 2**31 in a long step must not wrap
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * in_stride + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * in_stride + n_cols + cols, mask=mask, other=0.0)
    if GELU_TANH:
        out = _gelu_tanh_mul_value(gate, up)
    else:
        out = silu_mul_value(gate, up)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


def _gated_act_and_mul(gate_up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    rows, width = gate_up.shape
    n_cols = width // 2
    out = torch.empty((rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if rows:
        _gated_act_and_mul_kernel[(rows, triton.cdiv(n_cols, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n_cols, GELU_TANH=gelu_tanh, BLOCK=block,
            **pdl.launch_args(gate_up),
        )
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of the merged [rows, 2 * n] gate|up output."""
    return _gated_act_and_mul(gate_up, gelu_tanh=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate, tanh approximation) * up of the merged [rows, 2 * n] gate|up output."""
    return _gated_act_and_mul(gate_up, gelu_tanh=True)
