"""Gemma 3 (text: Gemma3ForCausalLM, the 270M and 1B releases): Gemma 2's decoder (models/gemma2.py) with
transformers' modeling_gemma3 differences:

- an RMSNorm of Gemma's kind over each query and key head, before rotary (q_norm, k_norm);
- the windowed ("sliding_attention") layers rotate with their own rope (rope_parameters per layer type:
  a local base frequency, no scaling), the global ones with the model's (possibly scaled) rope;
- five windowed layers to one global by default, and no final soft-cap unless the config sets one;
- attention scores are never soft-capped: transformers' Gemma3Attention keeps `attn_logit_softcapping`
  but does not apply it, so a config that sets it runs as transformers runs it.

The multimodal releases (Gemma3ForConditionalGeneration: 4B, 12B, 27B) run as this model on text: their
config.json's text_config is its config (config.build_model_config reads it), and only the language model's
tensors are loaded (models/registry.py names them).
"""

from __future__ import annotations

from typing import Any

from tp_runtime.errors import ConfigError
from tp_runtime.layers.norm import GemmaHeadRMSNorm
from tp_runtime.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, gemma2_config
from tp_runtime.models.llama import HeadNormedAttention


class Gemma3Attention(Gemma2Attention, HeadNormedAttention):
    """Gemma 2's attention (window, scale, soft-cap) with head norms of Gemma's kind (1 + weight)."""

    head_norm_cls = GemmaHeadRMSNorm


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_cls = Gemma3DecoderLayer


def gemma3_config(hf: Any) -> dict[str, Any]:
    return {**gemma2_config(hf, "Gemma 3"), "attn_logit_softcapping": None}


def gemma3_multimodal_config(hf_text: Any) -> dict[str, Any]:
    """Gemma3ForConditionalGeneration's language model, from its text_config: Gemma3ForCausalLM's fields,
    but transformers' Gemma3ForConditionalGeneration computes its logits without the final soft-cap (its
    Gemma3ForCausalLM and vLLM apply it); no release sets one, and a config that does is refused rather than
    run as only one of them would."""
    fields = gemma3_config(hf_text)
    cap = fields["final_logit_softcapping"]
    if cap is not None:
        raise ConfigError(
            f"Gemma3ForConditionalGeneration with text_config.final_logit_softcapping={cap} is not "
            "supported: transformers' Gemma3ForConditionalGeneration does not apply it (its "
            "Gemma3ForCausalLM does); set it to null in config.json's text_config to run the model as "
            "transformers does"
        )
    return fields
