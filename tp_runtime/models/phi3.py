"""Phi-3 and Phi-4 (Phi3ForCausalLM): the Llama decoder, whose checkpoints hold the query, key and value
projections as one qkv_proj tensor and the gate and up projections as one gate_up_proj tensor. The
loader reads each part's rows as the tensor Llama's layers take (fused_checkpoint_parts), so every rank
still reads only its slices. A sliding window, where the config sets one, covers every layer, as in
transformers' Phi3Attention.

The 128k releases' LongRoPE takes one of its two sets of factors for the engine's life (config._rope_config).
Partial rotary embeddings (Phi-4-mini: the first partial_rotary_factor of each head rotates) are a rope
whose other dims pass through (layers/rotary.py). Not supported (ConfigError): quantized checkpoints
(fused scales); `quantization="fp8"` quantizes a 16-bit checkpoint at load as for any family.
"""

from __future__ import annotations

from typing import Any

from tp_runtime.config import hf_quantization_config, quant_config
from tp_runtime.errors import ConfigError
from tp_runtime.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def fused_checkpoint_parts(self, name: str) -> tuple[tuple[str, int], ...]:
        c = self.config
        if name.endswith(".self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            return tuple(
                (f"{prefix}{proj}.weight", rows)
                for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))
            )
        if name.endswith(".mlp.gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            size = c.intermediate_size
            return ((f"{prefix}gate_proj.weight", size), (f"{prefix}up_proj.weight", size))
        return ()


def phi3_config(hf: Any) -> dict[str, Any]:
    # Under either name of the field; a checkpoint that quantizes only its KV cache loads as 16-bit.
    stored = quant_config(hf_quantization_config(hf), None)
    if stored is not None and stored.checkpoint_format != "online":
        raise ConfigError(
            "quantized Phi-3 checkpoints (scales of fused qkv_proj / gate_up_proj tensors) are not "
            "supported; load the 16-bit checkpoint, with quantization='fp8' for FP8 weights"
        )
    window = getattr(hf, "sliding_window", None)
    return {"sliding_window": int(window) if window else None}
