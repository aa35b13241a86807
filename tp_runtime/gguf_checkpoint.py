"""A GGUF file (llama.cpp's format) as a checkpoint folder: transformers reads it, dequantized to float32,
and the model, config, generation config and tokenizer are written once into the cache as safetensors.

`LLM(model="x.gguf")` and `--model x.gguf` go through here, as does the built-in SmolLM2 (smollm2.py).
transformers' GGUF reader is the one HF itself runs on the same file, so the tests' reference and the
engine see the same float32 weights; the architectures it reads that tp_runtime runs (Llama, Mistral,
Qwen2, Qwen3, Qwen3-MoE, Gemma 2, ...) load like any checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tp_runtime.errors import ConfigError

INSTALL_HINT = "pip install gguf accelerate"


def _check_readers() -> None:
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"reading a GGUF file needs the {module!r} package; run: {INSTALL_HINT}")


def convert_gguf(gguf: Path, out: Path, edit_config: Callable[[Any], None] | None = None) -> Path:
    """Write GGUF file `gguf` into the empty folder `out` as an HF checkpoint (float32 safetensors, config,
    generation config, tokenizer). `edit_config(config)` may correct the config before it is written."""
    _check_readers()
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from tp_runtime.models.registry import ARCHITECTURES

    folder, name = gguf.parent, gguf.name
    file_elements = _check_whole_file(gguf)
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, output_loading_info=True
        )
        model, loading = loaded
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:
        # Whatever fails here is the file's: transformers' reader raises struct.error on a file cut short,
        # OverflowError on a length past any file, the tokenizer a bare Exception on a broken vocabulary.
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ConfigError(f"{gguf} could not be read as a GGUF model by transformers: {reason}") from None
    architecture = type(model).__name__
    if architecture not in ARCHITECTURES:
        raise ConfigError(
            f"{gguf} holds a {architecture} model, which tp_runtime does not run; supported: "
            f"{', '.join(ARCHITECTURES)}"
        )
    # transformers only warns of tensors the file lacks (a split file's first part, a cut export) and
    # leaves them at their random initial values.
    absent = sorted(
        set(loading.get("missing_keys", ())) | {k for k, *_ in loading.get("mismatched_keys", ())}
    )
    if absent:
        raise ConfigError(
            f"{gguf} lacks {len(absent)} of the model's tensors or holds them in another shape "
            f"({', '.join(absent[:4])}{', ...' if len(absent) > 4 else ''}); a split GGUF must be merged "
            "first (llama.cpp's llama-gguf-split --merge)"
        )
    # ... and skips the file's tensors its name map lacks (a llama file's attention biases): the model
    # would run without them. Counted in elements, which stacking experts or fusing projections keeps.
    read = sum(t.numel() for t in model.state_dict().values())
    if file_elements > read:
        raise ConfigError(
            f"{gguf} holds {file_elements - read} weights more than transformers reads into its "
            f"{architecture} ({_unread_names(gguf, model)}); tp_runtime would run the model without "
            "them: use the model's HF checkpoint folder instead"
        )
    # A model read from GGUF refuses save_pretrained, so the pieces are written by hand. The config
    # loses its GGUF quantization_config: the tensors written are plain float32.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [architecture]  # GGUF metadata does not carry it
    _carry_rope_scaling(gguf, config)
    config.dtype = torch.float32
    if edit_config is not None:
        edit_config(config)
    # A tied lm_head shares storage with embed_tokens, which safetensors refuses; loaders re-tie it.
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    generation = GenerationConfig.from_model_config(config)
    if generation.pad_token_id is None and tokenizer.pad_token_id is not None:
        generation.pad_token_id = tokenizer.pad_token_id
    generation.save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings  # GGUF leaves it unset (1e30)
    tokenizer.save_pretrained(out)
    (out / "model.safetensors").chmod(0o644)  # save_file creates it 0600, unlike the other files
    return out


# Raised whenever a conversion would come out otherwise, so that files converted before are converted again.
_CONVERSION = 3
# llama.cpp's default original context for Llama 3's rope; any value fits the same factors (see below).
_LLAMA3_ORIGINAL_CONTEXT = 8192


def _check_whole_file(gguf: Path) -> int:
    """The elements of the file's weight tensors (llama.cpp's rope_freqs.weight aside: a rope setting,
    not a weight); ConfigError for one part of a split GGUF (its first part may hold every tensor but
    the LM head, which transformers then takes as tied to the embeddings)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf))
    except Exception as exc:  # the header or tensor table cut short, a wrong magic, ...
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ConfigError(f"{gguf} could not be read as a GGUF model: {reason}") from None
    parts = _field(reader, "split.count")
    if isinstance(parts, int) and parts > 1:
        number = _field(reader, "split.no")
        raise ConfigError(
            f"{gguf} is {'one' if not isinstance(number, int) else f'part {number + 1}'} of a GGUF split "
            f"into {parts} files; merge them first (llama.cpp's llama-gguf-split --merge)"
        )
    return sum(int(t.n_elements) for t in reader.tensors if not t.name.startswith("rope_"))


