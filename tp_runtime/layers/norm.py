from __future__ import annotations

import torch
from torch import nn

from tp_runtime.layers.linear import TensorSource


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, in the same order as transformers' LlamaRMSNorm."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        param.data.copy_(source.full())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
