"""Rotary position embedding with the inverse frequencies transformers computes for the checkpoint."""

from __future__ import annotations

import torch
from torch import nn

from tp_runtime.config import RopeConfig


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def __init__(self, rope: RopeConfig, max_positions: int, device: torch.device) -> None:
        super().__init__()
        inv_freq = torch.tensor(rope.inv_freq, dtype=torch.float32, device=device)
        # Tables for every position, computed as transformers does (fp32 product, then cos/sin, then the
        # scaling), so each step is one lookup instead of a recomputation in every layer.
        freqs = torch.arange(max_positions, device=device).float().unsqueeze(-1) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos() * rope.attention_scaling, persistent=False)
        self.register_buffer("sin_table", emb.sin() * rope.attention_scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # index_select, not advanced indexing: the same rows, 20x faster on the CPU for a batch's positions.
        return self.cos_table.index_select(0, positions), self.sin_table.index_select(0, positions)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (float32). `fused` rotates x in place with
    one Triton kernel."""
    if fused:
        from tp_runtime.layers.fused_triton import rotary_

        return rotary_(x, cos, sin)
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    return x * cos + _rotate_half(x) * sin
