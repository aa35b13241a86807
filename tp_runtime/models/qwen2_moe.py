"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias) with routed experts beside
a shared expert, a dense MLP every token of a sparse layer also goes through, its output scaled per token by
sigmoid(shared_expert_gate(x)); dense MLPs on the layers `mlp_only_layers` and `decoder_sparse_step` name.

The shared expert is cut as a dense MLP (gate/up column-parallel, down row-parallel) and its gate is
replicated, so each rank scales its partial shared output by the same per-token gate and adds it to its
experts' partial sum: the layer still needs one all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from tp_runtime.config import ModelConfig
from tp_runtime.distributed import TPGroup
from tp_runtime.errors import ConfigError
from tp_runtime.layers.linear import TensorSource, _copy_checked, _param
from tp_runtime.layers.moe import SparseMoE
from tp_runtime.layers.normed_input import NormedInput, as_tensor
from tp_runtime.models.interface import FeedForward
from tp_runtime.models.llama import LlamaForCausalLM, LlamaMLP, windowed_layers
from tp_runtime.models.qwen3_moe import moe_fields, sparse_moe_options

if TYPE_CHECKING:
    from torch import nn

    from tp_runtime.models.interface import CheckpointEntry


class SharedExpertMoE(SparseMoE):
    """SparseMoE plus Qwen2-MoE's gated shared expert (`shared_expert`, `shared_expert_gate`)."""

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> None:
        super().__init__(**sparse_moe_options(cfg, tp, dtype, device, fused))
        self.shared_expert = LlamaMLP(cfg, tp, dtype, device, fused, cfg.shared_expert_intermediate_size)
        # [1, hidden]: one logit per token, replicated (as the router; too small to quantize).
        self.shared_expert_gate = _param((1, cfg.hidden_size), dtype, device)
        self.shared_expert_gate.weight_loader = self._load_shared_gate  # type: ignore[attr-defined]

    def _load_shared_gate(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        _copy_checked(param.data, source.full(), "shared_expert_gate")

    def checkpoint_entries(self, prefix: str) -> Iterator[CheckpointEntry]:
        yield from super().checkpoint_entries(prefix)
        yield from self.shared_expert.checkpoint_entries(f"{prefix}shared_expert.")
        yield f"{prefix}shared_expert_gate.weight", (1, self.hidden_size), self.shared_expert_gate, 0

    def forward(self, x: torch.Tensor | NormedInput) -> torch.Tensor:
        x = as_tensor(x)
        weights, ids = self.route(x)
        routed = self._run(x, weights, ids)
        shared = self.shared_expert(x, reduce=False)  # this rank's partial sum, as `routed`
        gate = torch.sigmoid(F.linear(x, self.shared_expert_gate))
        # transformers' order: the routed output plus the gated shared one.
        return self.tp.all_reduce(routed + gate * shared)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    def make_mlp(
        self, layer: int, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> FeedForward:
        if layer not in self.config.moe_layers:
            return super().make_mlp(layer, tp, dtype, device, fused)  # of intermediate_size
        return SharedExpertMoE(self.config, tp, dtype, device, fused)


def qwen2_moe_config(hf: Any) -> dict[str, Any]:
    shared = getattr(hf, "shared_expert_intermediate_size", None)
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 1:
        raise ConfigError(
            f"Qwen2-MoE shared_expert_intermediate_size must be a positive int (the shared expert's width), "
            f"got {shared!r}; check config.json"
        )
    return {
        "qkv_bias": bool(getattr(hf, "qkv_bias", True)),  # q/k/v only: o_proj has none
        "o_proj_bias": False,
        # transformers windows the layers layer_types marks sliding (by default every other one below
        # max_window_layers, with use_sliding_window).
        **windowed_layers(hf, "Qwen2-MoE"),
        **moe_fields(hf),
        "shared_expert_intermediate_size": shared,
    }
