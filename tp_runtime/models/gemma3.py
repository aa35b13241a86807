"""Gemma 3 (text: Gemma3ForCausalLM, the 270M and 1B releases): Gemma 2's decoder (models/gemma2.py) with
transformers' modeling_gemma3 differences:

- an RMSNorm of Gemma's kind over each query and key head, before rotary (q_norm, k_norm);
- the windowed ("sliding_attention") layers rotate with their own rope (rope_parameters per layer type:
  a local base frequency, no scaling), the global ones with the model's (possibly scaled) rope;
- five windowed layers to one global by default, and no soft-caps unless the config sets them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tp_runtime.config import ModelConfig
from tp_runtime.distributed import TPGroup
from tp_runtime.layers.norm import GemmaHeadRMSNorm
from tp_runtime.layers.normed_input import NormedInput
from tp_runtime.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, gemma2_config
from tp_runtime.models.interface import CheckpointEntry


class Gemma3Attention(Gemma2Attention):
    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool, layer: int
    ) -> None:
        super().__init__(cfg, tp, dtype, device, fused, layer)
        # [head_dim] weights shared by every head, so replicated across ranks.
        self.q_norm = GemmaHeadRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, fused)
        self.k_norm = GemmaHeadRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, fused)

    def project_qkv(
        self, hidden: torch.Tensor | NormedInput
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_qkv(hidden)
        return self.q_norm(q), self.k_norm(k), v

    def checkpoint_entries(self, prefix: str) -> Iterator[CheckpointEntry]:
        yield from super().checkpoint_entries(prefix)
        yield f"{prefix}q_norm.weight", (self.head_dim,), self.q_norm.weight, 0
        yield f"{prefix}k_norm.weight", (self.head_dim,), self.k_norm.weight, 0


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_cls = Gemma3DecoderLayer


def gemma3_config(hf: Any) -> dict[str, Any]:
    return gemma2_config(hf, "Gemma 3")
