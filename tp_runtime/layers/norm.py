from __future__ import annotations

import torch
from torch import nn

from tp_runtime.layers.linear import TensorSource
from tp_runtime.layers.normed_input import NormedInput
from tp_runtime.layers.quantization import copy_checked


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, in the same order as transformers' LlamaRMSNorm."""

    unit_offset = False  # the fused kernel's UNIT_OFFSET (GemmaRMSNorm)

    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device, fused: bool = False
    ) -> None:
        super().__init__()
        self.eps = eps
        self.fused = fused  # one Triton kernel (layers/fused_triton.py) instead of ~8 PyTorch ops
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        param.data.copy_(source.full())

    def deferred(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> NormedInput:
        """forward's result, computed by the linear layer that takes it (NormedInput)."""
        return NormedInput(self, x, residual)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x), or with a residual RMSNorm(x + residual), the residual updated to x + residual in
        place (the residual stream of a decoder layer)."""
        if self.fused:
            from tp_runtime.layers.fused_triton import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            residual.add_(x)
            x = residual
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class HeadRMSNorm(RMSNorm):
    """RMSNorm over each head's head_dim of [tokens, heads, head_dim] (Qwen3's q_norm and k_norm); the
    weight is [head_dim], the same for every head, so it is replicated across ranks."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        assert residual is None, "per-head norms have no residual stream"
        # q/k are strided views into the fused QKV output; one [tokens * heads, head_dim] copy serves both
        # the fused kernel (which wants 2-D rows) and the PyTorch path.
        return super().forward(x.reshape(-1, x.shape[-1])).view(x.shape)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint weight w scales by (1 + w), and the product is taken in float32
    before the cast back (transformers' Gemma2RMSNorm; Llama casts first, then multiplies)."""

    unit_offset = True

    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device, fused: bool = False
    ) -> None:
        super().__init__(hidden_size, eps, dtype, device, fused)
        self.weight.data.zero_()  # the identity, as transformers initialises it

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.fused:
            from tp_runtime.layers.fused_triton import rms_norm

            return rms_norm(x, self.weight, self.eps, residual, unit_offset=True)
        if residual is not None:
            residual.add_(x)
            x = residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaHeadRMSNorm(HeadRMSNorm, GemmaRMSNorm):
    """Gemma 3's q_norm and k_norm: HeadRMSNorm's per-head form of GemmaRMSNorm (1 + weight, float32)."""


def _weighted_rms(
    x: torch.Tensor, mean_square: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """weight * x / sqrt(mean_square + eps), the product taken in float32 and cast back once."""
    return (weight * (x.float() * torch.rsqrt(mean_square + eps))).to(x.dtype)


class Olmo2RMSNorm(RMSNorm):
    """OLMo 2's RMSNorm: the weight multiplies the float32 normalised row before the cast back (Llama's
    casts first, then multiplies). No fused kernel rounds in this order, so it runs as PyTorch ops whatever
    `fused` says (and NormedInput.quantized, which needs a fused norm, refuses its deferred output)."""

    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device, fused: bool = False
    ) -> None:
        super().__init__(hidden_size, eps, dtype, device, fused=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            residual.add_(x)
            x = residual
        return _weighted_rms(x, x.float().pow(2).mean(-1, keepdim=True), self.weight, self.eps)


class SlicedRMSNorm(nn.Module):
    """Olmo2RMSNorm over `size` features of which this rank holds `length`, from `start` on: OLMo 2's
    q_norm and k_norm span every head of a projection, and a rank holds only its heads. The weight is that
    slice of the checkpoint's; forward takes the sum of squares over all `size` features, which the caller
    gathers (each rank's `sum_of_squares`, all-reduced)."""

    def __init__(
        self, size: int, start: int, length: int, eps: float, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.size = size
        self.start = start
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(length, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        copy_checked(param.data, source.narrow(0, self.start, param.shape[0]), type(self).__name__)

    @staticmethod
    def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
        """[rows, 1] float32: each row's sum of squares over this rank's features."""
        return x.float().pow(2).sum(-1, keepdim=True)

    def forward(self, x: torch.Tensor, sum_of_squares: torch.Tensor) -> torch.Tensor:
        """x [rows, length] normalised by the mean square over all `size` features."""
        return _weighted_rms(x, sum_of_squares / self.size, self.weight, self.eps)
