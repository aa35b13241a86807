"""Qwen3: the Llama decoder with an RMSNorm over each query and key head before rotary
(models/llama.py HeadNormedAttention), as transformers' Qwen3Attention applies them."""

from __future__ import annotations

from typing import Any

from tp_runtime.models.llama import HeadNormedAttention, LlamaForCausalLM, qwen_layer_windows


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = HeadNormedAttention


def qwen3_config(hf: Any) -> dict[str, Any]:
    bias = bool(getattr(hf, "attention_bias", False))  # q/k/v and o alike, as in transformers
    return {"qkv_bias": bias, "o_proj_bias": bias, **qwen_layer_windows(hf, "Qwen3")}
