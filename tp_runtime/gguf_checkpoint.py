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
import os
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
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
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
    # A model read from GGUF refuses save_pretrained, so the pieces are written by hand. The config
    # loses its GGUF quantization_config: the tensors written are plain float32.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [architecture]  # GGUF metadata does not carry it
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
    key = hashlib.sha1(f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cached_dir(f"gguf-{gguf.stem[:64]}-{key}", lambda out: convert_gguf(gguf, out))
