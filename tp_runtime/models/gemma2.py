"""Gemma 2: the Llama attention and a gated feed-forward, with Gemma's differences (as transformers'
modeling_gemma2 computes them, in its order):

- RMSNorm scales by (1 + weight), in float32 before the cast back (layers/norm.py GemmaRMSNorm);
- four norms per layer: input and post-attention around the attention, pre- and post-feedforward around
  the MLP, each block's output normed before it joins the residual stream;
- GeGLU feed-forward: gelu (tanh approximation) of the gate times up;
- the embedding output scaled by sqrt(hidden_size), the factor rounded to the model dtype first;
- attention scale query_pre_attn_scalar ** -0.5, and scores soft-capped (c * tanh(s / c)) before masking;
- a sliding window on the layers transformers' `layer_types` marks "sliding_attention" (every other one,
  from layer 0), global attention on the others;
- final logits soft-capped; tied embeddings by default.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from tp_runtime.config import ModelConfig
from tp_runtime.distributed import TPGroup
from tp_runtime.errors import ConfigError
from tp_runtime.layers.activation import gelu_tanh_and_mul
from tp_runtime.layers.attention import AttentionMetadata
from tp_runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tp_runtime.layers.linear import TritonMatmul, use_matmul
from tp_runtime.layers.norm import GemmaRMSNorm
from tp_runtime.layers.normed_input import NormedInput
from tp_runtime.layers.rotary import LayerRopes
from tp_runtime.models.interface import CheckpointEntry, unused_checkpoint_tensor
from tp_runtime.models.llama import LlamaAttention, LlamaMLP, layer_windows


def embedding_normalizer(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The factor of every Gemma's embedding output: sqrt(hidden_size) as transformers holds it, a float32
    scalar cast to the model dtype (in bfloat16 sqrt(2304) = 48.0 stays 48.0, sqrt(3072) = 55.43 becomes
    55.5)."""
    return torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32).to(dtype).to(device)


class Gemma2Attention(LlamaAttention):
    """Llama's attention with this layer's window (None on global layers), Gemma's scale and soft-cap."""

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool, layer: int
    ) -> None:
        super().__init__(cfg, tp, dtype, device, fused)
        self.scale = cfg.attention_scale
        self.window = cfg.layer_window(layer)
        self.softcap = cfg.attn_logit_softcapping


class Gemma2MLP(LlamaMLP):
    def forward(self, x: torch.Tensor | NormedInput, reduce: bool = True) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x), self.fused), reduce)


class Gemma2DecoderLayer(nn.Module):
    attention_cls: type[Gemma2Attention] = Gemma2Attention

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool, layer: int
    ) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype, device, fused)
        self.self_attn = self.attention_cls(cfg, tp, dtype, device, fused, layer)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype, device, fused)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype, device, fused)
        self.mlp = Gemma2MLP(cfg, tp, dtype, device, fused)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype, device, fused)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual-stream form, as LlamaDecoderLayer: returns (this layer's normed MLP output, the residual
        before it). transformers adds each block's normed output to the residual; here the next norm does
        (the same additions, in the same order)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, meta)
        hidden = self.post_attention_layernorm(hidden)
        hidden = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual

    def checkpoint_entries(self, prefix: str) -> Iterator[CheckpointEntry]:
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            weight = cast(GemmaRMSNorm, getattr(self, norm)).weight
            yield f"{prefix}{norm}.weight", tuple(weight.shape), weight, 0
        yield from self.self_attn.checkpoint_entries(f"{prefix}self_attn.")
        yield from self.mlp.checkpoint_entries(f"{prefix}mlp.")


