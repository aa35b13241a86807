"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from tp_runtime.config import SUPPORTED_ARCHITECTURES
from tp_runtime.errors import ConfigError
from tp_runtime.models.llama import LlamaForCausalLM

# Mistral and Qwen2 differ from Llama only in config (sliding window, q/k/v bias), which ModelConfig holds.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ConfigError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(MODEL_CLASSES)}"
        ) from None
