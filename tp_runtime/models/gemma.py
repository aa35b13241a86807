"""Gemma (GemmaForCausalLM: gemma-2b and -7b, gemma-1.1, CodeGemma): Llama's decoder layer (input norm,
attention, post-attention norm, MLP; models/llama.py) with the pieces Gemma 2 also has (models/gemma2.py),
as transformers' modeling_gemma computes them:

- RMSNorm scales by (1 + weight), in float32 before the cast back (layers/norm.py GemmaRMSNorm);
- GeGLU feed-forward: gelu (tanh approximation) of the gate times up (Gemma2MLP);
- the embedding output scaled by sqrt(hidden_size), the factor rounded to the model dtype first;
- head_dim from the config (256 in the releases, not hidden_size / heads), attention scale head_dim ** -0.5;
- tied embeddings by default; no soft-caps, no sliding window.
"""

from __future__ import annotations

from typing import Any

import torch

from tp_runtime.config import ModelConfig
from tp_runtime.distributed import TPGroup
from tp_runtime.errors import ConfigError
from tp_runtime.layers.norm import GemmaRMSNorm
from tp_runtime.models.gemma2 import Gemma2MLP, embedding_normalizer, refuse_bidirectional
from tp_runtime.models.interface import FeedForward
from tp_runtime.models.llama import LlamaForCausalLM


class GemmaForCausalLM(LlamaForCausalLM):
    norm_cls = GemmaRMSNorm
    normalizer: torch.Tensor  # a buffer (not in checkpoints)

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool = False
    ) -> None:
        super().__init__(cfg, tp, dtype, device, fused)
        self.register_buffer("normalizer", embedding_normalizer(cfg, dtype, device), persistent=False)

    def make_mlp(
        self, layer: int, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> FeedForward:
        return Gemma2MLP(self.config, tp, dtype, device, fused)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.normalizer


def gemma_config(hf: Any) -> dict[str, Any]:
    """transformers 5 takes Gemma's activation from hidden_act (4.x releases before 4.48 from
    hidden_activation, which the 1.1 configs also carry); its GemmaConfig reads the first releases' "gelu"
    as the tanh approximation they meant, and so does this, whichever transformers loaded the config."""
    act = getattr(hf, "hidden_act", None) or "gelu_pytorch_tanh"
    if act == "gelu":
        act = "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(
            f"Gemma hidden_act {act!r} is not supported: Gemma's feed-forward is GeGLU, hidden_act "
            "gelu_pytorch_tanh (or gelu, which transformers reads as it)"
        )
    refuse_bidirectional(hf, "Gemma")
    bias = bool(getattr(hf, "attention_bias", False))  # q/k/v and o alike, as in transformers
    return {"qkv_bias": bias, "o_proj_bias": bias, "hidden_act": act}
