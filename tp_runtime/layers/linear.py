"""Column-, row-, QKV- and merged-column-parallel linear layers.

Column-parallel layers split the output features across ranks (no communication); row-parallel layers
split the input features and all-reduce the partial sums. Each parameter's `weight_loader(param, source,
shard_id)` narrows the full checkpoint tensor to this rank's slice, reading only that slice from disk.
How a layer multiplies is a `Matmul` the model picks once, at start-up (`use_matmul`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from tp_runtime.distributed import TPGroup
from tp_runtime.layers.activation import silu_and_mul
from tp_runtime.layers.normed_input import NormedInput
from tp_runtime.layers.quantization import UNQUANTIZED, LinearMethod, Shard, copy_checked

if TYPE_CHECKING:
    from tp_runtime.layers.skinny_gemm_triton import SkinnyConfig


class TensorSource(Protocol):
    """A checkpoint tensor that can be read in parts (see loader.CheckpointTensor)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...

    def full(self) -> torch.Tensor: ...


class Matmul:
    """y = x W^T + b for the linear layers: cuBLAS through F.linear, and the SiLU-and-mul before an MLP's down
    projection as PyTorch ops."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def silu_mul_linear(
        self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """(silu(gate) * up) W^T + b for the merged [tokens, 2 * in] gate|up projection output."""
        return F.linear(silu_and_mul(gate_up), weight, bias)

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x W^T for the LM head (its vocabulary shard): a very wide, short matmul."""
        return self.linear(x, weight, None)

    @contextmanager
    def decode_graph_pass(self) -> Iterator[None]:
        """Marks the forward passes run inside it as ones recorded into a decode CUDA graph (and its
        warm-up), where launch cost is paid once; see TritonMatmul."""
        yield


