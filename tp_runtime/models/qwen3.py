"""Qwen3: the Llama decoder with an RMSNorm over each query and key head before rotary."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tp_runtime.config import ModelConfig
from tp_runtime.distributed import TPGroup
from tp_runtime.layers.norm import HeadRMSNorm
from tp_runtime.layers.normed_input import NormedInput
from tp_runtime.models.interface import CheckpointEntry
from tp_runtime.models.llama import LlamaAttention, LlamaForCausalLM, uniform_sliding_window


class Qwen3Attention(LlamaAttention):
    """q_norm / k_norm: weights [head_dim], shared by every head and so replicated across ranks; applied to
    the projected heads before rotary, as transformers' Qwen3Attention does."""

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> None:
        super().__init__(cfg, tp, dtype, device, fused)
        self.q_norm = HeadRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, fused)
        self.k_norm = HeadRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, fused)

    def project_qkv(
        self, hidden: torch.Tensor | NormedInput
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_qkv(hidden)
        return self.q_norm(q), self.k_norm(k), v

    def checkpoint_entries(self, prefix: str) -> Iterator[CheckpointEntry]:
        yield from super().checkpoint_entries(prefix)
        yield f"{prefix}q_norm.weight", (self.head_dim,), self.q_norm.weight, 0
        yield f"{prefix}k_norm.weight", (self.head_dim,), self.k_norm.weight, 0


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention


def qwen3_config(hf: Any) -> dict[str, Any]:
    bias = bool(getattr(hf, "attention_bias", False))  # q/k/v and o alike, as in transformers
    return {"qkv_bias": bias, "o_proj_bias": bias, "sliding_window": uniform_sliding_window(hf)}
