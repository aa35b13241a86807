"""The Llama architecture family (Llama, Mistral, Qwen2, Granite, SmolLM3) written with tensor-parallel
layers, and the decoder skeleton the other families extend (models/qwen3.py, mixtral.py, qwen3_moe.py,
qwen2_moe.py, phi3.py, gemma.py).

At TP=1 every collective is a no-op, so one code path serves every TP size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, ClassVar, cast

import torch
from torch import nn

from tp_runtime.config import ModelConfig
from tp_runtime.distributed import TPGroup
from tp_runtime.errors import ConfigError
from tp_runtime.layers.attention import AttentionMetadata, paged_attention, write_kv
from tp_runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tp_runtime.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TritonMatmul,
    use_matmul,
)
from tp_runtime.layers.norm import HeadRMSNorm, RMSNorm
from tp_runtime.layers.normed_input import NormedInput, as_tensor
from tp_runtime.layers.quantization import linear_method
from tp_runtime.layers.rotary import LayerRopes, apply_rotary, partial_rotary_order
from tp_runtime.models.interface import CheckpointEntry, FeedForward, unused_checkpoint_tensor

# The checkpoint tensors whose rows a partial rotary embedding reorders (checkpoint_row_order).
_ROTATED_TENSORS = tuple(f".self_attn.{p}_proj.{t}" for p in "qk" for t in ("weight", "bias"))


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> None:
        super().__init__()
        self.config = cfg
        self.fused = fused
        self.head_dim = cfg.head_dim
        method = linear_method(cfg.quantization, device)
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, tp, dtype, device,
            method,
        )  # fmt: skip
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, tp, dtype, device, method
        )
        self.scale = cfg.attention_scale
        # This layer's sliding window and attention logit soft-cap (Gemma 2 sets them per layer).
        self.window: int | None = cfg.sliding_window
        self.softcap: float | None = None
        # (key, value) scales of an FP8 KV cache: the checkpoint's (loader), else 1 (layers/kv_fp8.py).
        self.kv_scales: tuple[float, float] = (1.0, 1.0)

    def set_kv_scales(self, k_scale: float | None, v_scale: float | None) -> None:
        """The checkpoint's FP8 KV-cache scales (None: keep that one)."""
        self.kv_scales = (k_scale or self.kv_scales[0], v_scale or self.kv_scales[1])

    def project_qkv(
        self, hidden: torch.Tensor | NormedInput
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim], before rotary."""
        n = hidden.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        return (
            q.view(n, self.num_heads, self.head_dim),
            k.view(n, self.num_kv_heads, self.head_dim),
            v.view(n, self.num_kv_heads, self.head_dim),
        )

    def forward(
        self,
        hidden: torch.Tensor | NormedInput,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        reduce: bool = True,
    ) -> torch.Tensor:
        """`reduce=False`: the output projection's partial sum on this rank (see reduce_add_norm)."""
        n = hidden.shape[0]
        q, k, v = self.project_qkv(hidden)
        if self.fused:
            from tp_runtime.layers.fused_triton import rotary_and_cache_

            # One kernel rotates q and k in place and writes k and v into their cache slots.
            rotary_and_cache_(q, k, v, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping, self.kv_scales)
        else:
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
            write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping, self.kv_scales)
        out = paged_attention(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, window=self.window, softcap=self.softcap,
            kv_scales=self.kv_scales,
        )  # fmt: skip
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim), reduce)

    def checkpoint_entries(self, prefix: str) -> Iterator[CheckpointEntry]:
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for shard, (proj, size) in enumerate((("q_proj", q), ("k_proj", kv), ("v_proj", kv))):
            yield f"{prefix}{proj}.weight", (size, c.hidden_size), self.qkv_proj.weight, shard
            if self.qkv_proj.bias is not None:
                yield f"{prefix}{proj}.bias", (size,), self.qkv_proj.bias, shard
        yield f"{prefix}o_proj.weight", (c.hidden_size, q), self.o_proj.weight, 0
        if self.o_proj.bias is not None:
            yield f"{prefix}o_proj.bias", (c.hidden_size,), self.o_proj.bias, 0