class TritonMatmul(Matmul):
    """The fused-kernel path (CUDA): a one-row product (decode at batch 1) runs the Triton one-row kernel,
    with the SiLU-and-mul folded into the down projection's; 2-32 rows the few-rows kernel where it beats
    cuBLAS (layers/skinny_gemm_triton.py); the rest cuBLAS. The SiLU-and-mul of more than one row is the
    Triton SiLU-and-mul kernel.

    `graphs_only`: the matmul kernels run only in decode-graph passes (`decode_graph_pass`: the warm-up,
    so every kernel compiles and loads before capture, and the capture); other calls (prefill, eager
    decode) keep cuBLAS, whose launch costs the host a few µs where a Triton launch costs tens: a batch-1
    prefill of 32 layers is bound by the host's launches."""

    def __init__(self, num_sms: int, graphs_only: bool, interpreted: bool = False) -> None:
        self.num_sms = num_sms
        self.graphs_only = graphs_only
        # Triton's interpreter: one-row products in 16-row tiles (the GPU's shape for wide layers) whatever
        # the width. The interpreter's cost is per program, and the GPU's 4-row tiles made the one-row
        # kernel most of an interpreted engine run; the kernel tests check the GPU's shapes themselves.
        self.interpreted = interpreted
        self._in_graph_pass = False

    @classmethod
    def for_device(cls, device: torch.device) -> TritonMatmul:
        if device.type == "cuda":
            return cls(torch.cuda.get_device_properties(device).multi_processor_count, graphs_only=True)
        # Triton's interpreter (tests): every call, with an H200's SM count for the few-rows shapes.
        return cls(132, graphs_only=False, interpreted=True)

    @contextmanager
    def decode_graph_pass(self) -> Iterator[None]:
        outer = self._in_graph_pass  # restored on exit, so a nested pass leaves the outer one on
        self._in_graph_pass = True
        try:
            yield
        finally:
            self._in_graph_pass = outer

    def _one_row(self) -> SkinnyConfig | None:
        """The one-row kernel's launch shape; None: the GPU's for each layer (default_config)."""
        from tp_runtime.layers.skinny_gemm_triton import SkinnyConfig

        return SkinnyConfig(16, 256, 4) if self.interpreted else None

    def _use_kernels(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and (self._in_graph_pass or not self.graphs_only)

    def _few_rows(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lm_head: bool
    ) -> torch.Tensor:
        from tp_runtime.layers import skinny_gemm_triton as kernels  # Triton: imported where it runs

        if 1 <= x.shape[0] <= kernels.MAX_FEW_ROWS and self._use_kernels(x):
            if x.shape[0] == 1:
                return kernels.skinny_linear(x, weight, bias, config=self._one_row(), num_sms=self.num_sms)
            n, k = weight.shape
            cfg = kernels.few_rows_config(x.shape[0], n, k, x.dtype, self.num_sms, lm_head=lm_head)
            if cfg is not None:
                return kernels.few_rows_linear(x, weight, bias, cfg)
        return F.linear(x, weight, bias)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._few_rows(x, weight, bias, lm_head=False)

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._few_rows(x, weight, None, lm_head=True)

    def silu_mul_linear(
        self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if gate_up.shape[0] == 1 and self._use_kernels(gate_up):
            from tp_runtime.layers.skinny_gemm_triton import skinny_linear

            return skinny_linear(
                gate_up, weight, bias, silu_mul=True, config=self._one_row(), num_sms=self.num_sms
            )
        return self.linear(silu_and_mul(gate_up, fused=True), weight, bias)


TORCH_MATMUL = Matmul()  # stateless: shared by every layer that has not been given another


def use_matmul(model: nn.Module, matmul: Matmul) -> None:
    """Make every linear layer of `model` (and its LM head) multiply with `matmul`."""
    for module in model.modules():
        if isinstance(getattr(module, "matmul", None), Matmul):
            cast(Any, module).matmul = matmul


@contextmanager
def decode_graph_pass(model: object) -> Iterator[None]:
    """`Matmul.decode_graph_pass` for every matmul object the layers of `model` (an nn.Module) use: the
    decode graphs' warm-up and capture run inside it."""
    modules = model.modules() if isinstance(model, nn.Module) else []
    matmuls = {id(m): m for m in (getattr(mod, "matmul", None) for mod in modules)}
    with ExitStack() as stack:
        for m in matmuls.values():
            if isinstance(m, Matmul):
                stack.enter_context(m.decode_graph_pass())
        yield


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


_copy_checked = copy_checked  # shape-checked, and refusing an FP8 tensor for a layer that is not FP8


def renewed(old: nn.Parameter | None, new: nn.Parameter) -> nn.Parameter:
    """`new`'s tensor in the Parameter object `old` where there is one (a layer whose method changed):
    the model's checkpoint map holds that object, and must see the new tensor rather than keep the old
    one alive."""
    if old is None:
        return new
    old.data = new.data
    return old


class _ParallelLinear(nn.Module):
    """What the column- and row-parallel layers share: the weight (and whatever else its layout needs:
    FP8 scales), made and loaded by the LinearMethod, and an optional bias."""

    weight: nn.Parameter

    def __init__(
        self,
        weight_shape: tuple[int, int],
        bias_size: int | None,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        method: LinearMethod,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.matmul: Matmul = TORCH_MATMUL
        self._weight_shape = (*weight_shape, dtype, device)
        self.use_method(method)
        if bias_size is not None:
            self.bias: nn.Parameter | None = _param((bias_size,), dtype, device)
            self.bias.weight_loader = self._load_bias  # type: ignore[attr-defined]
        else:
            self.bias = None

    def use_method(self, method: LinearMethod) -> None:
        """Store (and multiply) the weight as `method` does; its weights are made anew, empty."""
        self.method = method
        old = self._parameters.get("weight")
        method.create_weights(self, *self._weight_shape)
        self.weight = renewed(old, self.weight)
        self.weight.weight_loader = self._load_weight  # type: ignore[attr-defined]

    def shard(self, shard_id: int) -> Shard:
        raise NotImplementedError

    def _load_weight(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        self.method.load_weight(self, source, self.shard(shard_id))

    def load_scale(self, source: TensorSource, shard_id: int, weight_shape: tuple[int, ...]) -> None:
        self.method.load_scale(self, source, self.shard(shard_id), weight_shape)

    def _load_bias(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        raise NotImplementedError


class ColumnParallelLinear(_ParallelLinear):
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
        method: LinearMethod = UNQUANTIZED,
    ) -> None:
        # Per logical output (q/k/v, gate/up): local size and the start row of this rank's slice.
        self.local_sizes = out_sizes
        self.shard_offsets = shard_offsets or [tp.rank * s for s in out_sizes]
        total = sum(out_sizes)
        super().__init__((total, in_features), total if bias else None, tp, dtype, device, method)

    def shard(self, shard_id: int) -> Shard:
        size = self.local_sizes[shard_id]
        return Shard(0, self.shard_offsets[shard_id], size, sum(self.local_sizes[:shard_id]))

    def _load_bias(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        shard = self.shard(shard_id)
        data = source.narrow(0, shard.start, shard.length)
        _copy_checked(param.data.narrow(0, shard.dst_start, shard.length), data, type(self).__name__)

    def forward(self, x: torch.Tensor | NormedInput) -> torch.Tensor:
        """x, or a norm's output not yet computed, which the method computes (fused with its input's
        quantization where it can)."""
        return self.method.apply(self, x, self.bias)


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
        method: LinearMethod = UNQUANTIZED,
    ) -> None:
        local = [divide(o, tp.world_size) for o in out_features]
        super().__init__(in_features, local, bias, tp, dtype, device, method=method)


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
        method: LinearMethod = UNQUANTIZED,
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
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, tp, dtype, device, offsets, method)


class RowParallelLinear(_ParallelLinear):
    """y = all_reduce(x_local W_local^T) + b with W split by input columns."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        method: LinearMethod = UNQUANTIZED,
    ) -> None:
        self.local_in = divide(in_features, tp.world_size)
        bias_size = out_features if bias else None
        super().__init__((out_features, self.local_in), bias_size, tp, dtype, device, method)

    def shard(self, shard_id: int = 0) -> Shard:
        return Shard(1, self.tp.rank * self.local_in, self.local_in)

    def _load_bias(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        _copy_checked(param.data, source.full(), type(self).__name__)

    def forward(self, x: torch.Tensor, reduce: bool = True, silu_mul: bool = False) -> torch.Tensor:
        """`reduce=False`: this rank's partial sum, for a caller that all-reduces it inside the next
        kernel (a layer without bias only: the bias is added once, after the sum). `silu_mul`: x is the
        merged [tokens, 2 * in] gate|up output and silu(gate) * up is the input (a gated MLP's down
        projection), computed inside the matmul where the Matmul can."""
        if not reduce and self.bias is not None:
            raise ValueError("internal: a row-parallel layer with a bias must reduce its output")
        # One rank: the bias goes into the matmul, rounded once with the product as nn.Linear does; more
        # ranks: added once, after the sum.
        bias = self.bias if self.tp.world_size == 1 else None
        y = self.method.apply(self, x, bias, silu_mul)
        if not reduce:
            return y
        y = self.tp.all_reduce(y)
        if self.bias is not None and bias is None:
            y = y + self.bias
        return y
