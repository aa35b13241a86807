from __future__ import annotations

import torch
from torch import nn

from tp_runtime.layers.linear import TensorSource
from tp_runtime.layers.normed_input import NormedInput


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