class HeadNormedAttention(LlamaAttention):
    """Llama's attention with an RMSNorm over each query and key head before rotary (Qwen3, Gemma 3:
    `head_norm_cls` says which kind); the q_norm / k_norm weights are [head_dim], shared by every head and
    so replicated across ranks."""

    head_norm_cls: type[HeadRMSNorm] = HeadRMSNorm

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> None:
        super().__init__(cfg, tp, dtype, device, fused)
        self.q_norm = self.head_norm_cls(cfg.head_dim, cfg.rms_norm_eps, dtype, device, fused)
        self.k_norm = self.head_norm_cls(cfg.head_dim, cfg.rms_norm_eps, dtype, device, fused)

    def project_qkv(
        self, hidden: torch.Tensor | NormedInput
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_qkv(hidden)
        return self.q_norm(q), self.k_norm(k), v

    def checkpoint_entries(self, prefix: str) -> Iterator[CheckpointEntry]:
        yield from super().checkpoint_entries(prefix)
        yield f"{prefix}q_norm.weight", (self.head_dim,), self.q_norm.weight, 0
        yield f"{prefix}k_norm.weight", (self.head_dim,), self.k_norm.weight, 0


class LlamaMLP(nn.Module):
    """The SiLU-gated MLP, intermediate_size wide unless `intermediate_size` says otherwise (Qwen2-MoE's
    shared expert)."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.fused = fused
        self.intermediate_size = size = intermediate_size or cfg.intermediate_size
        method = linear_method(cfg.quantization, device)
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [size, size], cfg.mlp_bias, tp, dtype, device, method
        )
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, cfg.mlp_bias, tp, dtype, device, method)

    def forward(self, x: torch.Tensor | NormedInput, reduce: bool = True) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), reduce, silu_mul=True)

    def checkpoint_entries(self, prefix: str) -> Iterator[CheckpointEntry]:
        h, i = self.config.hidden_size, self.intermediate_size
        for shard, proj in enumerate(("gate_proj", "up_proj")):
            yield f"{prefix}{proj}.weight", (i, h), self.gate_up_proj.weight, shard
            if self.gate_up_proj.bias is not None:
                yield f"{prefix}{proj}.bias", (i,), self.gate_up_proj.bias, shard
        yield f"{prefix}down_proj.weight", (h, i), self.down_proj.weight, 0
        if self.down_proj.bias is not None:
            yield f"{prefix}down_proj.bias", (h,), self.down_proj.bias, 0


def reduce_add_norm(
    tp: TPGroup, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor, partial: bool
) -> torch.Tensor | NormedInput:
    """norm(x + residual), the residual updated in place; a `partial` x is first summed over the ranks, in
    the same kernel when the all-reduce strategy can (TPGroup.strategy.add_rms_norm). Else deferred to
    the linear layer it feeds (NormedInput), which may fuse it with its input's quantization."""
    if partial:
        fused = tp.strategy.add_rms_norm(x, residual, norm.weight, norm.eps)
        if fused is not None:
            return fused
        x = tp.all_reduce(x)
    return norm.deferred(x, residual)


class DecoderLayer(nn.Module):
    """A layer of LlamaForCausalLM's decoder: its attention, its feed-forward and the norms `norm_names`
    lists (each a [hidden_size] checkpoint tensor under its own name). Its forward takes and returns the
    residual-stream form of LlamaDecoderLayer.forward."""

    norm_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, self_attn: LlamaAttention, mlp: FeedForward) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp

    def checkpoint_entries(self, prefix: str, mlp_name: str) -> Iterator[CheckpointEntry]:
        """Its checkpoint tensors under `prefix` ("model.layers.3."), the feed-forward's under `mlp_name`."""
        for name in self.norm_names:
            weight = cast(RMSNorm, getattr(self, name)).weight
            yield f"{prefix}{name}.weight", tuple(weight.shape), weight, 0
        yield from self.self_attn.checkpoint_entries(f"{prefix}self_attn.")
        yield from self.mlp.checkpoint_entries(f"{prefix}{mlp_name}.")


