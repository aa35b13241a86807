"""Column-, row-, QKV- and merged-column-parallel linear layers.

Column-parallel layers split the output features across ranks (no communication); row-parallel layers
split the input features and all-reduce the partial sums. Each parameter's `weight_loader(param, source,
shard_id)` narrows the full checkpoint tensor to this rank's slice, reading only that slice from disk.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tp_runtime.distributed import TPGroup


class TensorSource(Protocol):
    """A checkpoint tensor that can be read in parts (see loader.CheckpointTensor)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...

    def full(self) -> torch.Tensor: ...


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint tensor for {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows; each rank holds out_features / tp rows."""

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        shard_offsets: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        # Per logical output (q/k/v, gate/up): local size and the start row of this rank's slice.
        self.local_sizes = out_sizes
        self.shard_offsets = shard_offsets or [tp.rank * s for s in out_sizes]
        total = sum(out_sizes)
        self.weight = _param((total, in_features), dtype, device)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        if bias:
            self.bias: nn.Parameter | None = _param((total,), dtype, device)
            self.bias.weight_loader = self._load  # type: ignore[attr-defined]
        else:
            self.bias = None

    def _load(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        size = self.local_sizes[shard_id]
        start = sum(self.local_sizes[:shard_id])
        data = source.narrow(0, self.shard_offsets[shard_id], size)
        _copy_checked(param.data.narrow(0, start, size), data, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs (gate and up projections) in one matmul."""

    def __init__(
        self,
        in_features: int,
        out_features: list[int],
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        local = [divide(o, tp.world_size) for o in out_features]
        super().__init__(in_features, local, bias, tp, dtype, device)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. With fewer KV heads than ranks, KV heads are replicated: ranks
    rank*kv/tp .. share one KV head, as in vLLM."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_local_heads = divide(num_heads, tp.world_size)
        if num_kv_heads >= tp.world_size:
            self.num_local_kv_heads = divide(num_kv_heads, tp.world_size)
            kv_head_start = tp.rank * self.num_local_kv_heads
        else:
            self.num_local_kv_heads = 1
            kv_head_start = tp.rank // divide(tp.world_size, num_kv_heads)
        q_size = self.num_local_heads * head_dim
        kv_size = self.num_local_kv_heads * head_dim
        offsets = [tp.rank * q_size, kv_head_start * head_dim, kv_head_start * head_dim]
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, tp, dtype, device, offsets)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) + b with W split by input columns."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.local_in = divide(in_features, tp.world_size)
        self.weight = _param((out_features, self.local_in), dtype, device)
        self.weight.weight_loader = self._load_weight  # type: ignore[attr-defined]
        if bias:
            self.bias: nn.Parameter | None = _param((out_features,), dtype, device)
            self.bias.weight_loader = self._load_bias  # type: ignore[attr-defined]
        else:
            self.bias = None

    def _load_weight(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        data = source.narrow(1, self.tp.rank * self.local_in, self.local_in)
        _copy_checked(param.data, data, type(self).__name__)

    def _load_bias(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        _copy_checked(param.data, source.full(), type(self).__name__)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """`reduce=False`: this rank's partial sum, for a caller that all-reduces it inside the next
        kernel (a layer without bias only: the bias is added once, after the sum)."""
        if not reduce:
            if self.bias is not None:
                raise ValueError("internal: a row-parallel layer with a bias must reduce its output")
            return F.linear(x, self.weight)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        if self.bias is not None:
            y = y + self.bias
        return y
