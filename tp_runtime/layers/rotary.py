"""Rotary position embedding with the inverse frequencies transformers computes for the checkpoint."""

from __future__ import annotations

import torch
from torch import nn

from tp_runtime.config import RopeConfig


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        inv_freq = torch.tensor(rope.inv_freq, dtype=torch.float32, device=device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        cos, sin = self._cos_sin(torch.arange(max_positions, device=device), inv_freq)
        # One table lookup per step instead of recomputing cos/sin in every layer.
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)

    def _cos_sin(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.rope.attention_scaling, emb.sin() * self.rope.attention_scaling

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_table[positions], self.sin_table[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (float32)."""
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    return x * cos + _rotate_half(x) * sin