class Gemma2Model(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool,
        layer_cls: type[Gemma2DecoderLayer],
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
        self.layers = nn.ModuleList(
            [layer_cls(cfg, tp, dtype, device, fused, i) for i in range(cfg.num_layers)]
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, fused)
        self.ropes = LayerRopes(cfg, device)  # Gemma 3's windowed layers have their own
        self.register_buffer("normalizer", embedding_normalizer(cfg, dtype, device), persistent=False)


class Gemma2ForCausalLM(nn.Module):
    """Gemma 2 through the interface of models/interface.py, tensor-parallel like the Llama family."""

    layer_cls: type[Gemma2DecoderLayer] = Gemma2DecoderLayer

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool = False
    ) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.model = Gemma2Model(cfg, tp, dtype, device, fused, self.layer_cls)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.num_local_kv_heads: int = self._layer(0).self_attn.num_kv_heads
        if fused:
            use_matmul(self, TritonMatmul.for_device(device))
        self._checkpoint = {name: (shape, p, shard) for name, shape, p, shard in self._checkpoint_entries()}

    def _layer(self, i: int) -> Gemma2DecoderLayer:
        return cast(Gemma2DecoderLayer, self.model.layers[i])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per scheduled token."""
        hidden = self.model.embed_tokens(input_ids) * self.model.normalizer
        residual = None
        ropes = self.model.ropes.for_layers(positions)
        for layer, kv_cache, (cos, sin) in zip(self.model.layers, kv_caches, ropes, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
        out: torch.Tensor = self.model.norm(hidden, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits, soft-capped (cap * tanh(logits / cap)) when the config sets a cap."""
        logits = self.lm_head.compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def decode_weight_bytes(self) -> int:
        """Every parameter but an untied input embedding table, of which a step reads only its rows."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        if not self.config.tie_word_embeddings:
            embed = self.model.embed_tokens.weight
            total -= embed.numel() * embed.element_size()
        return total

    def _checkpoint_entries(self) -> Iterator[CheckpointEntry]:
        c, h = self.config, self.config.hidden_size
        yield "model.embed_tokens.weight", (c.vocab_size, h), self.model.embed_tokens.weight, 0
        for i in range(c.num_layers):
            yield from self._layer(i).checkpoint_entries(f"model.layers.{i}.")
        yield "model.norm.weight", (h,), self.model.norm.weight, 0
        if not c.tie_word_embeddings:
            yield "lm_head.weight", (c.vocab_size, h), self.lm_head.weight, 0

    def checkpoint_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        for name, (shape, _, _) in self._checkpoint.items():
            yield name, shape

    def fused_checkpoint_parts(self, name: str) -> tuple[tuple[str, int], ...]:
        return ()  # every tensor of this family's checkpoints is one of checkpoint_shapes'

    def checkpoint_row_order(self, name: str) -> list[int] | None:
        return None  # rotary embeddings over whole heads

    def tied_checkpoint_names(self) -> dict[str, str]:
        """A tied LM head is the embedding; a checkpoint may still hold it (see loader.load_weights)."""
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.config.tie_word_embeddings else {}

    def checkpoint_targets(self, name: str) -> Iterator[tuple[nn.Parameter, int]]:
        if name.startswith("lm_head.") and self.config.tie_word_embeddings:
            return  # tied: the embedding provides it
        if unused_checkpoint_tensor(name):
            return
        _, param, shard = self._checkpoint[name]  # KeyError: not a tensor of this model
        yield param, shard


def gemma2_config(hf: Any, family: str = "Gemma 2") -> dict[str, Any]:
    """Gemma 2's ModelConfig fields: which layers are windowed (transformers' `layer_types`, which
    Gemma2Config fills with sliding attention on even layers), the activation, scale and soft-caps."""
    act = getattr(hf, "hidden_activation", None) or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{family} hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    refuse_bidirectional(hf, family)
    bias = bool(getattr(hf, "attention_bias", False))

    def cap(name: str) -> float | None:
        value = getattr(hf, name, None)
        return float(value) if value else None

    return {
        "qkv_bias": bias,
        "o_proj_bias": bias,
        "hidden_act": act,
        **layer_windows(hf, family),
        "query_pre_attn_scalar": float(hf.query_pre_attn_scalar),
        "attn_logit_softcapping": cap("attn_logit_softcapping"),
        "final_logit_softcapping": cap("final_logit_softcapping"),
    }


def refuse_bidirectional(hf: Any, family: str) -> None:
    """transformers' Gemma configs can make attention bidirectional (embedding models); the runner's is
    causal only."""
    if getattr(hf, "use_bidirectional_attention", False):
        raise ConfigError(
            f"{family} with use_bidirectional_attention is not supported (causal only); remove it from "
            "config.json or set it to false"
        )
