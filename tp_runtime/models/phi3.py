"""Phi-3 and Phi-4 (Phi3ForCausalLM): the Llama decoder, whose checkpoints hold the query, key and value
projections as one qkv_proj tensor and the gate and up projections as one gate_up_proj tensor. The
loader reads each part's rows as the tensor Llama's layers take (fused_checkpoint_parts), so every rank
still reads only its slices. A sliding window, where the config sets one, covers every layer, as in
transformers' Phi3Attention.

The 128k releases' LongRoPE takes one of its two sets of factors for the engine's life (config._rope_config).
Not supported (ConfigErrors): partial rotary embeddings (Phi-4-mini) and FP8 checkpoints (fused scales);
`quantization="fp8"` quantizes a 16-bit checkpoint at load as for any family.
"""

from __future__ import annotations

from typing import Any

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
    params = dict(getattr(hf, "rope_parameters", None) or {})
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(
            f"Phi-3 with partial_rotary_factor={partial} (rotary embeddings on part of each head, as in "
            "Phi-4-mini) is not supported"
        )
    if getattr(hf, "quantization_config", None) is not None:
        raise ConfigError(
            "quantized Phi-3 checkpoints (scales of fused qkv_proj / gate_up_proj tensors) are not "
            "supported; load the 16-bit checkpoint, with quantization='fp8' for FP8 weights"
        )
    window = getattr(hf, "sliding_window", None)
    return {"sliding_window": int(window) if window else None}