class LlamaDecoderLayer(DecoderLayer):
    norm_names = ("input_layernorm", "post_attention_layernorm")

    def __init__(
        self,
        cfg: ModelConfig,
        self_attn: LlamaAttention,
        mlp: FeedForward,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool,
        tp: TPGroup,
        norm_cls: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__(self_attn, mlp)
        self.tp = tp
        # Set by the model when every layer can: the row-parallel outputs leave unreduced and the norm
        # after each sums them (one kernel for all-reduce + residual add + RMSNorm).
        self.reduce_in_norm = False
        self.input_layernorm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, fused)
        self.post_attention_layernorm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, fused)
        # Each block's output times this as it joins the residual stream (Granite's); 1: as it is.
        self.residual_multiplier = cfg.residual_multiplier

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
        partial = self.reduce_in_norm
        normed: torch.Tensor | NormedInput
        if residual is None:
            residual = hidden
            normed = self.input_layernorm.deferred(hidden)
        else:
            normed = reduce_add_norm(self.tp, self.input_layernorm, hidden, residual, partial)
        hidden = self.self_attn(normed, cos, sin, kv_cache, meta, reduce=not partial)
        if partial:
            normed = reduce_add_norm(self.tp, self.post_attention_layernorm, hidden, residual, partial)
            return cast(LlamaMLP, self.mlp)(normed, reduce=False), residual
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        normed = reduce_add_norm(self.tp, self.post_attention_layernorm, hidden, residual, partial)
        hidden = self.mlp(normed)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool,
        layers: list[DecoderLayer],
        norm_cls: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
        self.layers = nn.ModuleList(layers)
        self.norm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, fused)
        self.ropes = LayerRopes(cfg, device)  # OLMo 3's windowed layers have their own


