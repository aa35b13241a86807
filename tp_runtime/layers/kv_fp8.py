"""An FP8 KV cache: keys and values stored as e4m3 with one scale per layer for each, as vLLM's
`kv_cache_dtype="fp8"` stores them (x ~ stored * scale, stored = x / scale saturated to +-448).

Chosen once at start-up (`cache_dtype`): the cache tensors' dtype then says how every path stores and reads
them. Writes (`write_kv` here, the fused rotary kernel on CUDA) quantize; reads dequantize (the PyTorch
backend) or fold the scales into the softmax scale and the output (the Triton kernels). Attention reads
every key and value as the cache holds them, a fresh prompt's own keys included (`round_trip`), so a
prompt whose prefix came from the prefix cache sees the same keys as one computed whole.

The scales come from the checkpoint where it has them (llm-compressor's `kv_cache_scheme`:
`self_attn.k_scale`/`v_scale`, or the older `k_proj.output_scale`/`v_proj.output_scale`, or one
`self_attn.kv_scale` for both), else they are 1.0, as in vLLM.
"""

from __future__ import annotations

import struct

import torch

from tp_runtime.config import FP8_E4M3_MAX as FP8_KV_MAX  # stores saturate there
from tp_runtime.errors import ConfigError

FP8_KV_DTYPE = torch.float8_e4m3fn

# Checkpoint tensor suffixes of a layer's KV scales (after "<layer>.self_attn."): which scale each sets.
# Attention-quantized checkpoints also carry query and softmax-probability scales, for attention that
# multiplies in FP8; here attention runs in the model dtype, so they set nothing.
_SCALE_SUFFIXES: dict[str, tuple[str, ...]] = {
    "k_scale": ("k",),
    "v_scale": ("v",),
    "k_proj.output_scale": ("k",),
    "v_proj.output_scale": ("v",),
    "kv_scale": ("k", "v"),
    "q_scale": (),
    "q_proj.output_scale": (),
    "prob_scale": (),
}


def cache_dtype(choice: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype for a validated kv_cache_dtype choice."""
    return model_dtype if choice == "auto" else FP8_KV_DTYPE


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def f32_reciprocal(scale: float) -> float:
    """1 / scale rounded to float32: what both writers multiply by, so they store the same bytes."""
    return float(struct.unpack("f", struct.pack("f", 1.0 / scale))[0])


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in e4m3 (x times `f32_reciprocal(scale)`, as the fused kernel computes it), saturated: a
    plain cast would turn values past 448 into NaN."""
    return (x.float() * f32_reciprocal(scale)).clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """stored * scale in `dtype`, rounded once: e4m3 converts to any wider float exactly, and the product
    is taken in float32 (PyTorch's math type for 16-bit floats) without a float32 copy of the tensor."""
    return stored.to(dtype).mul_(scale)


def round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What attention reads back for x from an FP8 cache."""
    return dequantize(quantize(x, scale), scale, x.dtype)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache as uint8 (same shape): index_copy_/index_select have no CPU kernels for FP8."""
    return cache.view(torch.uint8) if is_fp8(cache) else cache


def kv_scale_name(name: str) -> tuple[str, tuple[str, ...]] | None:
    """("model.layers.3.self_attn", which scales) for a checkpoint KV-scale tensor name; None otherwise."""
    head, sep, suffix = name.partition(".self_attn.")
    if not sep or suffix not in _SCALE_SUFFIXES:
        return None
    return f"{head}.self_attn", _SCALE_SUFFIXES[suffix]


def scale_value(tensor: torch.Tensor, name: str) -> float:
    """A checkpoint KV scale as a positive float (one per tensor: per-head scales are not supported)."""
    if tensor.numel() != 1:
        raise ConfigError(
            f"KV-cache scale {name!r} has shape {list(tensor.shape)}; only one scale per layer (per-tensor) "
            "is supported"
        )
    value = float(tensor.float().item())
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"KV-cache scale {name!r} is {value}; it must be a positive finite number")
    return value
