"""Architecture name (config.json `architectures[0]`) -> model class, config adapter and checkpoint names.

A new decoder family is one model file and one entry here; the loader and the runner see only the
interface in models/interface.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from tp_runtime.errors import ConfigError
from tp_runtime.models.gemma import GemmaForCausalLM, gemma_config
from tp_runtime.models.gemma2 import Gemma2ForCausalLM, gemma2_config
from tp_runtime.models.gemma3 import Gemma3ForCausalLM, gemma3_config, gemma3_multimodal_config
from tp_runtime.models.interface import MODEL_NAMES, CausalLMFactory, CheckpointNames, ConfigAdapter
from tp_runtime.models.llama import (
    LlamaForCausalLM,
    granite_config,
    llama_config,
    mistral_config,
    qwen2_config,
    smollm3_config,
)
from tp_runtime.models.mixtral import MixtralForCausalLM, mixtral_config
from tp_runtime.models.olmo2 import Olmo2ForCausalLM, olmo2_config, olmo3_config
from tp_runtime.models.phi3 import Phi3ForCausalLM, phi3_config
from tp_runtime.models.qwen2_moe import Qwen2MoeForCausalLM, qwen2_moe_config
from tp_runtime.models.qwen3 import Qwen3ForCausalLM, qwen3_config
from tp_runtime.models.qwen3_moe import Qwen3MoeForCausalLM, qwen3_moe_config


@dataclass(frozen=True)
class Architecture:
    model: CausalLMFactory
    config: ConfigAdapter
    # Where the checkpoints name the model's tensors otherwise than the model does (or hold parts it skips).
    checkpoint_names: CheckpointNames = MODEL_NAMES
    # The family's transformers class rotates only partial_rotary_factor of each head (config._rope_config).
    partial_rotary: bool = False


# Gemma 3's multimodal checkpoints (4B, 12B, 27B) run as their language model, on text: Gemma3ForCausalLM
# built from config.json's text_config. The language model's tensors are named as the released checkpoints
# and transformers' save_pretrained name them, or as transformers 5 names its parameters (a state dict saved
# as it is); the vision tower's and the projector's are not read.
GEMMA3_MULTIMODAL_NAMES = CheckpointNames(
    prefixes=(
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
        ("lm_head.", "lm_head."),
        ("vision_tower.", None),
        ("multi_modal_projector.", None),
        ("model.vision_tower.", None),
        ("model.multi_modal_projector.", None),
    )
)


# Mistral, Qwen2, Granite and SmolLM3 differ from Llama only in config (sliding window, q/k/v bias,
# Granite's scalings, SmolLM3's layers without rotary embedding), which ModelConfig holds.
ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM, llama_config),
    "MistralForCausalLM": Architecture(LlamaForCausalLM, mistral_config),
    "Qwen2ForCausalLM": Architecture(LlamaForCausalLM, qwen2_config),
    "GraniteForCausalLM": Architecture(LlamaForCausalLM, granite_config),
    "SmolLM3ForCausalLM": Architecture(LlamaForCausalLM, smollm3_config),
    "Qwen3ForCausalLM": Architecture(Qwen3ForCausalLM, qwen3_config),
    "MixtralForCausalLM": Architecture(MixtralForCausalLM, mixtral_config),
    "Qwen3MoeForCausalLM": Architecture(Qwen3MoeForCausalLM, qwen3_moe_config),
    "Qwen2MoeForCausalLM": Architecture(Qwen2MoeForCausalLM, qwen2_moe_config),
    "GemmaForCausalLM": Architecture(GemmaForCausalLM, gemma_config),
    "Gemma2ForCausalLM": Architecture(Gemma2ForCausalLM, gemma2_config),
    "Gemma3ForCausalLM": Architecture(Gemma3ForCausalLM, gemma3_config),
    "Gemma3ForConditionalGeneration": Architecture(
        Gemma3ForCausalLM, gemma3_multimodal_config, GEMMA3_MULTIMODAL_NAMES
    ),
    "Phi3ForCausalLM": Architecture(Phi3ForCausalLM, phi3_config, partial_rotary=True),
    "Olmo2ForCausalLM": Architecture(Olmo2ForCausalLM, olmo2_config),
    # OLMo 3 is OLMo 2 with windowed layers and their own rope, which ModelConfig holds.
    "Olmo3ForCausalLM": Architecture(Olmo2ForCausalLM, olmo3_config),
}


def architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ConfigError(
            f"architecture {name!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        ) from None


def model_class(name: str) -> CausalLMFactory:
    return architecture(name).model
