"""FP8 linear layers: float8_e4m3fn weights with float32 scales, from an FP8 checkpoint or quantized at load.

Weight layout (every scale scheme alike): `weight` [rows, cols] e4m3 and `weight_scale` [rows,
cdiv(cols, scale_block_k)] float32, the value of weight[n, k] being weight[n, k] * weight_scale[n, k //
scale_block_k]. Per-channel and per-tensor scales have one column (scale_block_k = cols; a per-tensor
scale is repeated over its tensor's rows, so q, k and v of a fused layer keep their own); block scales
are repeated over their block's rows, so a fused layer's parts need not start on a block boundary and a
kernel finds a row's scales at a fixed stride. That costs 4 bytes per 128 weights (3 %) of extra reads.

The matmul is `Fp8Kernels`, picked from the device: on the CPU the dequantized weight in the compute dtype
(what the tests compare against transformers running the same dequantized weights); on CUDA a weight-only
Triton kernel for one row (decode at batch 1: the weight's bytes are the step's cost) and FP8 tensor
cores for more (a Triton FP8 GEMM or torch._scaled_mm, with dynamic activation scales made by one Triton
kernel: per token, or per token and scale block for block-scaled weights); see CudaFp8Kernels.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tp_runtime.config import FP8_E4M3_MAX, QuantConfig
from tp_runtime.errors import ConfigError
from tp_runtime.layers.activation import silu_and_mul
from tp_runtime.layers.normed_input import NormedInput, as_tensor
from tp_runtime.layers.quantization import (
    FP8_DTYPES,
    LinearMethod,
    QuantizableLinear,
    Shard,
    WeightHolder,
    check_finite_scale,
    copy_checked,
    shard_rows,
    tensor_name,
)

if TYPE_CHECKING:
    from tp_runtime.layers.linear import TensorSource

FP8 = torch.float8_e4m3fn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block_k: int, dtype: torch.dtype) -> torch.Tensor:
    """weight * scale (repeated over its block of columns) in float32, rounded once to `dtype`; the
    last two dimensions are a weight's (rows, columns), any before them a stack of weights."""
    w = weight.to(torch.float32)
    if scale.shape[-1] == 1:
        return (w * scale).to(dtype)
    return (w * scale.repeat_interleave(block_k, dim=-1)[..., : w.shape[-1]]).to(dtype)


