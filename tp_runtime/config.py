"""Frozen engine configuration, validated once at the edge.

Everything here is plain data (no tensors) so it can travel to spawned workers and be rebuilt from the
same command line under torchrun.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tp_runtime.errors import ConfigError, InvalidRequestError

# Choices of EngineConfig.attention_backend (see layers/attention.py).
ATTENTION_BACKENDS = ("auto", "torch", "triton", "triton_one_split")
# Choices of ParallelConfig.all_reduce (see distributed.py).
ALL_REDUCE_STRATEGIES = ("auto", "nccl", "symm_mem")

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")
# vLLM's (and torch's) other names of two of them.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str
    theta: float
    # Inverse frequencies from HF's own rope init functions (exactly what transformers uses), as floats.
    inv_freq: tuple[float, ...]
    attention_scaling: float
    # Partial rotary embeddings (Phi-4-mini): each head's first 2 * len(inv_freq) dims rotate and the last
    # 2 * pass_pairs pass through (layers/rotary.py).
    pass_pairs: int = 0
    # "dynamic" NTK scaling only changes frequencies past max_position_embeddings, which max_model_len
    # never exceeds, so within the engine it is the frequencies HF starts from.


# Choices of LLM(quantization=...) (None: as the checkpoint says).
QUANTIZATIONS = ("fp8",)
# The largest finite float8_e4m3fn value: FP8 scales map a row's (or block's) absolute maximum to it.
FP8_E4M3_MAX = 448.0
# Choices of CacheConfig.kv_cache_dtype: the model's dtype, or e4m3 ("fp8" is vLLM's name for it too).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")

# LLM(generation_config=...) / --generation-config, as vLLM's: "auto" (the checkpoint's
# generation_config.json), "vllm" (none: SamplingParams' own defaults) or a folder holding a
# generation_config.json.
GENERATION_CONFIG_SOURCES = ("auto", "vllm")
# The keys of generation_config.json that become requests' default sampling parameters (vLLM's list), and
# the SamplingParams option each sets (transformers' max_new_tokens is max_tokens).
GENERATION_DEFAULT_KEYS = {
    "repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
    "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens",
}  # fmt: skip


@dataclass(frozen=True)
class GenerationDefaults:
    """The default sampling parameters of requests that leave them out, read at start-up from a
    generation_config.json (vLLM's `generation_config`, see GENERATION_DEFAULT_KEYS): `LLM.generate` and
    `LLM.chat` without SamplingParams start from them, and so does each server request, option by option
    (its max_tokens at most this one). None: SamplingParams' own default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    source: str | None = None  # the generation_config.json they come from (None: none was read)

    def overrides(self) -> dict[str, Any]:
        """The SamplingParams options these set, by name, in GENERATION_DEFAULT_KEYS' order (empty: none)."""
        values = {name: getattr(self, name) for name in GENERATION_DEFAULT_KEYS.values()}
        return {name: value for name, value in values.items() if value is not None}

    def describe(self) -> str:
        """`temperature=0.6, top_p=0.95, max_tokens=256` (empty: none)."""
        return ", ".join(f"{name}={value!r}" for name, value in self.overrides().items())


@dataclass(frozen=True)
class QuantConfig:
    """How the linear layers' weights are stored: FP8 (e4m3) with float32 scales.

    weight_scales: "channel" (one per output feature), "tensor" (one per checkpoint tensor: q, k and v each
    have their own) or "block" (one per block_size[0] x block_size[1] tile).
    checkpoint_format: where the FP8 weights come from: "compressed-tensors" (llm-compressor's
    float-quantized, scales in `*.weight_scale`), "fp8" (transformers' FP8, scales in `*.weight_scale_inv`
    for blocks, `*.weight_scale` per tensor) or "online" (a 16/32-bit checkpoint quantized at load with
    per-channel scales, amax / 448).
    ignore: the checkpoint's modules that stay unquantized; compressed-tensors names them exactly (or
    with "re:" regexes), transformers' FP8 by its own rule (`ignore_like_transformers`, see is_ignored)."""

    checkpoint_format: str
    weight_scales: str
    block_size: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()
    ignore_like_transformers: bool = False

    def __post_init__(self) -> None:
        if self.checkpoint_format not in ("compressed-tensors", "fp8", "online"):
            raise ConfigError(f"internal: FP8 checkpoint format {self.checkpoint_format!r}")
        if self.weight_scales not in ("channel", "tensor", "block"):
            raise ConfigError(
                f"FP8 weight scales {self.weight_scales!r} are not supported (channel, tensor, block)"
            )
        if (self.weight_scales == "block") != (self.block_size is not None):
            raise ConfigError("FP8 block scales need a block size (and only block scales have one)")
        if self.block_size is not None and (
            len(self.block_size) != 2 or any(b < 1 or b & (b - 1) for b in self.block_size)
        ):
            raise ConfigError(f"FP8 weight block size {list(self.block_size)} must be two powers of two")

    @property
    def scale_suffixes(self) -> tuple[str, ...]:
        """The checkpoint names' endings of a weight's scale tensors (after the module name)."""
        if self.checkpoint_format == "online":
            return ()
        if self.checkpoint_format == "fp8" and self.block_size:
            return ("weight_scale_inv",)
        if self.checkpoint_format == "fp8":
            # AutoFP8 (and vLLM) name a per-tensor scale `weight_scale`; transformers' FP8Linear without a
            # weight_block_size saves it as `weight_scale_inv` (a multiplier all the same).
            return ("weight_scale", "weight_scale_inv")
        return ("weight_scale",)

    @property
    def activation_scale_suffixes(self) -> tuple[str, ...]:
        """The names' endings of static activation scales (read and dropped: activations get dynamic
        scales): compressed-tensors' and AutoFP8's `input_scale`, transformers' FP8 `activation_scale`."""
        return ("input_scale", "activation_scale")

    def is_ignored(self, module: str) -> bool:
        """Whether checkpoint module `module` (e.g. "model.layers.0.self_attn.q_proj") stays unquantized."""
        for entry in self.ignore:
            if self.ignore_like_transformers:
                # transformers' `modules_to_not_convert`: a regex matched from the start up to a module
                # boundary ("model.layers.1" takes "model.layers.1.mlp", not "model.layers.10.mlp", nor
                # "model.layers.3.mlp.gate" its "gate_proj"), or a plain suffix ("lm_head").
                if module.endswith(entry) or _matches_to_boundary(entry, module):
                    return True
            elif entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif module == entry or module.endswith("." + entry):
                return True
        return False


def _matches_to_boundary(pattern: str, module: str) -> bool:
    """`pattern` (a regex; taken literally where it is not one) matches `module` from its start up to a dot
    or its end."""
    try:
        return re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module) is not None
    except re.error:
        return re.match(rf"{re.escape(pattern)}(?=\.|$)", module) is not None


