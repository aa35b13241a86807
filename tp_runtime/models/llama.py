"""The Llama architecture family (Llama, Mistral, Qwen2) written with tensor-parallel layers.

At TP=1 every collective is a no-op, so one code path serves every TP size.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from tp_runtime.config import ModelConfig
from tp_runtime.distributed import TPGroup
from tp_runtime.layers.activation import silu_and_mul
from tp_runtime.layers.attention import AttentionMetadata, paged_attention, write_kv
from tp_runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tp_runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tp_runtime.layers.norm import RMSNorm
from tp_runtime.layers.rotary import RotaryEmbedding, apply_rotary

# Checkpoint name fragment -> (our fused parameter's name fragment, shard index within it).
PACKED_WEIGHTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> None:
        super().__init__()
        self.fused = fused
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, tp, dtype, device
        )
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, tp, dtype, device
        )
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.fused:
            from tp_runtime.layers.fused_triton import rotary_and_cache_

            # One kernel rotates q and k in place and writes k and v into their cache slots.
            rotary_and_cache_(q, k, v, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping)
        else:
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
            write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(n, q_size))


class LlamaMLP(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> None:
        super().__init__()
        self.fused = fused
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [size, size], cfg.mlp_bias, tp, dtype, device
        )
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, cfg.mlp_bias, tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.fused))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, fused)
        self.self_attn = LlamaAttention(cfg, tp, dtype, device, fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, fused)
        self.mlp = LlamaMLP(cfg, tp, dtype, device, fused)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual-stream form: returns (this layer's MLP output, the residual before it); their sum is
        the layer's output, added by the next norm (same additions as transformers, in the same order)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, meta)
        hidden = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, tp, dtype, device, fused) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, fused)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.max_model_len, device)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool = False
    ) -> None:
        """`fused`: residual add + RMSNorm, rotary and SiLU-mul as Triton kernels (CUDA)."""
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.model = LlamaModel(cfg, tp, dtype, device, fused)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._params_by_name = dict(self.named_parameters())
        self.num_local_kv_heads: int = self.model.layers[0].self_attn.num_kv_heads  # type: ignore[union-attr,assignment]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per scheduled token."""
        cos, sin = self.model.rotary.cos_sin(positions)
        hidden = self.model.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
        return self.model.norm(hidden, residual)

    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads on this rank: every parameter but the input embedding table,
        of which a step reads only its rows (a tied table is read whole by the LM head)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        if not self.config.tie_word_embeddings:
            embed = self.model.embed_tokens.weight
            total -= embed.numel() * embed.element_size()
        return total

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def checkpoint_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Names and full (unsharded) shapes of the tensors a Hugging Face checkpoint of this model holds."""
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        yield "model.embed_tokens.weight", (c.vocab_size, c.hidden_size)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", (c.hidden_size,)
            yield p + "post_attention_layernorm.weight", (c.hidden_size,)
            for proj, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                yield p + f"self_attn.{proj}.weight", (size, c.hidden_size)
                if c.qkv_bias:
                    yield p + f"self_attn.{proj}.bias", (size,)
            yield p + "self_attn.o_proj.weight", (c.hidden_size, q)
            if c.o_proj_bias:
                yield p + "self_attn.o_proj.bias", (c.hidden_size,)
            for proj in ("gate_proj", "up_proj"):
                yield p + f"mlp.{proj}.weight", (c.intermediate_size, c.hidden_size)
                if c.mlp_bias:
                    yield p + f"mlp.{proj}.bias", (c.intermediate_size,)
            yield p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)
            if c.mlp_bias:
                yield p + "mlp.down_proj.bias", (c.hidden_size,)
        yield "model.norm.weight", (c.hidden_size,)
        if not c.tie_word_embeddings:
            yield "lm_head.weight", (c.vocab_size, c.hidden_size)

    def checkpoint_targets(self, name: str) -> Iterator[tuple[nn.Parameter, int]]:
        """The parameter(s) a checkpoint tensor name feeds, with the shard index inside a fused one."""
        if name.startswith("lm_head.") and self.config.tie_word_embeddings:
            return  # tied: the embedding provides it
        if "rotary_emb.inv_freq" in name:
            return
        params = self._params_by_name
        for fragment, (fused, shard_id) in PACKED_WEIGHTS.items():
            if f".{fragment}." in name:
                yield params[name.replace(f".{fragment}.", f".{fused}.")], shard_id
                return
        if name in params:
            yield params[name], 0
            return
        raise KeyError(name)