def quantize_rows(data: torch.Tensor, row_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scales amax / 448 (1 for an all-zero row) and data / scale rounded to e4m3."""
    scale = torch.where(row_amax > 0, row_amax / FP8_E4M3_MAX, torch.ones_like(row_amax))
    q = (data.to(torch.float32) / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8)
    return q, scale


def check_scale_shape(
    config: QuantConfig, name: str, shape: tuple[int, ...], weight_shape: tuple[int, ...]
) -> None:
    """ConfigError unless `shape` is that of the scales of a checkpoint weight of `weight_shape` (full,
    unsharded): one value per tensor, one per output row, or [cdiv(rows, bn), cdiv(cols, bk)] blocks."""
    rows, cols = weight_shape
    scheme = config.weight_scales
    if scheme == "block":
        block_n, block_k = config.block_size or (1, 1)
        want: tuple[int, ...] = (_cdiv(rows, block_n), _cdiv(cols, block_k))
    else:
        want = (1,) if scheme == "tensor" else (rows,)
    if scheme == "block":
        shape_ok = tuple(shape) == want
    else:  # per row: [rows], or [rows, 1] / [1, rows] as the tools write them; per tensor: any one value
        shape_ok = math.prod(shape) == math.prod(want) and (scheme == "tensor" or rows in shape)
    if not shape_ok:
        raise ConfigError(
            f"{name} has shape {list(shape)}; {scheme} FP8 scales of a {list(weight_shape)} weight have "
            f"shape {list(want)}"
        )


class Fp8Kernels:
    """The reference matmul (CPU): dequantize, then F.linear in the compute dtype."""

    def linear(
        self,
        x: torch.Tensor | NormedInput,
        weight: torch.Tensor,
        scale: torch.Tensor,
        block_k: int,
        bias: torch.Tensor | None,
        silu_mul: bool,
    ) -> torch.Tensor:
        x = as_tensor(x)
        if silu_mul:
            x = silu_and_mul(x)
        return F.linear(x, dequantize(weight, scale, block_k, x.dtype), bias)


# Rows up to which per-row-scaled weights under bfloat16 take the Triton FP8 GEMM rather than
# torch._scaled_mm: at 17-64 rows it took 12.1-45.3 µs a Llama-3-8B layer against 17.0-49.7 for
# _scaled_mm; at 512 rows _scaled_mm was faster on every layer (BENCHMARKS.md, "GPU: FP8").
FP8_TRITON_GEMM_MAX_ROWS = 64
# Rows up to which weights without the Triton GEMM (GPUs other than sm90/sm100) stay weight-only:
# _scaled_mm with per-token activations only pays from about there.
FP8_WEIGHT_ONLY_MAX_ROWS = 16
# Output tiles a split-K GEMM call may have (default_config splits only calls whose tiles fill under
# half the SMs).
_SPLIT_K_LOCKS = 4096


class CudaFp8Kernels(Fp8Kernels):
    """One row: the weight-only Triton kernel (layers/skinny_gemm_triton.py), which reads the FP8 weight
    once and dequantizes in registers. More rows: W8A8 on FP8 tensor cores, x quantized by one Triton
    kernel (activation_quant_triton.py) per row, or per row and scale block for block-scaled weights
    (at 2 and 16 rows it took a Llama-3-8B layer set 15-20 % less time than the weight-only few-rows
    kernel; at one row the weight-only kernel was faster on every Llama-3-8B and 70B layer but one:
    BENCHMARKS.md, "GPU: FP8"); torch._scaled_mm (cuBLASLt) multiplies per-row-scaled weights
    under bfloat16 x past FP8_TRITON_GEMM_MAX_ROWS rows, the Triton FP8 GEMM (fp8_gemm_triton.py) the
    rest. Without the Triton GEMM (other than sm90/sm100) the weight-only kernels take up to
    FP8_WEIGHT_ONLY_MAX_ROWS rows. What neither takes (x not 2-D, scale blocks narrower than an FP8
    MMA's K, GPUs without FP8 tensor cores: before sm89) stays on the weight-only kernels as far as they
    go, and is dequantized past them."""

    def __init__(
        self,
        num_sms: int,
        triton_gemm: bool = True,
        fp8_mma: bool = True,
        device: torch.device | None = None,
    ) -> None:
        self.num_sms = num_sms
        # FP8 tensor cores (sm89+): without them no W8A8 path runs, only the weight-only kernels.
        self.fp8_mma = fp8_mma
        # The Triton GEMM's launch shapes are Hopper's (FP8 MMAs, shared memory for 5 stages).
        self.triton_gemm = triton_gemm and fp8_mma
        # Split-K's tile counters: zero between calls, shared by the calls of one stream (one engine).
        self.split_k_locks = (
            None if device is None else torch.zeros(_SPLIT_K_LOCKS, dtype=torch.int32, device=device)
        )

    @classmethod
    def for_device(cls, device: torch.device) -> CudaFp8Kernels:
        props = torch.cuda.get_device_properties(device)
        return cls(
            props.multi_processor_count,
            triton_gemm=props.major in (9, 10),  # its launch shapes need sm90/sm100's shared memory
            fp8_mma=(props.major, props.minor) >= (8, 9),
            device=device,
        )

    def linear(
        self,
        x: torch.Tensor | NormedInput,
        weight: torch.Tensor,
        scale: torch.Tensor,
        block_k: int,
        bias: torch.Tensor | None,
        silu_mul: bool,
    ) -> torch.Tensor:
        from tp_runtime.layers import skinny_gemm_triton as kernels  # Triton: imported where it runs
        from tp_runtime.layers.quantization import activation_quant_triton as aq

        # A deferred norm (NormedInput) has its input's shape and dtype.
        normed = x if isinstance(x, NormedInput) else None
        like = x.x if isinstance(x, NormedInput) else x
        rows = like.shape[0] if like.dim() == 2 else -1
        n, k = weight.shape
        per_row = scale.shape[1] == 1
        # _scaled_mm takes bfloat16 output with per-row scales, and sizes in multiples of 16.
        scaled_mm = (
            self.fp8_mma
            and like.dim() == 2
            and per_row
            and like.dtype == torch.bfloat16
            and not (n % 16 or k % 16)
        )
        triton_gemm = (
            self.triton_gemm
            and like.dim() == 2
            and (per_row or (block_k >= 32 and not block_k & (block_k - 1)))
        )
        w8a8 = scaled_mm or triton_gemm
        if triton_gemm:
            weight_only_rows = 1
        else:
            weight_only_rows = FP8_WEIGHT_ONLY_MAX_ROWS if scaled_mm else kernels.MAX_FEW_ROWS
        fuse_norm = w8a8 and rows > weight_only_rows and per_row and not silu_mul
        if normed is not None and normed.norm.fused and fuse_norm:
            # The norm's kernel quantizes its own rows: no pass of the activation quantization.
            return self._w8a8(*normed.quantized(), like.dtype, rows, weight, scale, block_k, bias, scaled_mm)
        x = as_tensor(x)
        if 1 <= rows <= weight_only_rows:
            if rows == 1:
                if silu_mul:
                    # Its own kernel first: inside the one-row kernel every program recomputed the SiLU-mul
                    # of the whole row (a 70B shard's down projection: 101.7 µs there, 84.0 µs for both
                    # kernels apart on an H100; BENCHMARKS.md, "GPU: FP8"). The same rounding either way.
                    x = silu_and_mul(x, fused=True)
                return kernels.skinny_linear(
                    x, weight, bias, num_sms=self.num_sms, scale=scale, scale_block_k=block_k
                )
            if silu_mul:
                x = silu_and_mul(x, fused=True)
            cfg = kernels.fp8_few_rows_config(weight.shape[0], rows, self.num_sms)
            return kernels.few_rows_linear(x, weight, bias, cfg, scale=scale, scale_block_k=block_k)
        if not w8a8:
            if silu_mul:
                x = silu_and_mul(x, fused=True)
            return super().linear(x, weight, scale, block_k, bias, silu_mul=False)
        # The activation's quantization applies the SiLU-mul itself (one kernel, one pass over x).
        x = x if x.stride(1) == 1 else x.contiguous()
        if per_row:
            xq, x_scale = aq.quantize_rows_fp8(x, silu_mul=silu_mul)
        else:
            xq, x_scale = aq.quantize_groups_fp8(x, block_k, silu_mul=silu_mul)
        return self._w8a8(xq, x_scale, x.dtype, rows, weight, scale, block_k, bias, scaled_mm)

    def _w8a8(
        self,
        xq: torch.Tensor,
        x_scale: torch.Tensor,
        dtype: torch.dtype,
        rows: int,
        weight: torch.Tensor,
        scale: torch.Tensor,
        block_k: int,
        bias: torch.Tensor | None,
        scaled_mm: bool,
    ) -> torch.Tensor:
        """The FP8 tensor-core product of quantized activations: _scaled_mm past
        FP8_TRITON_GEMM_MAX_ROWS rows (or without the Triton GEMM), else the Triton GEMM."""
        from tp_runtime.layers.quantization.fp8_gemm_triton import fp8_gemm

        if scaled_mm and (rows > FP8_TRITON_GEMM_MAX_ROWS or not self.triton_gemm):
            w_scale = scale.reshape(1, weight.shape[0])
            # Fast accumulation (the FP8 MMA's partial sums not promoted to float32 every few K steps), as
            # Triton's FP8 dots on sm90 do by default: the 8B layer set at 8,192 rows took 10 % less time
            # (BENCHMARKS.md, "GPU: FP8"); e4m3 activations' own rounding (2^-4) dwarfs its error.
            out = torch._scaled_mm(
                xq, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=dtype, use_fast_accum=True
            )
            return out if bias is None else out + bias
        bias = None if bias is None else bias.contiguous()
        return fp8_gemm(
            xq, x_scale, weight, scale, block_k, dtype, bias, num_sms=self.num_sms, locks=self.split_k_locks
        )


class Fp8LinearMethod(LinearMethod):
    quantized = True

    def __init__(self, config: QuantConfig, kernels: Fp8Kernels) -> None:
        self.config = config
        self.kernels = kernels
        self.online = config.checkpoint_format == "online"

    @classmethod
    def for_device(cls, config: QuantConfig, device: torch.device) -> Fp8LinearMethod:
        if device.type == "cuda":
            return cls(config, CudaFp8Kernels.for_device(device))
        return cls(config, Fp8Kernels())

    def create_weights(
        self,
        layer: nn.Module,
        rows: int,
        cols: int,
        dtype: torch.dtype,
        device: torch.device,
        experts: int = 0,
        first_col: int = 0,
    ) -> None:
        """`first_col`: the checkpoint column of the layer's first column (a row-parallel shard). Where it
        falls inside a scale block, the stored scales are finer than the checkpoint's (the largest power of
        two dividing it), each repeating its block's scale, so the shard's columns start on one."""
        block_k = self.config.block_size[1] if self.config.block_size else cols
        if self.config.block_size and first_col % block_k:
            block_k = first_col & -first_col
        stack = (experts,) if experts else ()
        layer.weight = nn.Parameter(
            torch.empty((*stack, rows, cols), dtype=FP8, device=device), requires_grad=False
        )
        scale = torch.ones((*stack, rows, _cdiv(cols, block_k)), dtype=torch.float32, device=device)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        setattr(layer, "scale_block_k", block_k)  # noqa: B010 - a plain int attribute of an nn.Module

    def load_weight(self, layer: WeightHolder, source: TensorSource, shard: Shard) -> None:
        data = source.narrow(shard.dim, shard.start, shard.length)
        name = tensor_name(source)
        rows = shard_rows(layer.weight.data, shard)
        if data.dtype in FP8_DTYPES:
            if data.dtype != FP8:
                raise ConfigError(f"{name} is {data.dtype}; only float8_e4m3fn FP8 weights are supported")
            if self.online:
                raise ConfigError(
                    f"{name} is stored in FP8, but quantization='fp8' quantizes a 16- or 32-bit checkpoint "
                    "at load and this one has no quantization_config to give its scales; use the checkpoint "
                    "it was made from"
                )
            copy_checked(rows, data, name)
            return
        # Dummy weights (load_format="dummy") are made in the model dtype for any checkpoint: quantized here
        # as online quantization does, one scale a row, which any FP8 layout of scales holds.
        if not self.online and not getattr(source, "synthetic", False):
            raise ConfigError(
                f"{name} is {getattr(source, 'stored_dtype', data.dtype)}, but the checkpoint's "
                "quantization_config makes its layer FP8 (name "
                "the module in the config's ignore list, or re-export the checkpoint)"
            )
        # On the layer's device: a checkpoint's slice is read on the host, and NCCL reduces device tensors.
        data = data.to(layer.weight.device)
        amax = data.abs().amax(dim=1).to(torch.float32)
        if shard.dim == 1 and layer.tp.world_size > 1:
            # Every rank holds some columns of each row: one scale per whole row, as at TP=1.
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        q, scale = quantize_rows(data, amax)
        copy_checked(rows, q, name)
        shard_rows(_scale(layer), shard).copy_(scale[:, None])

    def load_scale(
        self, layer: WeightHolder, source: TensorSource, shard: Shard, weight_shape: tuple[int, ...]
    ) -> None:
        """`weight_shape`: the full (unsharded) shape of the checkpoint weight the scales belong to."""
        name = tensor_name(source)
        if self.online:
            raise ConfigError(f"{name}: a weight scale in a checkpoint being quantized at load")
        target = shard_rows(_scale(layer), shard)
        shape = tuple(source.shape)
        scheme = self.config.weight_scales
        check_scale_shape(self.config, name, shape, weight_shape)
        if scheme == "tensor":
            value = source.full().to(torch.float32).reshape(-1)
            if value.numel() != 1:
                raise ConfigError(f"{name} has shape {list(shape)}; a per-tensor FP8 scale has one value")
            target.fill_(value.item())
        elif scheme == "channel":
            # Whole (one value a row: small), so that every layout of them ([rows], [rows, 1], [1, rows])
            # is read alike.
            part = source.full().reshape(-1)
            if shard.dim == 0 and part.numel() == weight_shape[0]:
                part = part.narrow(0, shard.start, shard.length)
            if part.numel() != target.shape[0]:
                raise ConfigError(
                    f"{name} has shape {list(shape)}; per-channel FP8 scales have one value per output row"
                )
            target.copy_(part.to(torch.float32).reshape(-1, 1))
        else:
            block_n, block_k = self.config.block_size or (1, 1)
            stored_k: int = getattr(layer, "scale_block_k")  # noqa: B009 - set by create_weights
            cuts_rows = shard.dim == 0 and shard.start % block_n
            if (cuts_rows and not getattr(layer, "shards_may_cut_blocks", False)) or (
                shard.dim == 1 and shard.start % stored_k
            ):
                raise ConfigError(
                    f"{name}: this rank's part of the weight starts inside a {block_n}x{block_k} FP8 scale "
                    "block; use a tensor_parallel_size whose shards are whole blocks"
                )
            if len(shape) != 2:
                raise ConfigError(f"{name} has shape {list(shape)}; FP8 block scales are 2-d")
            if shard.dim == 0:
                first = shard.start // block_n
                blocks = source.narrow(0, first, _cdiv(shard.start + shard.length, block_n) - first)
                offset = shard.start - first * block_n
                part = blocks.to(torch.float32).repeat_interleave(block_n, dim=0)
                part = part[offset : offset + shard.length]
            else:
                # Each stored scale's checkpoint block (the same one for stored_k-wide parts of a block).
                first = shard.start // block_k
                blocks = source.narrow(1, first, _cdiv(shard.start + shard.length, block_k) - first)
                parents = (shard.start + torch.arange(target.shape[1]) * stored_k) // block_k - first
                part = blocks.to(torch.float32)[:, parents]
                part = part.repeat_interleave(block_n, dim=0)[: target.shape[0]]
            if part.shape != target.shape:
                raise ConfigError(
                    f"{name} has shape {list(shape)}, which does not tile its weight in "
                    f"{block_n}x{block_k} blocks"
                )
            target.copy_(part)
        check_finite_scale(target, name)

    def apply(
        self,
        layer: QuantizableLinear,
        x: torch.Tensor | NormedInput,
        bias: torch.Tensor | None,
        silu_mul: bool = False,
    ) -> torch.Tensor:
        block_k: int = getattr(layer, "scale_block_k")  # noqa: B009 - set by create_weights
        return self.kernels.linear(x, layer.weight, _scale(layer), block_k, bias, silu_mul)


def _scale(layer: WeightHolder) -> torch.Tensor:
    scale: torch.Tensor = getattr(layer, "weight_scale")  # noqa: B009 - set by create_weights
    return scale