def quant_config(hf_quantization: Any, requested: str | None) -> QuantConfig | None:
    """The QuantConfig of a checkpoint whose config.json has `quantization_config` = `hf_quantization`
    (None: not quantized), with LLM(quantization=`requested`) on top (None: as the checkpoint says; "fp8":
    FP8, quantizing a 16/32-bit checkpoint at load)."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ConfigError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {requested!r}"
        )
    if hf_quantization is None:
        if requested == "fp8":
            return QuantConfig(checkpoint_format="online", weight_scales="channel")
        return None
    try:
        return _checkpoint_quant_config(hf_quantization, requested)
    except (TypeError, AttributeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        # A field of the wrong kind (a list for a mapping, a string for a list): the walk fails on it.
        raise ConfigError(
            f"config.json's quantization_config is malformed ({type(exc).__name__}: {exc}); fix the file"
        ) from None


def _checkpoint_quant_config(hf_quantization: Any, requested: str | None) -> QuantConfig | None:
    hq = hf_quantization if isinstance(hf_quantization, Mapping) else vars(hf_quantization)
    method = hq.get("quant_method")
    if method == "fp8":
        block = hq.get("weight_block_size")
        if hq.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise ConfigError(f"FP8 activation_scheme {hq.get('activation_scheme')!r} is not supported")
        _check_fp8_format(hq.get("fmt", "e4m3"))
        return QuantConfig(
            checkpoint_format="fp8",
            weight_scales="block" if block else "tensor",
            block_size=_block_size(block) if block else None,
            # `ignored_layers`: AutoFP8's name of the list (transformers and vLLM read it too).
            ignore=_names(
                hq.get("modules_to_not_convert") or hq.get("ignored_layers"), "modules_to_not_convert"
            ),
            ignore_like_transformers=True,
        )
    if method == "compressed-tensors":
        # None: only the KV cache (or attention) is quantized; the linear weights are 16/32-bit
        return _compressed_tensors_config(hq) or quant_config(None, requested)
    raise ConfigError(
        f"the checkpoint is quantized with {method!r}, which is not supported; FP8 checkpoints "
        "(compressed-tensors float-quantized, or transformers' fp8) and 16/32-bit ones are"
    )


def hf_quantization_config(hf: Any) -> Any:
    """A checkpoint config's quantization_config; older llm-compressor (compressed-tensors) releases
    name it `compression_config` (vLLM reads both)."""
    found = getattr(hf, "quantization_config", None)
    return found if found is not None else getattr(hf, "compression_config", None)


def _check_fp8_format(fmt: Any) -> None:
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise ConfigError(f"FP8 format {fmt!r} is not supported (only e4m3)")


def _block_size(block: Any) -> tuple[int, int]:
    if not isinstance(block, list | tuple) or len(block) != 2 or not all(type(b) is int for b in block):
        raise ConfigError(f"FP8 weight_block_size must be two ints, got {block!r}")
    return (block[0], block[1])


def _targets_attention(group: Mapping[str, Any]) -> bool:
    """A compressed-tensors group aimed at attention modules (llm-compressor's attention quantization):
    no weights of its own (a group of the attention's projections by name quantizes weights)."""
    targets = group.get("targets") or []
    attention = bool(targets) and all("Attention" in t or "self_attn" in t for t in targets)
    return attention and not group.get("weights")


def _check_kv_cache_scheme(scheme: Any) -> None:
    """A compressed-tensors kv_cache_scheme must be what layers/kv_fp8.py reads: one static, symmetric
    8-bit float scale a layer for keys and one for values."""
    if scheme is None:
        return
    ok = (
        isinstance(scheme, Mapping)
        and scheme.get("type") == "float"
        and scheme.get("num_bits") == 8
        and scheme.get("strategy", "tensor") == "tensor"
        and not scheme.get("dynamic", False)
        and scheme.get("symmetric", True)
    )
    if not ok:
        raise ConfigError(
            f"compressed-tensors kv_cache_scheme {scheme!r} is not supported; only static, symmetric 8-bit "
            "float scales per tensor (one for keys and one for values a layer) are"
        )


def _compressed_tensors_config(hq: Mapping[str, Any]) -> QuantConfig | None:
    fmt = hq.get("format")
    _check_kv_cache_scheme(hq.get("kv_cache_scheme"))
    # Rotated weights (QuIP / SpinQuant transforms) need their rotations at run time, and sparse ones may be
    # stored compressed: refused, rather than run wrong or failing on their tensors' names.
    if hq.get("transform_config"):
        raise ConfigError(
            "compressed-tensors checkpoints with a transform_config (QuIP / SpinQuant rotations) are not "
            "supported"
        )
    sparsity = hq.get("sparsity_config")
    if sparsity and dict(sparsity).get("format", "dense") != "dense":
        raise ConfigError(
            f"compressed-tensors sparse weights ({dict(sparsity).get('format')!r}) are not supported; only "
            "dense ones are"
        )
    # Attention groups only bring query and probability scales, which set nothing: attention runs in the
    # model dtype (layers/kv_fp8.py).
    groups = {name: g for name, g in dict(hq.get("config_groups") or {}).items() if not _targets_attention(g)}
    if not groups:
        return None
    linear_groups = [g for g in groups.values() if "Linear" in (g.get("targets") or [])]
    # Groups that name some layers beside a "Linear" one with the same scheme change nothing.
    schemes = {json.dumps([g.get("weights"), g.get("input_activations")], sort_keys=True, default=str)
               for g in groups.values()}  # fmt: skip
    if len(linear_groups) != 1 or len(schemes) != 1:
        targets = [g.get("targets") for g in groups.values()]
        raise ConfigError(
            f"compressed-tensors checkpoints with {len(groups)} quantization groups (targets {targets}) are "
            'not supported; only one group whose targets include "Linear" is'
        )
    group = linear_groups[0]
    weights = group.get("weights") or {}
    # "naive-quantized": early llm-compressor FP8 releases; the weights are stored in e4m3 all the same (the
    # loader refuses any weight that is not).
    float_formats = (None, "float-quantized", "naive-quantized")
    if weights.get("type") != "float" or weights.get("num_bits") != 8 or fmt not in float_formats:
        raise ConfigError(
            f"compressed-tensors format {fmt!r} with {weights.get('num_bits')}-bit {weights.get('type')} "
            "weights is not supported; only FP8 (float-quantized, 8-bit float) is"
        )
    if weights.get("dynamic") or not weights.get("symmetric", True):
        raise ConfigError("compressed-tensors FP8 weights must be static and symmetric")
    if group.get("output_activations") is not None:
        raise ConfigError("compressed-tensors output activation quantization is not supported")
    strategy = weights.get("strategy")
    block = weights.get("block_structure") if strategy == "block" else None
    if strategy not in ("channel", "tensor", "block"):
        raise ConfigError(
            f"compressed-tensors FP8 weight strategy {strategy!r} is not supported (channel, tensor, block)"
        )
    activations = group.get("input_activations")
    if activations is not None and (activations.get("type") != "float" or activations.get("num_bits") != 8):
        raise ConfigError("compressed-tensors input activations must be FP8 (or not quantized)")
    if activations is not None and not activations.get("symmetric", True):
        raise ConfigError(
            "compressed-tensors asymmetric input activations (with zero points) are not supported; only "
            "symmetric FP8 ones are"
        )
    return QuantConfig(
        checkpoint_format="compressed-tensors",
        weight_scales=strategy,
        block_size=_block_size(block) if block is not None else None,
        ignore=_ignore_list(hq.get("ignore")),
    )


def _ignore_list(value: Any) -> tuple[str, ...]:
    """compressed-tensors' `ignore`: module names, or regexes after "re:" (checked here, not at load)."""
    names = _names(value, "ignore")
    for entry in names:
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as exc:
                raise ConfigError(
                    f"quantization_config's ignore entry {entry!r} is not a valid regex ({exc})"
                ) from None
    return names


def _names(value: Any, field: str) -> tuple[str, ...]:
    """A quantization_config list of module names or patterns (None: empty)."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"quantization_config's {field} must be a list of module names, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class ModelConfig:
    path: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    max_model_len: int
    dtype: str  # resolved: float32 | bfloat16 | float16
    rope: RopeConfig
    load_format: str  # auto | dummy
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # generation_config.json says eos_token_id: [] (no EOS): with eos_token_ids empty, generation then
    # stops at no EOS, not even the tokenizer's (which ends it where the configs name none).
    no_eos: bool = False
    # Sparse mixture-of-experts feed-forward (Mixtral, Qwen3-MoE, Qwen2-MoE) on the layers in moe_layers;
    # the others (all, for dense families) have a dense MLP of intermediate_size.
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's FFN width
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    # Qwen2-MoE: the width of the dense expert every token of a sparse layer also goes through, its output
    # scaled by a sigmoid gate per token (0: none).
    shared_expert_intermediate_size: int = 0
    # The layers whose attention applies no rotary embedding (SmolLM3's NoPE layers).
    nope_layers: tuple[int, ...] = ()
    # The layers that attend within sliding_window; None: every layer (when sliding_window is set).
    # sliding_window is the window whenever any layer has one (the runner then keeps fresh prompts' block
    # tables); layer_window(i) is layer i's own.
    sliding_window_layers: tuple[int, ...] | None = None
    # The dense MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma 2).
    hidden_act: str = "silu"
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    query_pre_attn_scalar: float | None = None
    # Soft-capping, cap * tanh(x / cap): of attention scores before masking, and of the final logits.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Granite's scalings: attention scores times attention_multiplier (None: attention_scale's rule), the
    # embedding output times embedding_multiplier, each block's output times residual_multiplier as it
    # joins the residual stream, the logits divided by logits_scaling (1: none).
    attention_multiplier: float | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # FP8 linear layers (None: the model dtype's).
    quantization: QuantConfig | None = None
    # The rope of the sliding-window layers where the config gives them their own (Gemma 3's local base
    # frequency); None: `rope` serves every layer.
    local_rope: RopeConfig | None = None
    # Requests' default sampling parameters, from the generation config LLM(generation_config=...) names.
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)

    def __post_init__(self) -> None:
        # config.json values no model can have. transformers' configs check their integer fields' types but
        # take any float: a NaN eps, rope base or soft-cap gave NaN logits (greedy token 0 every step) and a
        # zero query_pre_attn_scalar a ZeroDivisionError while the model was built.
        def bad(name: str, value: object, want: str) -> ConfigError:
            return ConfigError(f"{name} must be {want}, got {value!r}; check config.json")

        def finite(value: float | None) -> bool:
            return value is None or (isinstance(value, int | float) and math.isfinite(value))

        if not self.max_model_len >= 2:
            raise ConfigError(
                f"max_model_len must be >= 2, got {self.max_model_len} (the model's max_position_embeddings, "
                "unless given); check config.json"
            )
        for name in ("rms_norm_eps", "query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping", "logits_scaling"):  # fmt: skip
            value = getattr(self, name)
            if not finite(value) or (value is not None and value <= 0):
                raise bad(name, value, "a finite number above 0")
        for name in ("attention_multiplier", "embedding_multiplier", "residual_multiplier"):
            if not finite(getattr(self, name)):
                raise bad(name, getattr(self, name), "a finite number")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise bad("sliding_window", self.sliding_window, "at least 1 (or null: no window)")
        for rope in (self.rope, self.local_rope):
            if rope is not None and not all(map(math.isfinite, (*rope.inv_freq, rope.attention_scaling))):
                raise ConfigError(
                    f"the rope parameters of config.json give non-finite frequencies (rope type "
                    f"{rope.rope_type!r}, base {rope.theta}); check rope_theta and the rope factors"
                )

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it attends to the whole context)."""
        if self.sliding_window_layers is None or layer in self.sliding_window_layers:
            return self.sliding_window
        return None

    @property
    def attention_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        base = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return float(base**-0.5)


# The longest step or start-up timeout (a year): anything longer means "never" and overflows a timedelta.
MAX_TIMEOUT_S = 365 * 24 * 3600.0


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # "auto": in-process at TP=1, spawned worker processes at TP>1; "torchrun": ranks started by torchrun.
    executor: str = "auto"
    # Seconds a single step or control call may take before the driver gives up.
    step_timeout_s: float = 300.0
    # Seconds the ranks may take to start, load the model and greet the driver.
    startup_timeout_s: float = 600.0
    # Host the torchrun driver binds its sockets on (MASTER_ADDR); spawned workers always use loopback/ipc.
    driver_host: str = "127.0.0.1"
    # Busy-poll a socket this long before blocking on it, to save the wake-up latency of each hop.
    # Off by default: on 2 CPU cores it starves the ranks computing the model, and on an H200 host at
    # TP=2 2 ms of it did not lower the measured host gap (BENCHMARKS.md).
    spin_wait_s: float = 0.0
    # All-reduce between ranks: "auto" (PyTorch symmetric memory for decode-sized messages when every GPU
    # reaches its peers, NCCL for the rest and as the fallback; gloo on CPU), "nccl" (NCCL/gloo only),
    # "symm_mem" (fail at start-up rather than fall back).
    all_reduce: str = "auto"

    def __post_init__(self) -> None:
        if not 0.0 <= self.spin_wait_s <= 1.0:
            raise ConfigError(f"spin_wait_s must be in [0, 1], got {self.spin_wait_s}")
        if not isinstance(self.tensor_parallel_size, int) or isinstance(self.tensor_parallel_size, bool):
            raise ConfigError(
                f"tensor_parallel_size must be an int, got {self.tensor_parallel_size!r} "
                f"({type(self.tensor_parallel_size).__name__})"
            )
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.all_reduce not in ALL_REDUCE_STRATEGIES:
            raise ConfigError(
                f"all_reduce must be {'|'.join(ALL_REDUCE_STRATEGIES)}, got {self.all_reduce!r}"
            )
        if self.executor not in ("auto", "inprocess", "multiprocess", "torchrun"):
            raise ConfigError(f"executor must be auto|inprocess|multiprocess|torchrun, got {self.executor!r}")
        for name in ("step_timeout_s", "startup_timeout_s"):
            value = getattr(self, name)
            # Bounded: the workers hand it to torch.distributed as a timedelta.
            if not 0 < value <= MAX_TIMEOUT_S:
                raise ConfigError(f"{name} must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {value}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Fixed number of KV blocks (mainly for tests that force preemption); None sizes the cache from memory.
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    # KV cache per rank on the CPU, GiB; None: what max_num_seqs sequences of max_model_len need, at most
    # worker.kv_sizing.CPU_KV_CACHE_RAM_SHARE of the RAM available, split over the ranks.
    cpu_kv_cache_gib: float | None = None
    # Reuse the KV blocks of a prompt's prefix that an earlier request computed (engine/kv_cache.py).
    enable_prefix_caching: bool = True
    # "auto": keys and values in the model's dtype; "fp8" / "fp8_e4m3": e4m3 with per-layer scales
    # (layers/kv_fp8.py), half the bytes of bf16.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_gib is not None and not self.cpu_kv_cache_gib > 0:
            raise ConfigError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be {'|'.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
                + ("; only e4m3 FP8 is supported (fp8_e4m3)" if self.kv_cache_dtype == "fp8_e5m2" else "")
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    # A tokenizer folder or Hub id other than the model's (vLLM's `tokenizer`); None: the model's folder.
    tokenizer: str | None = None
    # transformers may run the Python a checkpoint or tokenizer folder ships (vLLM's trust_remote_code).
    trust_remote_code: bool = False
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"  # resolved: cpu | cuda
    seed: int = 0
    # The driver schedules and sends step N+1 before it has step N's sampled ids (it learns of a stop one
    # step late and drops that step's token); workers take input tokens from the device. False: one step
    # at a time, each waiting for the previous one's ids.
    async_scheduling: bool = True
    # Decode steps as CUDA graphs: "auto" (on CUDA), "off" (always eager), "padded" (the graph path's
    # padded static inputs run eagerly, to check that path on CPU).
    cuda_graphs: str = "auto"
    # Attention over the paged cache: "auto" (split-KV Triton kernels on CUDA if Triton is installed,
    # else PyTorch), "torch" (gathered blocks + SDPA), "triton" (split-KV), "triton_one_split" (one
    # program per sequence and KV head; for comparison).
    attention_backend: str = "auto"
    # Residual add + RMSNorm, rotary and SiLU-mul: "auto" (fused Triton kernels on CUDA if Triton is
    # installed, else PyTorch ops), "torch", "triton".
    fused_kernels: str = "auto"
    # The most logprobs / prompt_logprobs a request may ask for (vLLM's default is 20): it bounds the size
    # of a worker's reply, and so the reply socket's message size limit.
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        if self.fused_kernels not in ("auto", "torch", "triton"):
            raise ConfigError(f"fused_kernels must be auto|torch|triton, got {self.fused_kernels!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend must be {'|'.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        kernels = {"attention_backend": self.attention_backend, "fused_kernels": self.fused_kernels}
        uses_triton = [name for name, value in kernels.items() if value.startswith("triton")]
        if self.parallel.all_reduce == "symm_mem" and self.device != "cuda":
            raise ConfigError(
                f"all_reduce='symm_mem' needs device='cuda' (device is {self.device!r}); use 'auto' or 'nccl'"
            )
        if uses_triton and self.device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(
                f"{uses_triton[0]}={kernels[uses_triton[0]]!r} needs a CUDA device (device is "
                f"{self.device!r}); use 'auto' or 'torch' on the CPU (or Triton's interpreter, "
                "TRITON_INTERPRET=1)"
            )
        if (
            isinstance(self.max_logprobs, bool)
            or not isinstance(self.max_logprobs, int)
            or self.max_logprobs < 0
        ):
            raise ConfigError(f"max_logprobs must be an int >= 0, got {self.max_logprobs!r}")
        if self.cuda_graphs not in ("auto", "off", "padded"):
            raise ConfigError(f"cuda_graphs must be auto|off|padded, got {self.cuda_graphs!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ConfigError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        validate_tensor_parallel(self.model, self.parallel.tensor_parallel_size)
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ConfigError(f"tokenizer must be a folder or a Hugging Face Hub id, got {self.tokenizer!r}")

    @property
    def tokenizer_source(self) -> str:
        """Where the tokenizer loads from: `tokenizer`, else the model's folder."""
        return self.tokenizer if self.tokenizer is not None else self.model.path


def load_tokenizer(source: str | os.PathLike[str], trust_remote_code: bool = False) -> Any:
    """The Hugging Face tokenizer of a folder or Hub id; a ConfigError that names it when none loads.
    `trust_remote_code`: transformers may run a tokenizer class the folder ships."""
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(
            os.fspath(source), trust_remote_code=trust_remote_code
        )
    except Exception as exc:
        hint = _remote_code_hint(exc, trust_remote_code)
        raise ConfigError(f"could not load a tokenizer from {os.fspath(source)}: {exc}{hint}") from exc


def _remote_code_hint(exc: BaseException, trust_remote_code: bool) -> str:
    """What to change when transformers refused to run a folder's own code."""
    if trust_remote_code or "trust_remote_code" not in str(exc):
        return ""
    return (
        "; the folder ships its own code for this: pass trust_remote_code=True (--trust-remote-code) if "
        "you trust it"
    )


@dataclass(frozen=True)
class TPShape:
    """The sizes that decide which tensor-parallel sizes a model runs at: attention heads split evenly,
    KV heads split or replicated evenly, and the MLP widths (dense and per expert) split evenly."""

    num_heads: int
    num_kv_heads: int
    dense_intermediate_size: int | None  # None: every layer's feed-forward is sparse MoE
    moe_intermediate_size: int | None  # None: no MoE layers
    shared_expert_intermediate_size: int | None = None  # None: no shared expert (Qwen2-MoE's)

    @classmethod
    def of_model(cls, model: ModelConfig) -> TPShape:
        return cls(
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            dense_intermediate_size=(
                model.intermediate_size if len(model.moe_layers) < model.num_layers else None
            ),
            moe_intermediate_size=model.moe_intermediate_size if model.moe_layers else None,
            shared_expert_intermediate_size=(
                model.shared_expert_intermediate_size
                if model.moe_layers and model.shared_expert_intermediate_size
                else None
            ),
        )

    @classmethod
    def of_config_json(cls, config: Mapping[str, Any]) -> TPShape:
        """From config.json's fields as read, without transformers (so before torch is imported); the
        MoE rules are the model adapters' (a test checks that the two agree for every family). A multimodal
        checkpoint's language model is its text_config."""
        text_config = config.get("text_config")
        if isinstance(text_config, Mapping):
            config = text_config
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        layers = int(config.get("num_hidden_layers", 1))
        width = int(config.get("intermediate_size", 0))
        # transformers writes Qwen3-MoE's expert count as num_experts or as num_local_experts (its alias).
        experts = config.get("num_experts") or config.get("num_local_experts")
        if experts and config.get("moe_intermediate_size"):  # Qwen2/3-MoE: some layers may stay dense
            only_dense = set(config.get("mlp_only_layers") or [])
            step = int(config.get("decoder_sparse_step", 1) or 1)
            dense = [i in only_dense or bool((i + 1) % step) for i in range(layers)]
            if all(dense):
                return cls(heads, kv_heads, width, None)
            shared = int(config.get("shared_expert_intermediate_size") or 0) or None
            moe = int(config["moe_intermediate_size"])
            return cls(heads, kv_heads, width if any(dense) else None, moe, shared)
        if experts:  # Mixtral: every layer sparse, each expert intermediate_size wide
            return cls(heads, kv_heads, None, width)
        return cls(heads, kv_heads, width, None)

    def problem(self, tp: int) -> str | None:
        """Why the model cannot run at `tp`, or None."""
        if self.num_heads % tp:
            return f"does not divide the model's {self.num_heads} attention heads"
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            return f"and the model's {self.num_kv_heads} KV heads do not divide one another"
        if self.dense_intermediate_size is not None and self.dense_intermediate_size % tp:
            return f"does not divide the model's MLP width intermediate_size={self.dense_intermediate_size}"
        if self.moe_intermediate_size is not None and self.moe_intermediate_size % tp:
            return f"does not divide the experts' intermediate size {self.moe_intermediate_size}"
        shared = self.shared_expert_intermediate_size
        if shared is not None and shared % tp:
            return f"does not divide the shared expert's shared_expert_intermediate_size={shared}"
        return None

    def sizes(self) -> list[int]:
        """Every TP size the model runs at (none is larger than its head count)."""
        return [tp for tp in range(1, self.num_heads + 1) if self.problem(tp) is None]

    def check(self, tp: int) -> None:
        problem = self.problem(tp)
        if problem is not None:
            sizes = ", ".join(str(n) for n in self.sizes())
            raise ConfigError(
                f"tensor_parallel_size={tp} {problem}; this model runs at tensor_parallel_size {sizes}"
            )


def validate_tensor_parallel(model: ModelConfig, tp: int) -> None:
    TPShape.of_model(model).check(tp)
    problem = _fp8_block_problem(model, tp)
    if problem is not None:
        raise ConfigError(problem)


def _fp8_block_problem(model: ModelConfig, tp: int) -> str | None:
    """Why each rank's part of a block-scaled FP8 weight would not be whole scale blocks, or None. Layers the
    checkpoint's ignore list keeps unquantized have no blocks, nor do dummy weights (quantized at load);
    the loader checks each layer again as it reads it."""
    quant = model.quantization
    if quant is None or quant.block_size is None or tp == 1 or model.load_format == "dummy":
        return None
    moe = set(model.moe_layers)

    def quantized(*modules: str, layers: Iterable[int] = range(model.num_layers)) -> bool:
        return any(not quant.is_ignored(f"model.layers.{i}.{m}") for i in layers for m in modules)

    block_n, block_k = quant.block_size
    if model.num_kv_heads >= tp:
        kv_local = model.num_kv_heads // tp * model.head_dim
    else:  # each rank holds one head, whole (no cut at all) where there is only one
        kv_local = model.head_dim if model.num_kv_heads > 1 else 0
    attention = model.num_heads * model.head_dim // tp
    dense = [i for i in range(model.num_layers) if i not in moe]
    mlp = model.intermediate_size // tp
    shared = (model.shared_expert_intermediate_size or 0) // tp
    cuts = [  # what, its width on a rank, the block it must be whole blocks of, whether any is FP8
        ("q_proj rows", attention, block_n, quantized("self_attn.q_proj")),
        ("k_proj/v_proj rows", kv_local, block_n, quantized("self_attn.k_proj", "self_attn.v_proj")),
        ("o_proj columns", attention, block_k, quantized("self_attn.o_proj")),
        ("gate_proj/up_proj rows", mlp, block_n, quantized("mlp.gate_proj", "mlp.up_proj", layers=dense)),
        ("down_proj columns", mlp, block_k, quantized("mlp.down_proj", layers=dense)),
        ("shared_expert gate_proj/up_proj rows", shared, block_n,
         quantized("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", layers=sorted(moe))),
        ("shared_expert down_proj columns", shared, block_k,
         quantized("mlp.shared_expert.down_proj", layers=sorted(moe))),
    ]  # fmt: skip
    for what, size, block, fp8 in cuts:
        if fp8 and size % block:
            return (
                f"tensor_parallel_size={tp} cuts the FP8 checkpoint's {block_n}x{block_k} weight-scale "
                f"blocks: each rank's {what} ({size}) are not whole blocks of {block}; use a "
                "tensor_parallel_size that divides them into whole blocks"
            )
    return None


def read_config_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint folder's config.json as a dict (no transformers, no torch); ConfigError if it is not
    one."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ConfigError(
            f"model path {str(path)!r} has no config.json; it is not a Hugging Face checkpoint folder"
        )
    return _json_object(file, "check the file")


def _json_object(file: Path, remedy: str) -> dict[str, Any]:
    """`file` read as a JSON object; ConfigError naming it (and `remedy`) if it is not one."""
    try:
        value = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"could not read {file} as JSON ({exc}); {remedy}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{file} is not a JSON object; {remedy}")
    return value


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device='cuda' was requested but no CUDA GPU is visible; use device='cpu'")
        return "cuda"
    raise ConfigError(f"device must be auto|cpu|cuda, got {device!r}")


def resolve_dtype(dtype: str, config_dtype: str | None, device: str) -> str:
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if dtype != "auto":
        return DTYPE_ALIASES.get(dtype, dtype)
    if device == "cpu":
        # Half-precision matmuls on CPU are slow and less exact; float32 is the safe CPU default.
        return "float32"
    if config_dtype in ("bfloat16", "float16"):
        return config_dtype
    return "bfloat16"


def _language_model_config(hf: Any) -> Any:
    """The config of the language model a checkpoint's config describes: a multimodal checkpoint's nested
    text_config (Gemma3ForConditionalGeneration's), found as transformers finds it (get_text_config); the
    config itself for a text-only model."""
    import transformers

    get_text_config = getattr(hf, "get_text_config", None)
    if get_text_config is None:
        return hf
    try:
        text = get_text_config(decoder=True)
    except ValueError as exc:  # several nested configs that could be the language model's
        raise ConfigError(f"config.json: {' '.join(str(exc).split())[:300]}") from None
    # A text-only config may carry a stray dict under such a key: the config itself is the model's.
    return text if isinstance(text, transformers.PretrainedConfig) else hf


def _outer_first(outer: Any, text: Any, name: str) -> Any:
    """Setting `name` of a checkpoint's config, else of its language model's (the same config for a text-only
    model): transformers' generate takes a multimodal config's token ids so (GenerationConfig.
    from_model_config)."""
    value = getattr(outer, name, None)
    return value if value is not None else getattr(text, name, None)


def _load_hf_config(path: str, trust_remote_code: bool = False) -> Any:
    import transformers

    # transformers 5's configs validate their fields' types (huggingface_hub's strict dataclasses).
    # Its validators and dtype reading fail on some values with ArithmeticError (zero heads),
    # AttributeError (an unknown dtype name) or IndexError as well; a config class the folder ships
    # (trust_remote_code) with ImportError where it needs a package this environment lacks.
    invalid: tuple[type[Exception], ...] = (
        OSError, ValueError, KeyError, TypeError, ArithmeticError, AttributeError, IndexError, ImportError,
    )  # fmt: skip
    try:
        from huggingface_hub.errors import StrictDataclassError

        invalid += (StrictDataclassError,)
    except ImportError:  # an older huggingface_hub: no such validation
        pass
    try:
        return transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except invalid as exc:
        detail = " ".join(str(exc).split())[:300] or repr(exc)
        raise ConfigError(
            f"could not read {path}/config.json as a Hugging Face config ({type(exc).__name__}: {detail}); "
            "check that the file is a valid config of a supported architecture"
            + _remote_code_hint(exc, trust_remote_code)
        ) from None


def _per_layer_type_rope(hf_config: Any) -> bool:
    """Whether rope_parameters holds one set per layer type (transformers 5's Gemma 3: "full_attention"
    and "sliding_attention")."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return isinstance(params, Mapping) and any(
        isinstance(params.get(kind), Mapping) for kind in ("full_attention", "sliding_attention")
    )


def _local_rope_theta(hf_config: Any) -> float | None:
    """transformers 4.x's Gemma 3 names its windowed layers' rope base apart (rope_local_base_freq; 5.x
    folds it into rope_parameters["sliding_attention"])."""
    theta = getattr(hf_config, "rope_local_base_freq", None)
    return float(theta) if isinstance(theta, (int, float)) and not _per_layer_type_rope(hf_config) else None


def _rope_parameters(hf_config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """transformers >= 5 keeps rope settings in `rope_parameters` (per layer type for some families: the
    global layers' by default); 4.x in rope_theta + rope_scaling (Gemma 3's windowed layers: an unscaled
    rope of base rope_local_base_freq)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if _per_layer_type_rope(hf_config):
        params = dict(params.get(layer_type) or {})
    elif layer_type == "sliding_attention" and _local_rope_theta(hf_config) is not None:
        return {"rope_type": "default", "rope_theta": _local_rope_theta(hf_config)}
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def _max_positions(hf_config: Any) -> int:
    """The longest context the model's rope serves, as vLLM derives it: max_position_embeddings, times the
    factor of a linear or YaRN rope (YaRN's from its original_max_position_embeddings), whose frequencies
    are fixed (transformers computes any position the same way). A dynamic rope's frequencies change past
    max_position_embeddings in transformers, which this rope table does not do: it keeps that limit."""
    max_positions = int(hf_config.max_position_embeddings)
    if "gemma3" in str(getattr(hf_config, "model_type", "")):
        return max_positions  # Gemma 3's (128K) is already the scaled one, as vLLM reads it
    params = _rope_parameters(hf_config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    factor = params.get("factor")
    if isinstance(factor, (int, float)) and not math.isfinite(factor):
        raise ConfigError(f"the rope factor must be a finite number, got {factor}; check config.json")
    if rope_type not in ("linear", "yarn") or not isinstance(factor, (int, float)) or factor <= 1:
        return max_positions
    if rope_type == "yarn":
        original = params.get("original_max_position_embeddings")
        if isinstance(original, (int, float)) and original > 0:
            max_positions = int(original)
    return int(max_positions * factor)


def _warn_long_factors(params: dict[str, Any], hf_config: Any, max_model_len: int | None) -> None:
    """A warning (once per process, as vLLM logs one) where LongRoPE takes its long factors."""
    original = params.get("original_max_position_embeddings")
    original = original or getattr(hf_config, "original_max_position_embeddings", None)
    if max_model_len is None or not isinstance(original, int) or max_model_len <= original:
        return
    import warnings

    warnings.warn(
        f"LongRoPE: max_model_len {max_model_len} is past the model's original context of {original} "
        "tokens, so every sequence takes the long rope factors (as in vLLM); transformers takes the short "
        f"ones for a sequence within {original} tokens, so such outputs differ from its. Set max_model_len "
        f"<= {original} to compute them as transformers does.",
        stacklevel=2,
    )


def _rope_config(
    hf_config: Any, head_dim: int, layer_type: str | None = None, max_model_len: int | None = None,
    partial: bool = False,
) -> RopeConfig:
    """The rope of the model, or with `layer_type` of that type of layer (rope_parameters per type).

    LongRoPE (Phi-3's 128k releases) has two sets of frequencies. transformers takes the long set for a
    forward whose positions go past original_max_position_embeddings; the runtime chooses once, as vLLM
    does: the long set where max_model_len goes past that length, else (or without a max_model_len) the
    short one. So with a max_model_len within it every sequence is computed as transformers computes it,
    and beyond it every sequence whose prompt is already longer.

    `partial`: the family rotates only the first partial_rotary_factor of each head where its config says
    so (Phi-3's class: Phi-4-mini); elsewhere such a config is refused."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = _rope_parameters(hf_config, layer_type or "full_attention")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        # The other families' own default rope (transformers' compute_default_rope_parameters) rotates
        # the whole head, whatever partial_rotary_factor the config carries; Phi-3's reads it.
        dim = head_dim
        if partial:
            factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
            dim = int(head_dim * (1.0 if factor is None else float(factor)))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
        inv_freq = 1.0 / (theta**exponents)
        scaling = 1.0
    else:
        try:
            # transformers 5's rope functions read a layer type's own parameters (4.x's take no such name).
            kwargs: dict[str, Any] = {"layer_type": layer_type} if _per_layer_type_rope(hf_config) else {}
            if rope_type == "longrope":
                kwargs["seq_len"] = max_model_len  # the long set where it exceeds the original length
                _warn_long_factors(params, hf_config, max_model_len)
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kwargs)
        except (TypeError, ValueError, KeyError, ZeroDivisionError) as exc:
            # A parameter of the wrong type (a "2.0" string factor) failed here as a bare TypeError.
            raise ConfigError(
                f"rope parameters {params!r} of config.json are not valid for rope type {rope_type!r} "
                f"({type(exc).__name__}: {exc}); fix them"
            ) from None
    rotated = 2 * inv_freq.numel()
    if rotated != head_dim and not (partial and 0 < rotated < head_dim):
        # transformers >= 5 keeps partial_rotary_factor in rope_parameters (4.x: an attribute); the scaled
        # rope functions then rotate only part of each head, which these families' attention cannot apply
        # (transformers' own forward fails on such a config).
        given = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
        raise ConfigError(
            f"rope type {rope_type!r} with partial_rotary_factor={given} rotates {2 * inv_freq.numel()} of "
            f"the {head_dim} head dimensions; partial rotary embeddings are not supported (remove "
            "partial_rotary_factor or set it to 1.0)"
        )
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        inv_freq=tuple(float(x) for x in inv_freq.float().tolist()),
        attention_scaling=float(scaling),
        pass_pairs=(head_dim - rotated) // 2,
    )


def _eos_token_ids(generation: Mapping[str, Any], config_eos: Any) -> tuple[tuple[int, ...], bool]:
    """The EOS ids, and whether the generation config (`generation`, generation_config.json as read; empty
    where there is none) names none explicitly (an empty list). `config_eos`: config.json's eos_token_id."""
    ids: list[int] = []

    def add(value: Any) -> bool:
        """Take `value`'s ids; True where it is an explicit empty list: transformers' generate then stops
        at no EOS (an empty tensor of them), where the runtime stopped at config.json's or the
        tokenizer's."""
        if isinstance(value, (list, tuple)) and not value:
            return True
        if isinstance(value, int):
            value = [value]
        for v in value or []:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
        return False

    # generation_config.json's eos ids replace config.json's, as in transformers' generate. Where it has no
    # eos_token_id config.json's stand, which transformers' generate would not use (it does where there is
    # no such file). An explicit [] in the one read is no EOS, as in transformers' generate.
    if add(generation.get("eos_token_id")):
        return (), True
    if not ids and add(config_eos):
        return (), True
    return tuple(ids), False


def generation_config_problem(value: str | os.PathLike[str]) -> str | None:
    """Why `value` cannot be LLM(generation_config=...), or None: it takes "auto", "vllm" or a folder
    holding a generation_config.json (GENERATION_CONFIG_SOURCES)."""
    if isinstance(value, str) and value in GENERATION_CONFIG_SOURCES:
        return None
    takes = (
        "must be auto (the checkpoint's generation_config.json), vllm (no defaults from it: SamplingParams' "
        "own) or a folder holding a generation_config.json"
    )
    folder = Path(value)
    if folder.is_file():
        return f"{takes}; {str(value)!r} is a file: give the folder that holds it"
    if not folder.is_dir():
        return f"{takes}; {str(value)!r} is not a folder"
    if not (folder / "generation_config.json").is_file():
        return f"{takes}; folder {str(value)!r} has no generation_config.json"
    return None


def _generation_defaults(generation: Mapping[str, Any], file: Path) -> GenerationDefaults:
    """The default sampling parameters generation_config.json `file` (read as `generation`) gives: its
    GENERATION_DEFAULT_KEYS that are set (not null), as vLLM takes them; `do_sample` is not read (vLLM
    ignores it: `do_sample: false` with a temperature still samples at that temperature). A value that
    SamplingParams refuses is a ConfigError naming the file and the key: the model's recommended settings
    are not dropped silently."""
    from tp_runtime.sampling_params import SamplingParams

    values: dict[str, Any] = {}
    for key, option in GENERATION_DEFAULT_KEYS.items():
        value: Any = generation.get(key)
        if value is None:
            continue
        if option in ("top_k", "max_tokens") and isinstance(value, float) and value.is_integer():
            value = int(value)  # 50.0: a whole number written as a float
        try:
            SamplingParams(**{option: value})
        except InvalidRequestError as exc:
            reason = str(exc).removeprefix("invalid SamplingParams: ")
            raise ConfigError(
                f"{file}: {key}={value!r} cannot be a default sampling parameter ({reason}); fix the file, "
                "or leave the file's sampling parameters out with generation_config='vllm' "
                "(--generation-config vllm)"
            ) from None
        values[option] = value
    return GenerationDefaults(**values, source=str(file))


def build_model_config(
    path: str | os.PathLike[str],
    *,
    dtype: str = "auto",
    device: str = "cpu",
    max_model_len: int | None = None,
    load_format: str = "auto",
    quantization: str | None = None,
    generation_config: str | os.PathLike[str] = "auto",
    trust_remote_code: bool = False,
) -> ModelConfig:
    """Read and check a Hugging Face checkpoint folder's config. `quantization`: LLM(quantization=...)
    (see quant_config). `generation_config`: LLM(generation_config=...), where the generation config (its
    EOS ids and its default sampling parameters) comes from: "auto", the checkpoint's
    generation_config.json; "vllm", the checkpoint's for its EOS ids but no default sampling parameters;
    a folder, its generation_config.json for both (as vLLM reads them). `trust_remote_code`: transformers may
    run a config class the folder ships."""
    path = str(path)
    if not os.path.isdir(path):
        raise ConfigError(
            f"model path {path!r} is not a directory; pass a local Hugging Face checkpoint folder"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"model path {path!r} has no config.json; it is not a Hugging Face checkpoint folder"
        )
    if load_format not in ("auto", "dummy"):
        raise ConfigError(f"load_format must be auto|dummy, got {load_format!r}")
    problem = generation_config_problem(generation_config)
    if problem is not None:
        raise ConfigError(f"generation_config {problem}")
    checkpoint_hf = _load_hf_config(path, trust_remote_code)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from tp_runtime.models.registry import ARCHITECTURES  # imports torch and the models: only when needed

    archs = list(getattr(checkpoint_hf, "architectures", None) or [])
    # No architectures listed: transformers' AutoModelForCausalLM goes by model_type.
    model_type = getattr(checkpoint_hf, "model_type", "")
    arch = archs[0] if archs else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "")
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"architecture {arch or '(none)'!r} in {path}/config.json is not supported; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    # The language model's config: the model's sizes, rope, layer types and the adapters' fields come from
    # it. Where the checkpoint's config nests it (a multimodal checkpoint run on text, see
    # _language_model_config) the outer one keeps what concerns the whole checkpoint: the dtype, the
    # quantization, whether the LM head is tied, and the token ids it sets.
    hf = _language_model_config(checkpoint_hf)
    num_heads = int(hf.num_attention_heads)
    kv_heads = getattr(hf, "num_key_value_heads", None)
    num_kv_heads = num_heads if kv_heads is None else int(kv_heads)
    # Else attention failed in torch (SDPA's "Number of heads in key and value must divide ...") and a
    # model without layers with an IndexError, both in the first forward or while building the model.
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ConfigError(
            f"num_key_value_heads={num_kv_heads} must divide num_attention_heads={num_heads} (each KV head "
            "serves a group of query heads); check config.json"
        )
    if int(hf.num_hidden_layers) < 1:
        raise ConfigError(f"num_hidden_layers must be >= 1, got {hf.num_hidden_layers}; check config.json")
    head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // num_heads)
    # Else a negative one failed deep in torch while the model was built (or its rope table computed).
    for name, size in (
        ("hidden_size", hf.hidden_size), ("intermediate_size", hf.intermediate_size),
        ("vocab_size", hf.vocab_size), ("head_dim", head_dim),
    ):  # fmt: skip
        if int(size) < 1:
            raise ConfigError(f"{name} must be >= 1, got {size}; check config.json")
    # What the architecture decides (biases, sliding window, experts, activation, soft-capping), over
    # these defaults.
    adapted = ARCHITECTURES[arch].config(hf)
    partial_rotary = ARCHITECTURES[arch].partial_rotary
    if "hidden_act" not in adapted and getattr(hf, "hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"hidden_act {hf.hidden_act!r} is not supported (only silu, alias swish)")
    specific: dict[str, Any] = {
        "qkv_bias": False,
        "o_proj_bias": False,
        "mlp_bias": False,  # Llama's adapter reads mlp_bias: the other families' HF classes ignore it
        "sliding_window": None,
        **adapted,
    }
    sliding = specific.pop("sliding_window")
    experts, top_k = specific.get("num_experts", 0), specific.get("num_experts_per_tok", 0)
    if specific.get("moe_layers") and not 1 <= top_k <= experts:
        # Else the first forward failed deep in torch.topk ("selected index k out of range").
        raise ConfigError(
            f"num_experts_per_tok={top_k} must be between 1 and the model's {experts} experts; check "
            "config.json"
        )
    derived_max = _max_positions(hf)
    if max_model_len is None:
        max_model_len = derived_max
    elif max_model_len < 2:
        raise ConfigError(f"max_model_len must be >= 2, got {max_model_len}")
    elif max_model_len > derived_max:
        scaled = "" if derived_max == int(hf.max_position_embeddings) else " (with its rope scaling)"
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds the model's context of {derived_max} positions{scaled} "
            f"(max_position_embeddings={hf.max_position_embeddings}); lower max_model_len"
        )
    config_dtype = _outer_first(checkpoint_hf, hf, "dtype") or _outer_first(checkpoint_hf, hf, "torch_dtype")
    config_dtype = str(config_dtype).replace("torch.", "") if config_dtype is not None else None
    per_type_rope = _per_layer_type_rope(hf) or _local_rope_theta(hf) is not None
    # The generation config: the checkpoint's generation_config.json (if any), or the one in the folder
    # generation_config names.
    own = isinstance(generation_config, str) and generation_config in GENERATION_CONFIG_SOURCES
    gen_file = Path(path if own else generation_config) / "generation_config.json"
    generation: dict[str, Any] = {}
    if gen_file.is_file():
        generation = _json_object(gen_file, "fix or remove the file" if own else "fix the file")
    eos_token_ids, no_eos = _eos_token_ids(generation, _outer_first(checkpoint_hf, hf, "eos_token_id"))
    defaults = GenerationDefaults()
    if generation_config != "vllm" and gen_file.is_file():
        defaults = _generation_defaults(generation, gen_file)
    return ModelConfig(
        path=path,
        architecture=arch,
        hidden_size=int(hf.hidden_size),
        num_layers=int(hf.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=int(hf.intermediate_size),
        vocab_size=int(hf.vocab_size),
        rms_norm_eps=float(hf.rms_norm_eps),
        # transformers 5 ties the LM head as the outer model's config says (a multimodal model's, not its
        # text_config's).
        tie_word_embeddings=bool(getattr(checkpoint_hf, "tie_word_embeddings", False)),
        sliding_window=int(sliding) if sliding else None,
        max_model_len=int(max_model_len),
        dtype=resolve_dtype(dtype, config_dtype, device),
        rope=_rope_config(
            hf, head_dim, "full_attention" if per_type_rope else None, int(max_model_len), partial_rotary
        ),
        local_rope=(
            _rope_config(hf, head_dim, "sliding_attention", int(max_model_len), partial_rotary)
            if per_type_rope else None
        ),
        load_format=load_format,
        eos_token_ids=eos_token_ids,
        no_eos=no_eos,
        bos_token_id=_outer_first(checkpoint_hf, hf, "bos_token_id"),
        quantization=quant_config(
            hf_quantization_config(checkpoint_hf) or hf_quantization_config(hf), quantization
        ),
        generation_defaults=defaults,
        **specific,
    )


def torchrun_rank() -> int | None:
    """This process's rank when torchrun started it (any job size), else None."""
    if os.environ.get("TORCHELASTIC_RUN_ID") and "RANK" in os.environ:
        return int(os.environ["RANK"])
    return None
