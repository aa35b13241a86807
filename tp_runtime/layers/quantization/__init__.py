"""How a linear layer stores, loads and multiplies its weight: a `LinearMethod`, chosen once at start-up
from the model's QuantConfig (`linear_method`). The layers in layers/linear.py own the tensor-parallel
cut (which rows or columns of a checkpoint tensor this rank holds, a `Shard`); the method owns the weight's
layout, how a checkpoint slice becomes that layout, and the matmul. Model files only pass the method on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from tp_runtime.errors import ConfigError
from tp_runtime.layers.normed_input import NormedInput, as_tensor

if TYPE_CHECKING:
    from tp_runtime.config import QuantConfig
    from tp_runtime.distributed import TPGroup
    from tp_runtime.layers.linear import Matmul, TensorSource

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor one rank's layer holds. dim 0 (column-parallel): rows
    [start, start + length) of the tensor, at rows [dst_start, dst_start + length) of the layer's weight
    (a fused layer holds several tensors, one after another); dim 1 (row-parallel): columns
    [start, start + length), every row."""

    dim: int
    start: int
    length: int
    dst_start: int = 0


class WeightHolder(Protocol):
    """What a LinearMethod's loaders need of a layer: its weight (and whatever else create_weights made)
    and its TP group. A linear layer, or one expert's part of a stacked expert weight (layers/moe.py),
    which also says `shards_may_cut_blocks` (its rows may start inside a checkpoint's scale block: the
    scales are stored per row, and experts loaded that way before they were kept FP8)."""

    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def tp(self) -> TPGroup: ...


class QuantizableLinear(WeightHolder, Protocol):
    """What a LinearMethod needs of its layer (layers/linear.py)."""

    @property
    def matmul(self) -> Matmul: ...


def tensor_name(source: TensorSource) -> str:
    return str(getattr(source, "name", "a checkpoint tensor"))


def check_finite_scale(scale: torch.Tensor, what: str) -> None:
    """ConfigError where FP8 weight scales hold NaN or infinity (every output of the layer would be NaN) or
    a negative value (no quantizer writes one: the scale is the amax over 448)."""
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise ConfigError(
            f"{what} holds NaN, infinite or negative FP8 scales; the checkpoint is corrupt: download it again"
        )


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint tensor for {what} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    if src.dtype in FP8_DTYPES and dst.dtype not in FP8_DTYPES:
        raise ConfigError(
            f"{what} got an FP8 tensor, but this layer is not FP8: the checkpoint's quantization_config "
            "does not cover it"
        )
    dst.copy_(src)


def shard_rows(weight: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The part of `weight` that `shard` fills."""
    return weight.narrow(0, shard.dst_start, shard.length) if shard.dim == 0 else weight


class LinearMethod:
    """Unquantized: the weight in the model dtype, multiplied by the layer's Matmul (cuBLAS, or the
    Triton decode kernels)."""

    quantized = False

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
        """`layer.weight` [rows, cols], or [experts, rows, cols] for a stack of experts' weights.
        `first_col`: the checkpoint column of its first column (a row-parallel shard's), for scales."""
        for stale in ("weight_scale", "scale_block_k"):  # what a quantized method made before
            if hasattr(layer, stale):
                delattr(layer, stale)
        shape = (experts, rows, cols) if experts else (rows, cols)
        layer.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

    def load_weight(self, layer: WeightHolder, source: TensorSource, shard: Shard) -> None:
        data = source.narrow(shard.dim, shard.start, shard.length)
        copy_checked(shard_rows(layer.weight.data, shard), data, tensor_name(source))

    def load_scale(
        self, layer: WeightHolder, source: TensorSource, shard: Shard, weight_shape: tuple[int, ...]
    ) -> None:
        raise ConfigError(
            f"{tensor_name(source)} is a weight scale, but its layer is not quantized: the checkpoint's "
            "quantization_config does not match its tensors"
        )

    def apply(
        self,
        layer: QuantizableLinear,
        x: torch.Tensor | NormedInput,
        bias: torch.Tensor | None,
        silu_mul: bool = False,
    ) -> torch.Tensor:
        x = as_tensor(x)
        if silu_mul:
            return layer.matmul.silu_mul_linear(x, layer.weight, bias)
        return layer.matmul.linear(x, layer.weight, bias)


UNQUANTIZED = LinearMethod()  # stateless: shared


def linear_method(quant: QuantConfig | None, device: torch.device) -> LinearMethod:
    """The method the linear layers of a model with `quant` use on `device`."""
    if quant is None:
        return UNQUANTIZED
    from tp_runtime.layers.quantization.fp8 import Fp8LinearMethod

    return Fp8LinearMethod.for_device(quant, device)
