"""OLMo 2 (Olmo2ForCausalLM) and OLMo 3 (Olmo3ForCausalLM): Llama's attention and SwiGLU feed-forward
(models/llama.py) in OLMo's layout, as transformers' modeling_olmo2 and modeling_olmo3 compute them:

- no norm before the attention or the MLP: both read the residual stream itself, and their outputs are
  normed (post_attention_layernorm, post_feedforward_layernorm) before they join it;
- q_norm and k_norm: RMSNorms over the whole query projection (every head together) and the whole key
  projection, before rotary;
- every RMSNorm multiplies by its weight in float32 before the cast back (layers/norm.py Olmo2RMSNorm);
- OLMo 3: a sliding window on the layers `layer_types` marks "sliding_attention" (three in four by
  default), and those layers rotate with their own rope (rope_parameters per layer type: the long-context
  releases' YaRN scaling is the global layers' only).

One rounding differs in 16-bit dtypes: transformers' OLMo rotates q and k in float32 and rounds once, this
runtime's rotary (Llama's) rounds each product to the model dtype; in float32 they are the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tp_runtime.config import ModelConfig
from tp_runtime.distributed import TPGroup
from tp_runtime.errors import ConfigError
from tp_runtime.layers.attention import AttentionMetadata
from tp_runtime.layers.norm import Olmo2RMSNorm, SlicedRMSNorm
from tp_runtime.layers.normed_input import NormedInput
from tp_runtime.models.interface import CheckpointEntry, FeedForward
from tp_runtime.models.llama import DecoderLayer, LlamaAttention, LlamaForCausalLM, layer_windows


class Olmo2Attention(LlamaAttention):
    """Llama's attention with OLMo's q/k norms and this layer's window (OLMo 3's; None for OLMo 2).

    A rank holds only its heads, so each norm's mean square over all of them is a sum over the ranks: each
    rank's sums of squares (q and k in one [tokens, 2] message) are all-reduced. Where ranks share a KV head
    (fewer KV heads than ranks, QKVParallelLinear), only the first rank of each group adds its key squares
    and the others add zero, so each head counts once. Each rank holds its heads' slice of the weights."""

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool, layer: int
    ) -> None:
        super().__init__(cfg, tp, dtype, device, fused)
        self.tp = tp
        self.window = cfg.layer_window(layer)
        q_rows, k_rows = self.qkv_proj.shard(0), self.qkv_proj.shard(1)
        q_size, k_size, eps = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps
        self.q_norm = SlicedRMSNorm(q_size, q_rows.start, q_rows.length, eps, dtype, device)
        self.k_norm = SlicedRMSNorm(k_size, k_rows.start, k_rows.length, eps, dtype, device)
        ranks_per_kv_head = max(1, tp.world_size // cfg.num_kv_heads)  # QKVParallelLinear's grouping
        self.counts_keys = tp.rank % ranks_per_kv_head == 0

    def project_qkv(
        self, hidden: torch.Tensor | NormedInput
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_qkv(hidden)
        n = q.shape[0]
        q, k = q.reshape(n, -1), k.reshape(n, -1)
        key_squares = self.k_norm.sum_of_squares(k)
        if not self.counts_keys:
            key_squares.zero_()
        squares = self.tp.all_reduce(torch.cat([self.q_norm.sum_of_squares(q), key_squares], dim=-1))
        q = self.q_norm(q, squares[:, :1]).view(n, self.num_heads, self.head_dim)
        k = self.k_norm(k, squares[:, 1:]).view(n, self.num_kv_heads, self.head_dim)
        return q, k, v

    def checkpoint_entries(self, prefix: str) -> Iterator[CheckpointEntry]:
        yield from super().checkpoint_entries(prefix)
        c = self.config
        yield f"{prefix}q_norm.weight", (c.num_heads * c.head_dim,), self.q_norm.weight, 0
        yield f"{prefix}k_norm.weight", (c.num_kv_heads * c.head_dim,), self.k_norm.weight, 0


class Olmo2DecoderLayer(DecoderLayer):
    norm_names = ("post_attention_layernorm", "post_feedforward_layernorm")

    def __init__(
        self,
        cfg: ModelConfig,
        self_attn: Olmo2Attention,
        mlp: FeedForward,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(self_attn, mlp)
        self.post_attention_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_feedforward_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

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
        before it), which the next layer or the final norm adds (the same additions as transformers, in
        the same order). The attention and the MLP read the residual stream itself."""
        if residual is None:
            residual = hidden
        else:
            residual.add_(hidden)
        attention = self.self_attn(residual, cos, sin, kv_cache, meta)
        residual.add_(self.post_attention_layernorm(attention))
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 and OLMo 3 (OLMo 3's windows and per-layer-type ropes are ModelConfig's)."""

    norm_cls = Olmo2RMSNorm  # the final norm

    def make_layer(
        self, layer: int, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> DecoderLayer:
        cfg = self.config
        attention = Olmo2Attention(cfg, tp, dtype, device, fused, layer)
        mlp = self.make_mlp(layer, tp, dtype, device, fused)
        return Olmo2DecoderLayer(cfg, attention, mlp, dtype, device)


def olmo2_config(hf: Any) -> dict[str, Any]:
    bias = bool(getattr(hf, "attention_bias", False))  # q/k/v and o alike; the MLP has none
    return {"qkv_bias": bias, "o_proj_bias": bias}


def olmo3_config(hf: Any) -> dict[str, Any]:
    """OLMo 2's fields and the windowed layers. transformers 5 gives those layers their own rope
    (rope_parameters per layer type, read by config.build_model_config); a 4.x config holds one rope_scaling
    that its OLMo 3 applies to the global layers only, which the runtime cannot tell apart."""
    params = getattr(hf, "rope_parameters", None)
    per_layer_type = isinstance(params, dict) and "sliding_attention" in params
    if not per_layer_type and getattr(hf, "rope_scaling", None):
        raise ConfigError(
            "OLMo 3 with rope_scaling needs transformers >= 5 to read it (its sliding-window layers rotate "
            "unscaled); upgrade transformers"
        )
    return {**olmo2_config(hf), **layer_windows(hf, "OLMo 3")}