def _unread_names(gguf: Path, model: Any) -> str:
    """The file's tensor names (blocks as N) that transformers' name map for `model` lacks, or a note
    where that map cannot be had."""
    try:
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

        known = get_gguf_hf_weights_map(model, TensorProcessor())
        names = {t.name for t in GGUFReader(str(gguf)).tensors if not t.name.startswith("rope_")}
    except Exception:  # transformers' internals: a name is only for the message
        return "tensors its name map lacks"
    unread = sorted({re.sub(r"\.\d+\.", ".N.", n) for n in names - set(known)})
    if not unread:
        return "tensors it merged away"
    return ", ".join(unread[:6]) + (", ..." if len(unread) > 6 else "")


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _carry_rope_scaling(gguf: Path, config: Any) -> None:
    """Put the file's rope scaling into `config`, which transformers' GGUF reader leaves at the plain rope
    for these architectures: llama.cpp writes linear scaling as `<arch>.rope.scaling.*` keys, and Llama
    3.1/3.2's rope as a `rope_freqs.weight` tensor of per-frequency divisors. Scalings it cannot carry
    exactly are refused rather than run as another model."""
    from gguf import GGUFReader

    given = dict(getattr(config, "rope_parameters", None) or {})
    # Per layer type (Gemma 3): llama.cpp's scaling is the global layers' (the windowed ones run unscaled).
    per_type = any(isinstance(v, dict) for v in given.values())
    params = dict(given.get("full_attention") or {}) if per_type else given
    layers = [params, *(v for v in given.values() if isinstance(v, dict))]
    if any(layer.get("rope_type", "default") != "default" for layer in layers):
        return  # transformers read it
    reader = GGUFReader(str(gguf))
    prefix = f"{_field(reader, 'general.architecture')}.rope.scaling."
    kind = _field(reader, prefix + "type")
    tensors = {t.name: t for t in reader.tensors if t.name.startswith("rope_")}
    divisors = tensors.pop("rope_freqs.weight", None)
    unsupported = sorted(tensors) + (
        [f"rope scaling {kind!r}"] if kind not in (None, "none", "linear") else []
    )
    if kind == "linear" and divisors is not None:
        unsupported.append("linear scaling with rope_freqs.weight")
    if unsupported:
        raise ConfigError(
            f"{gguf} holds a rope scaling that tp_runtime does not read from GGUF "
            f"({', '.join(unsupported)}); use the model's HF checkpoint folder instead"
        )
    factor = _field(reader, prefix + "factor")
    if kind == "linear" and factor:
        params.update(rope_type="linear", factor=float(factor))
    elif kind == "linear":
        return  # no factor, or 0: llama.cpp runs these unscaled
    elif divisors is not None:
        fitted = _llama3_rope(
            [float(v) for v in divisors.data.reshape(-1)],
            float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            _field(reader, prefix + "original_context_length") or _LLAMA3_ORIGINAL_CONTEXT,
        )
        if fitted is None:
            raise ConfigError(
                f"{gguf}: its rope_freqs.weight is not Llama 3's rope scaling, the only one tp_runtime reads "
                "from that tensor; use the model's HF checkpoint folder instead"
            )
        params.update(fitted)
    else:
        return
    config.rope_parameters = {**given, "full_attention": params} if per_type else params


def _llama3_factors(
    theta: float, count: int, factor: float, low: float, high: float, original: float
) -> list[float]:
    """The divisor of each rotary frequency under Llama 3's rope (transformers' and llama.cpp's rule)."""
    out = []
    for i in range(count):
        wavelength = 2 * math.pi * theta ** (2 * i / (2 * count))
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _llama3_rope(divisors: list[float], theta: float, original: int) -> dict[str, Any] | None:
    """Llama 3 rope parameters giving these per-frequency divisors, or None where none do. The divisors
    fix the factor (the largest) and, through the frequencies between the two bands, the line that
    low_freq_factor and high_freq_factor draw in original / wavelength; scaling all three of the context
    and both factors together gives the same divisors, so the file's context length (or llama.cpp's
    default) is kept."""
    factor = max(divisors)
    if factor <= 1.0:
        return None if min(divisors) < 1.0 else {}  # no scaling at all
    count = len(divisors)
    # (original / wavelength, the smoothing weight) of the frequencies between the bands
    ramp = [
        (original / (2 * math.pi * theta ** (i / count)), (1 / d - 1 / factor) / (1 - 1 / factor))
        for i, d in enumerate(divisors)
        if 1.0 + 1e-5 < d < factor * (1 - 1e-5)
    ]
    low, high = 1.0, 4.0  # Llama 3's, where too few frequencies lie between the bands to fit a line
    if len(ramp) >= 2:
        n = len(ramp)
        mean_u = sum(u for u, _ in ramp) / n
        mean_s = sum(s for _, s in ramp) / n
        spread = sum((u - mean_u) ** 2 for u, _ in ramp)
        slope = sum((u - mean_u) * (s - mean_s) for u, s in ramp) / spread if spread > 0 else 0.0
        if slope <= 0:
            return None
        low = mean_u - mean_s / slope
        high = low + 1 / slope
        if low <= 0:
            return None
    fitted = _llama3_factors(theta, count, factor, low, high, original)
    if any(abs(f - d) > 1e-4 * d for f, d in zip(fitted, divisors, strict=True)):
        return None
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": int(original),
    }


def gguf_checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """The cached checkpoint folder of GGUF file `path`, converted on first use (presets.cached_dir:
    concurrent callers, such as torchrun's ranks, never see a partial folder, and one converts while the
    others wait). The cache entry is keyed by the file's absolute path, size and modification time, so a
    changed file is converted again."""
    from tp_runtime.presets import cached_dir

    gguf = Path(path).expanduser().resolve()
    if not gguf.is_file():
        raise ConfigError(f"GGUF file {path} does not exist")
    stat = gguf.stat()
    key = f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}\0{_CONVERSION}"
    key = hashlib.sha1(key.encode()).hexdigest()[:16]
    return cached_dir(f"gguf-{gguf.stem[:64]}-{key}", lambda out: convert_gguf(gguf, out))