class LlamaForCausalLM(nn.Module):
    """A pre-norm decoder with rotary attention and a SiLU-gated feed-forward. Other families change it
    through `attention_cls` (Qwen3's q/k norms), `norm_cls` and `embed` (Gemma's (1 + w) norms and scaled
    embedding), `make_mlp` (sparse experts, GeGLU) and `mlp_checkpoint_name`; the forward pass, the
    checkpoint mapping and the rest of the interface (models/interface.py) stay here. A family with another
    layer layout (OLMo 2's post-norms) builds its own layers through `make_layer`."""

    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention
    norm_cls: ClassVar[type[RMSNorm]] = RMSNorm
    # The checkpoint's name for a layer's feed-forward (ours is always `mlp`).
    mlp_checkpoint_name: ClassVar[str] = "mlp"

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool = False
    ) -> None:
        """`fused`: residual add + RMSNorm, rotary and SiLU-mul as Triton kernels (CUDA)."""
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        layers = [self.make_layer(i, tp, dtype, device, fused) for i in range(cfg.num_layers)]
        self.tp = tp
        # Fusing each all-reduce into the norm after it needs Llama's layers (the norm that sums a block's
        # output also adds it to the residual; OLMo 2 norms the block's output before the add), dense ones
        # whose row-parallel outputs have no bias (the bias would be added before the sum), a strategy that
        # fuses, and Llama's norm (the fused all-reduce + norm kernel has no (1 + w) form).
        llama_layers = [layer for layer in layers if isinstance(layer, LlamaDecoderLayer)]
        self.reduce_in_norm = (
            tp.strategy.fuses_add_rms_norm
            and len(llama_layers) == len(layers)
            and not self.norm_cls.unit_offset
            and cfg.residual_multiplier == 1.0  # the partial sums join the residual stream unscaled
            and not cfg.o_proj_bias
            and all(type(layer.mlp) is LlamaMLP and layer.mlp.down_proj.bias is None for layer in layers)
        )
        for layer in llama_layers:
            layer.reduce_in_norm = self.reduce_in_norm
        self.model = LlamaModel(cfg, tp, dtype, device, fused, layers, self.norm_cls)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.num_local_kv_heads: int = layers[0].self_attn.num_kv_heads
        if fused:  # decode graphs' matmuls as Triton kernels where they beat cuBLAS (layers/linear.py)
            use_matmul(self, TritonMatmul.for_device(device))
        # Checkpoint name -> (full shape, parameter, shard index), listed once from the modules themselves.
        self._checkpoint = {name: (shape, p, shard) for name, shape, p, shard in self._checkpoint_entries()}

    def make_layer(
        self, layer: int, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> DecoderLayer:
        """Decoder layer `layer`: Llama's, of `attention_cls`, `make_mlp` and `norm_cls`."""
        cfg = self.config
        attention = self.attention_cls(cfg, tp, dtype, device, fused)
        attention.window = cfg.layer_window(layer)  # Qwen2, Qwen3, SmolLM3, Qwen2-MoE: some layers only
        mlp = self.make_mlp(layer, tp, dtype, device, fused)
        return LlamaDecoderLayer(cfg, attention, mlp, dtype, device, fused, tp, self.norm_cls)

    def make_mlp(
        self, layer: int, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> FeedForward:
        """Layer `layer`'s feed-forward."""
        return LlamaMLP(self.config, tp, dtype, device, fused)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's input: each token's embedding row (times Granite's embedding_multiplier)."""
        out: torch.Tensor = self.model.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:
            out = out * self.config.embedding_multiplier
        return out

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per scheduled token."""
        hidden = self.embed(input_ids)
        residual = None
        ropes = self.model.ropes.for_layers(positions)
        for layer, kv_cache, (cos, sin) in zip(self.model.layers, kv_caches, ropes, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
        if residual is None:  # no layers
            return self.model.norm(hidden)
        return as_tensor(reduce_add_norm(self.tp, self.model.norm, hidden, residual, self.reduce_in_norm))

    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads on this rank: every parameter but the input embedding table,
        of which a step reads only its rows (a tied table is read whole by the LM head). With sparse
        experts this counts every expert: the bound a batch that hits them all reaches."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        if not self.config.tie_word_embeddings:
            embed = self.model.embed_tokens.weight
            total -= embed.numel() * embed.element_size()
        return total

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return logits

    def _checkpoint_entries(self) -> Iterator[CheckpointEntry]:
        c, h = self.config, self.config.hidden_size
        yield "model.embed_tokens.weight", (c.vocab_size, h), self.model.embed_tokens.weight, 0
        for i, layer in enumerate(self.model.layers):
            prefix = f"model.layers.{i}."
            yield from cast(DecoderLayer, layer).checkpoint_entries(prefix, self.mlp_checkpoint_name)
        yield "model.norm.weight", (h,), self.model.norm.weight, 0
        if not c.tie_word_embeddings:
            yield "lm_head.weight", (c.vocab_size, h), self.lm_head.weight, 0

    def checkpoint_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Names and full (unsharded) shapes of the tensors a Hugging Face checkpoint of this model holds."""
        for name, (shape, _, _) in self._checkpoint.items():
            yield name, shape

    def fused_checkpoint_parts(self, name: str) -> tuple[tuple[str, int], ...]:
        return ()  # every tensor of this family's checkpoints is one of checkpoint_shapes'

    def checkpoint_row_order(self, name: str) -> list[int] | None:
        pairs = self.config.rope.pass_pairs
        if not pairs or not name.endswith(_ROTATED_TENSORS):
            return None
        return partial_rotary_order(self.config.head_dim, pairs)

    def tied_checkpoint_names(self) -> dict[str, str]:
        """A tied LM head is the embedding; a checkpoint may still hold it (see loader.load_weights)."""
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.config.tie_word_embeddings else {}

    def checkpoint_targets(self, name: str) -> Iterator[tuple[nn.Parameter, int]]:
        """The parameter a checkpoint tensor name feeds, with the shard index inside a fused one."""
        if name.startswith("lm_head.") and self.config.tie_word_embeddings:
            return  # tied: the embedding provides it
        if unused_checkpoint_tensor(name):
            return
        _, param, shard = self._checkpoint[name]  # KeyError: not a tensor of this model
        yield param, shard


# ----------------------------------------------------------------------------- config adapters
# Each maps a Hugging Face config to the ModelConfig fields its architecture sets (models/registry.py).


def llama_config(hf: Any) -> dict[str, Any]:
    bias = bool(getattr(hf, "attention_bias", False))
    return {"qkv_bias": bias, "o_proj_bias": bias, "mlp_bias": bool(getattr(hf, "mlp_bias", False))}


def granite_config(hf: Any) -> dict[str, Any]:
    """Granite: Llama with four scalings (ModelConfig's attention_multiplier, embedding_multiplier,
    residual_multiplier, logits_scaling); its attention scale is attention_multiplier, not
    head_dim ** -0.5."""
    scalings = {}
    for name in ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling"):
        value = getattr(hf, name, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ConfigError(f"Granite {name} must be a positive number, got {value!r}; check config.json")
        scalings[name] = float(value)
    return {**llama_config(hf), **scalings}


def mistral_config(hf: Any) -> dict[str, Any]:
    # transformers' Mistral has no biases, whatever attention_bias / mlp_bias its config carries.
    return {"sliding_window": getattr(hf, "sliding_window", None)}


def qwen_layer_windows(hf: Any, family: str) -> dict[str, Any]:
    """Qwen2's and Qwen3's windows, from transformers' `layer_types` (with use_sliding_window, the layers
    from max_window_layers on attend within sliding_window, the others to the whole context); none without
    layer_types, and none where sliding_window is null (vLLM's reading; transformers fails)."""
    if not getattr(hf, "layer_types", None):
        return {"sliding_window": None}
    windows = layer_windows(hf, family)
    if windows["sliding_window"] is None:
        return {"sliding_window": None}
    if len(windows["sliding_window_layers"]) == int(hf.num_hidden_layers):
        return {"sliding_window": windows["sliding_window"]}  # every layer: one window for all
    return windows


def qwen2_config(hf: Any) -> dict[str, Any]:
    return {"qkv_bias": True, "o_proj_bias": False, **qwen_layer_windows(hf, "Qwen2")}


def smollm3_config(hf: Any) -> dict[str, Any]:
    """SmolLM3: Llama (attention_bias on q/k/v and o, mlp_bias) whose layers `no_rope_layers` marks 0 use
    no rotary embedding (NoPE), and whose layers `layer_types` marks sliding attend within sliding_window
    (transformers' default: the NoPE layers, with use_sliding_window)."""
    num_layers = int(hf.num_hidden_layers)
    flags = getattr(hf, "no_rope_layers", None)
    if (
        not isinstance(flags, (list, tuple))
        or len(flags) < num_layers
        or any(type(f) not in (int, bool) or f not in (0, 1) for f in flags[:num_layers])
    ):
        raise ConfigError(
            f"SmolLM3 no_rope_layers {flags!r} must give 1 (rotary) or 0 (no rotary) for each of the "
            f"{num_layers} layers; fix it in config.json, or remove it to get no_rope_layer_interval's"
        )
    return {
        **llama_config(hf),
        **windowed_layers(hf, "SmolLM3"),
        "nope_layers": tuple(i for i in range(num_layers) if not flags[i]),
    }


def layer_windows(hf: Any, family: str) -> dict[str, Any]:
    """ModelConfig's sliding_window and sliding_window_layers from transformers' `layer_types` (Gemma 2
    and 3, OLMo 3): the layers it marks "sliding_attention" attend within sliding_window, the others to
    the whole context."""
    num_layers = int(hf.num_hidden_layers)
    layer_types = list(getattr(hf, "layer_types", None) or [])
    if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ConfigError(
            f"{family} layer_types {layer_types!r} must name sliding_attention or full_attention for each "
            f"of the {num_layers} layers"
        )
    window = getattr(hf, "sliding_window", None)
    windowed = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    # ModelConfig.sliding_window: the window whenever any layer has one.
    return {"sliding_window": window if window and windowed else None, "sliding_window_layers": windowed}


def windowed_layers(hf: Any, family: str) -> dict[str, Any]:
    """layer_windows for the families whose transformers class windows the layers `layer_types` marks
    sliding by sliding_window whatever use_sliding_window says (SmolLM3, Qwen2-MoE: their masks and caches
    follow layer_types); a sliding layer with no window (transformers fails on it) is a ConfigError."""
    windows = layer_windows(hf, family)
    if windows["sliding_window_layers"] and not windows["sliding_window"]:
        raise ConfigError(
            f"{family} layer_types marks layers {list(windows['sliding_window_layers'])} sliding_attention "
            f"but sliding_window is {getattr(hf, 'sliding_window', None)!r}; set sliding_window (with "
            "use_sliding_window true) or mark those layers full_attention"
        )
    return windows
