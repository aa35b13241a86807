"""Qwen3-MoE: Qwen3 attention (per-head q/k norms) with many small routed experts, and dense MLPs on the
layers `mlp_only_layers` and `decoder_sparse_step` name (the rule Qwen2-MoE shares: `moe_fields`)."""

from __future__ import annotations

from typing import Any

import torch

from tp_runtime.config import ModelConfig
from tp_runtime.distributed import TPGroup
from tp_runtime.errors import ConfigError
from tp_runtime.layers.moe import SparseMoE
from tp_runtime.layers.quantization import linear_method
from tp_runtime.models.interface import FeedForward
from tp_runtime.models.qwen3 import Qwen3ForCausalLM, qwen3_config


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(
        self, layer: int, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> FeedForward:
        c = self.config
        if layer not in c.moe_layers:
            return super().make_mlp(layer, tp, dtype, device, fused)  # of intermediate_size
        return SparseMoE(**sparse_moe_options(c, tp, dtype, device, fused))


def sparse_moe_options(
    c: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool
) -> dict[str, Any]:
    """SparseMoE's arguments for a Qwen2-MoE or Qwen3-MoE layer's routed experts."""
    return dict(
        hidden_size=c.hidden_size,
        intermediate_size=c.moe_intermediate_size,
        num_experts=c.num_experts,
        top_k=c.num_experts_per_tok,
        renormalize=c.norm_topk_prob,
        fp32_weights=False,  # transformers casts the routing weights to the model dtype first
        expert_names=("gate_proj", "up_proj", "down_proj"),
        tp=tp,
        dtype=dtype,
        device=device,
        fused=fused,
        method=linear_method(c.quantization, device),
    )


def moe_fields(hf: Any) -> dict[str, Any]:
    """The experts' ModelConfig fields of a Qwen2-MoE or Qwen3-MoE config, whose transformers decoder layers
    are sparse unless listed in mlp_only_layers or off the sparse step."""
    experts = int(hf.num_experts)
    dense = set(getattr(hf, "mlp_only_layers", None) or [])
    step = int(getattr(hf, "decoder_sparse_step", 1))
    if step < 1:  # a ZeroDivisionError below (transformers fails on it too)
        raise ConfigError(f"decoder_sparse_step must be >= 1 (every step-th layer is sparse), got {step}")
    sparse = tuple(
        i for i in range(int(hf.num_hidden_layers)) if i not in dense and experts > 0 and (i + 1) % step == 0
    )
    return {
        "moe_layers": sparse,
        "num_experts": experts,
        "num_experts_per_tok": int(hf.num_experts_per_tok),
        "moe_intermediate_size": int(hf.moe_intermediate_size),
        "norm_topk_prob": bool(hf.norm_topk_prob),
    }


def qwen3_moe_config(hf: Any) -> dict[str, Any]:
    return {
        **qwen3_config(hf),
        # Unlike Qwen3, transformers' Qwen3-MoE windows every layer when use_sliding_window is set.
        "sliding_window": getattr(hf, "sliding_window", None),
        **moe_fields(hf),
    }
