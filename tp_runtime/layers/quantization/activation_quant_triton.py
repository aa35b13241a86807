"""Dynamic FP8 quantization of activations for the W8A8 matmuls (fp8.py), one Triton kernel each way:

- per token (`quantize_rows_fp8`): each row of x gets the scale amax(|row|) / 448, for weights with one
  scale per output row;
- per token and group of columns (`quantize_groups_fp8`, DeepSeek-V3's 1x128 activation blocks): one
  scale per row and `group` columns, for block-scaled weights, whose scale blocks the groups match.

amax is at least 1e-12; x is multiplied by 448 / amax, clamped to ±448 and rounded to e4m3; the scale
and that inverse are correctly rounded float32 quotients, one a row or group (`quantize_rows_fp8_reference`
is the same arithmetic in torch). The
torch expression the per-token kernel replaced was five elementwise kernels and a reduction, each a pass
over x: about 25 µs a Llama-3-8B linear layer at 32 rows on an H200, more than the FP8 matmul saved
there. Here x is read once from memory and written once as e4m3. A program holds its whole row (up to
32,768 columns) in registers, so the row is loaded, and the SiLU-mul computed, once for both its amax and
its quantized values; wider rows are read twice, split over programs of 2,048 columns below 128 rows.
On an H100 a 32 x 14,336 SiLU-mul quantization takes 4.2 µs so, against 6.9 µs split over programs
that each read the whole row for its amax and divided by the scale, and 8,192 rows 205 against 309 µs
(BENCHMARKS.md, "GPU: FP8").

`silu_mul=True` quantizes silu(gate) * up of the merged [gate | up] projection output, rounded to its
dtype as the separate SiLU-mul kernel rounds (fused_triton.silu_mul_value): the down projection's input
then never makes its own round trip through memory, nor its own launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_runtime.config import FP8_E4M3_MAX
from tp_runtime.layers import fused_triton
from tp_runtime.layers.fused_triton import fp8_scaled, silu_mul_value

# Columns one program quantizes (one iteration) and scans per iteration for the row's amax.
_SLICE = 2048
_AMAX_BLOCK = 8192
# From this many rows a row is one program's: enough programs without re-reading rows for their amax.
_ROWS_ONE_PROGRAM = 128
# The widest row such a program holds in registers (at most 32 values a thread, up to 32 warps).
_WHOLE_ROW_MAX = 32768
_MIN_AMAX = 1e-12


@triton.jit
def _load_values(x_row, k, mask, K, SILU_MUL: tl.constexpr):
    """x[k] as float32; with SILU_MUL, silu(x[k]) * x[K + k] in x's dtype (x is [gate | up])."""
    v = tl.load(x_row + k, mask=mask, other=0.0)
    if SILU_MUL:
        v = silu_mul_value(v, tl.load(x_row + K + k, mask=mask, other=0.0))
    return v.to(tl.float32)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, K, SLICE, x_stride, q_stride,
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, AMAX_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    SILU_MUL: tl.constexpr, WHOLE_ROW: tl.constexpr,
):  # fmt: skip
    """One program per (row, SLICE columns): each reads the whole row for its amax (from L2 but for the
    first) and quantizes its slice, so a few wide rows still spread over many SMs. WHOLE_ROW: one
    program per row, the row one block of AMAX_BLOCK >= K columns, quantized from the registers that
    held it for its amax."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    x_row = x_ptr + row * x_stride
    q_row = q_ptr + row * q_stride
    if WHOLE_ROW:
        k = tl.arange(0, AMAX_BLOCK)
        v = _load_values(x_row, k, k < K, K, SILU_MUL)
        row_max = tl.maximum(tl.max(tl.abs(v), axis=0), MIN_AMAX)
        row_max = tl.where(tl.sum((v != v).to(tl.int32), axis=0) > 0, float("nan"), row_max)
        tl.store(scale_ptr + row, tl.math.div_rn(row_max, FP8_MAX))
        q = fp8_scaled(v, tl.math.div_rn(FP8_MAX, row_max), FP8_MAX)
        tl.store(q_row + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
        return
    # NaN propagates, as in torch: a row holding one gets a NaN scale and NaN values, never finite ones
    # (CUDA's plain max/min return the operand that is not NaN).
    amax = tl.zeros([AMAX_BLOCK], dtype=tl.float32)
    for k_start in range(0, K, AMAX_BLOCK):
        k = k_start + tl.arange(0, AMAX_BLOCK)
        v = _load_values(x_row, k, k < K, K, SILU_MUL)
        amax = tl.maximum(amax, tl.abs(v), propagate_nan=tl.PropagateNan.ALL)
    row_max = tl.maximum(tl.max(amax, axis=0), MIN_AMAX)
    row_max = tl.where(tl.sum((amax != amax).to(tl.int32), axis=0) > 0, float("nan"), row_max)
    if part == 0:
        tl.store(scale_ptr + row, tl.math.div_rn(row_max, FP8_MAX))
    inverse_scale = tl.math.div_rn(FP8_MAX, row_max)
    first = part * SLICE
    for k_start in range(first, tl.minimum(first + SLICE, K), BLOCK_K):
        k = k_start + tl.arange(0, BLOCK_K)
        v = _load_values(x_row, k, k < K, K, SILU_MUL)
        q = fp8_scaled(v, inverse_scale, FP8_MAX)
        tl.store(q_row + k, q.to(q_ptr.dtype.element_ty), mask=k < K)


@triton.jit
def _quantize_groups_kernel(
    x_ptr, q_ptr, scale_ptr, K, NUM_GROUPS, x_stride, q_stride, scale_stride,
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
    SILU_MUL: tl.constexpr,
):  # fmt: skip
    """One program per (row, GROUPS groups of GROUP columns): the tile is [GROUPS, GROUP]."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    k = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    v = _load_values(x_ptr + row * x_stride, k, k < K, K, SILU_MUL)
    group_max = tl.maximum(tl.max(tl.abs(v), axis=1), MIN_AMAX)
    has_nan = tl.sum((v != v).to(tl.int32), axis=1) > 0  # tl.max would drop a NaN
    group_max = tl.where(has_nan, float("nan"), group_max)
    tl.store(scale_ptr + row * scale_stride + g, tl.math.div_rn(group_max, FP8_MAX), mask=g < NUM_GROUPS)
    q = fp8_scaled(v, tl.math.div_rn(FP8_MAX, group_max)[:, None], FP8_MAX)
    tl.store(q_ptr + row * q_stride + k, q.to(q_ptr.dtype.element_ty), mask=k < K)


