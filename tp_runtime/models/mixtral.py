"""Mixtral: the Mistral decoder with a sparse mixture of experts (top-2 of 8) in place of the MLP."""

from __future__ import annotations

from typing import Any

import torch

from tp_runtime.distributed import TPGroup
from tp_runtime.layers.moe import SparseMoE
from tp_runtime.layers.quantization import linear_method
from tp_runtime.models.interface import FeedForward
from tp_runtime.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    mlp_checkpoint_name = "block_sparse_moe"

    def make_mlp(
        self, layer: int, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> FeedForward:
        c = self.config
        return SparseMoE(
            c.hidden_size,
            c.moe_intermediate_size,
            c.num_experts,
            c.num_experts_per_tok,
            renormalize=c.norm_topk_prob,
            fp32_weights=True,  # transformers weights each expert's output by its float32 routing weight
            expert_names=("w1", "w3", "w2"),
            tp=tp,
            dtype=dtype,
            device=device,
            fused=fused,
            method=linear_method(c.quantization, device),
        )


def mixtral_config(hf: Any) -> dict[str, Any]:
    return {
        "qkv_bias": False,
        "o_proj_bias": False,
        "sliding_window": getattr(hf, "sliding_window", None),
        "moe_layers": tuple(range(int(hf.num_hidden_layers))),
        "num_experts": int(hf.num_local_experts),
        "num_experts_per_tok": int(hf.num_experts_per_tok),
        "moe_intermediate_size": int(hf.intermediate_size),
        "norm_topk_prob": True,  # Mixtral always renormalises its top-k weights
    }
