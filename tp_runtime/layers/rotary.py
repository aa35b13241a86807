"""Rotary position embedding with the inverse frequencies transformers computes for the checkpoint.

Partial rotary embeddings (RopeConfig.pass_pairs: Phi-4-mini rotates 3/4 of each head) keep the
whole-head kernels: each head's q and k dims are held in the order [r1, p1, r2, p2] (partial_rotary_order,
applied to the q/k projections' rows at load), where transformers rotates r1 with r2 and leaves p1 and p2;
the tables give p1/p2 cos 1 and sin 0, which leaves them exactly as they are. q.k is the same in any order
of dims shared by q and k, and v is not reordered, so attention is unchanged."""

from __future__ import annotations

import torch
from torch import nn

from tp_runtime.config import ModelConfig, RopeConfig


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
        if rope.pass_pairs:
            ones = torch.ones((max_positions, rope.pass_pairs), device=device)
            cos = torch.cat((freqs.cos() * rope.attention_scaling, ones), dim=-1)
            sin = torch.cat((freqs.sin() * rope.attention_scaling, torch.zeros_like(ones)), dim=-1)
            self.register_buffer("cos_table", torch.cat((cos, cos), dim=-1), persistent=False)
            self.register_buffer("sin_table", torch.cat((sin, sin), dim=-1), persistent=False)
            return
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos() * rope.attention_scaling, persistent=False)
        self.register_buffer("sin_table", emb.sin() * rope.attention_scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # index_select, not advanced indexing: the same rows, 20x faster on the CPU for a batch's positions.
        return self.cos_table.index_select(0, positions), self.sin_table.index_select(0, positions)


def partial_rotary_order(head_dim: int, pass_pairs: int) -> list[int]:
    """Each head's dims in the order the tables rotate them: [r1, p1, r2, p2] of transformers' [r1, r2, p1,
    p2], where r1 and r2 (the rotated halves) are (head_dim - 2 * pass_pairs) / 2 dims each."""
    half = (head_dim - 2 * pass_pairs) // 2
    rotated, passed = 2 * half, range(2 * half, head_dim)
    return [*range(half), *passed[:pass_pairs], *range(half, rotated), *passed[pass_pairs:]]


class LayerRopes(nn.Module):
    """A decoder's rotary tables: the model's rope, and the sliding-window layers' own where the config
    gives them one (ModelConfig.local_rope: Gemma 3, OLMo 3). A layer without rotary embedding
    (ModelConfig.nope_layers: SmolLM3) gets cos 1 and sin 0, a rotation that leaves q and k exactly as they
    are, so the attention layers (and their fused rotary + cache-write kernel) need no other path."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.rope, cfg.max_model_len, device)
        self.local_rotary = (
            None if cfg.local_rope is None else RotaryEmbedding(cfg.local_rope, cfg.max_model_len, device)
        )
        self.local_layers = frozenset(cfg.sliding_window_layers or ()) if cfg.local_rope else frozenset()
        self.nope_layers = frozenset(cfg.nope_layers)
        self.num_layers = cfg.num_layers

    def for_layers(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin) at `positions`, each table looked up once."""
        cos_sin = self.rotary.cos_sin(positions)
        if self.local_rotary is None and not self.nope_layers:
            return [cos_sin] * self.num_layers
        local = cos_sin if self.local_rotary is None else self.local_rotary.cos_sin(positions)
        # x * 1 + rotate_half(x) * 0 is x, bit for bit (in any dtype).
        identity = (torch.ones_like(cos_sin[0]), torch.zeros_like(cos_sin[1]))
        return [
            identity if i in self.nope_layers else local if i in self.local_layers else cos_sin
            for i in range(self.num_layers)
        ]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (float32). `fused` rotates x in place with
    one Triton kernel."""
    if fused:
        from tp_runtime.layers.fused_triton import rotary_

        return rotary_(x, cos, sin)
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    return x * cos + _rotate_half(x) * sin