def _check_input(x: torch.Tensor, what: str, silu_mul: bool) -> int:
    """The quantized width: x's, or half of it with silu_mul."""
    if x.dim() != 2 or x.stride(1) != 1 or not x.is_floating_point() or (silu_mul and x.shape[1] % 2):
        raise ValueError(
            f"{what} takes a 2-D float tensor contiguous along its rows (with silu_mul, [gate | up] of even "
            f"width), got {tuple(x.shape)} {x.dtype} with strides {x.stride()}"
        )
    return x.shape[1] // 2 if silu_mul else x.shape[1]


def quantize_rows_fp8(x: torch.Tensor, silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (16- or 32-bit floats, unit stride along K) -> (e4m3 [M, K], float32 scales [M, 1]).
    `silu_mul`: x is [M, 2K] = [gate | up] and silu(gate) * up is quantized."""
    k = _check_input(x, "quantize_rows_fp8", silu_mul)
    q = torch.empty((x.shape[0], k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    _launch(x, q, scale, silu_mul)
    return q, scale


def _launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, silu_mul: bool = False) -> None:
    """The kernel into `q` (e4m3; or float32, the values before their rounding to e4m3, which the
    tests read in Triton's interpreter: its e4m3 rounding is not CUDA's) and `scale`."""
    m, k = q.shape
    if m and k:
        width = triton.next_power_of_2(k)
        # float32 [gate | up] rows past half that spill registers at 32 warps: split instead.
        whole_row_max = _WHOLE_ROW_MAX // 2 if silu_mul and x.element_size() > 2 else _WHOLE_ROW_MAX
        if width <= whole_row_max:
            # Few rows: many warps a row, to spread its arithmetic; many rows: fewer, for occupancy.
            per_warp = 1024 if m >= _ROWS_ONE_PROGRAM else 256
            _quantize_rows_kernel[(m, 1)](
                x, q, scale, k, k, x.stride(0), q.stride(0),
                FP8_MAX=FP8_E4M3_MAX, MIN_AMAX=_MIN_AMAX, AMAX_BLOCK=width, BLOCK_K=width,
                SILU_MUL=silu_mul, WHOLE_ROW=True, num_warps=min(32, max(4, width // per_warp)),
            )  # fmt: skip
            return
        block_k = min(_SLICE, width)
        amax_block = min(_AMAX_BLOCK, width)
        slice_k = triton.cdiv(k, block_k) * block_k if m >= _ROWS_ONE_PROGRAM else block_k
        _quantize_rows_kernel[(m, triton.cdiv(k, slice_k))](
            x, q, scale, k, slice_k, x.stride(0), q.stride(0),
            FP8_MAX=FP8_E4M3_MAX, MIN_AMAX=_MIN_AMAX, AMAX_BLOCK=amax_block, BLOCK_K=block_k,
            SILU_MUL=silu_mul, WHOLE_ROW=False, num_warps=8 if amax_block >= 4096 else 4,
        )  # fmt: skip
    elif m:
        scale.fill_(_MIN_AMAX / FP8_E4M3_MAX)


def rms_norm_quantized(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_triton.rms_norm's row (the residual updated alike) quantized as quantize_rows_fp8 would
    quantize it, in the norm's one kernel: (e4m3 [M, K], float32 scales [M, 1])."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    _launch_norm(x, weight, eps, residual, unit_offset, q, scale)
    return q, scale


def _launch_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    unit_offset: bool,
    q: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """The norm's kernel into `q` (e4m3, or float32 values for the interpreter's tests, as _launch)."""
    fused_triton.launch_add_rms_norm(
        x, weight, eps, residual, unit_offset, q, fp8_scale=scale, fp8_max=FP8_E4M3_MAX, min_amax=_MIN_AMAX
    )


def quantize_groups_fp8(
    x: torch.Tensor, group: int, silu_mul: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, cdiv(K, group)]): one scale per row and `group`
    columns (a power of two; the last group may be short). `silu_mul`: as in quantize_rows_fp8."""
    k = _check_input(x, "quantize_groups_fp8", silu_mul)
    if group < 1 or group & (group - 1):
        raise ValueError(f"quantize_groups_fp8 takes groups of a power of two columns, got {group}")
    q = torch.empty((x.shape[0], k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((x.shape[0], -(-k // group)), dtype=torch.float32, device=x.device)
    _launch_groups(x, q, scale, group, silu_mul)
    return q, scale


def _launch_groups(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int, silu_mul: bool = False
) -> None:
    """As _launch, by groups of columns."""
    m, k = q.shape
    num_groups = scale.shape[1]
    if m and k:
        groups = min(triton.next_power_of_2(num_groups), max(1, _SLICE // group))
        _quantize_groups_kernel[(m, triton.cdiv(num_groups, groups))](
            x, q, scale, k, num_groups, x.stride(0), q.stride(0), scale.stride(0),
            FP8_MAX=FP8_E4M3_MAX, MIN_AMAX=_MIN_AMAX, GROUP=group, GROUPS=groups, SILU_MUL=silu_mul,
            num_warps=4,
        )  # fmt: skip


def quantize_rows_fp8_reference(
    x: torch.Tensor, group: int | None = None, silu_mul: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' arithmetic in torch, equal on every device. `group`: one scale per row and `group`
    columns, else per row. `silu_mul`: x is [gate | up], and F.silu(gate) * up (each rounded to x's
    dtype) is quantized."""
    if silu_mul:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    scaled, scale = fp8_scaled_reference(x, group)
    return scaled.to(torch.float8_e4m3fn), scale


def fp8_scaled_reference(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * FP8_MAX / amax clamped to ±FP8_MAX in float32, before its rounding to e4m3; the scales
    amax / FP8_MAX). Each division is done in float64 and rounded once to float32, which is the correctly
    rounded float32 quotient (torch's own division by a scalar on CUDA multiplies by the reciprocal), and
    so is the float64 product of two float32 values rounded once."""
    m, k = x.shape
    group = group or max(k, 1)
    num_groups = -(-k // group)
    padded = torch.zeros((m, num_groups * group), dtype=x.dtype, device=x.device)
    padded[:, :k] = x
    groups = padded.view(m, num_groups, group)
    amax = groups.abs().amax(dim=2).to(torch.float32).clamp_(min=_MIN_AMAX).double()
    scale = (amax / FP8_E4M3_MAX).float()
    inverse_scale = (FP8_E4M3_MAX / amax).float().double()
    scaled = (groups.double() * inverse_scale[:, :, None]).float().reshape(m, -1)[:, :k]
    return scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX), scale
