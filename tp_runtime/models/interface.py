"""What the runtime needs from a causal LM, and how a model class maps a Hugging Face checkpoint onto its
(sharded, fused) parameters.

The worker builds a model through a `CausalLMFactory`, the loader fills it through `checkpoint_shapes` and
`checkpoint_targets`, and the model runner only calls it and reads `dtype` and `num_local_kv_heads`; none
of them knows an architecture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tp_runtime.config import ModelConfig
from tp_runtime.distributed import TPGroup
from tp_runtime.layers.attention import AttentionMetadata
from tp_runtime.layers.normed_input import NormedInput

# One checkpoint tensor: its name, its full (unsharded) shape, the parameter it fills on this rank and the
# shard index its weight_loader takes (which part of a fused parameter: q/k/v, gate/up, an expert).
CheckpointEntry = tuple[str, tuple[int, ...], nn.Parameter, int]


class FeedForward(Protocol):
    """A decoder layer's feed-forward (dense MLP or sparse experts) and its part of the checkpoint."""

    def __call__(self, x: torch.Tensor | NormedInput) -> torch.Tensor:
        """x: the post-attention norm's output, possibly deferred (layers/normed_input.py)."""
        ...

    def checkpoint_entries(self, prefix: str) -> Iterator[CheckpointEntry]:
        """Its checkpoint tensors, named under `prefix` (e.g. "model.layers.3.mlp.")."""
        ...


def unused_checkpoint_tensor(name: str) -> bool:
    """A tensor some checkpoints hold that fills no parameter and is skipped: the rotary inverse
    frequencies (`...rotary_emb.inv_freq`), a buffer transformers once saved and now keeps out of
    checkpoints (non-persistent) and ignores in older ones; the model computes them from its config."""
    return name.endswith("rotary_emb.inv_freq")


@dataclass(frozen=True)
class CheckpointNames:
    """How an architecture's checkpoints name their tensors where that is not the model's own naming (the
    names checkpoint_shapes() gives): `prefixes` maps a checkpoint name prefix to the model's prefix that
    replaces it, or to None for tensors of parts the runtime does not run (a vision tower), which are
    skipped without being read. The first matching prefix applies, and a checkpoint of such an architecture
    names nothing outside them. No prefixes: the checkpoint's names are the model's."""

    prefixes: tuple[tuple[str, str | None], ...] = ()

    def model_name(self, name: str) -> str | None:
        """The model's name of checkpoint tensor `name`; None where it is skipped; KeyError where it is under
        none of the prefixes (not a tensor of this architecture)."""
        if not self.prefixes:
            return name
        for prefix, replacement in self.prefixes:
            if name.startswith(prefix):
                return None if replacement is None else replacement + name[len(prefix) :]
        raise KeyError(name)

    def checkpoint_names(self, model_name: str) -> tuple[str, ...]:
        """The names a checkpoint of this architecture may give the model's tensor `model_name` (one per
        naming it accepts): what its quantization_config's ignore list names."""
        if not self.prefixes:
            return (model_name,)
        names = []
        for prefix, replacement in self.prefixes:
            if replacement is not None and model_name.startswith(replacement):
                stored = prefix + model_name[len(replacement) :]
                if self.model_name(stored) == model_name:  # not taken by an earlier prefix
                    names.append(stored)
        return tuple(names)


# A checkpoint that names the tensors as the model does (most architectures').
MODEL_NAMES = CheckpointNames()


# An architecture's config adapter: the ModelConfig fields it sets from a Hugging Face config (biases,
# sliding window, experts); build_model_config fills the fields every architecture shares.
ConfigAdapter = Callable[[Any], dict[str, Any]]


class CausalLM(Protocol):
    dtype: torch.dtype
    num_local_kv_heads: int

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per scheduled token."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (identical on every rank)."""
        ...

    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads on this rank (for the roofline)."""
        ...

    def checkpoint_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Names and full shapes of the tensors a Hugging Face checkpoint of this model holds."""
        ...

    def checkpoint_targets(self, name: str) -> Iterator[tuple[nn.Parameter, int]]:
        """The parameter(s) a checkpoint tensor feeds, with shard indices; KeyError for an unknown name."""
        ...

    def fused_checkpoint_parts(self, name: str) -> tuple[tuple[str, int], ...]:
        """Where checkpoint tensor `name` stacks several of checkpoint_shapes' tensors along dim 0 (Phi-3's
        qkv_proj and gate_up_proj): each part's name and rows, in order; () for any other tensor."""
        ...

    def checkpoint_row_order(self, name: str) -> list[int] | None:
        """The order of each head's rows of checkpoint tensor `name` as the model holds them (None: as
        stored): with partial rotary embeddings, q's and k's dims as layers/rotary.py's tables lay them."""
        ...

    def tied_checkpoint_names(self) -> dict[str, str]:
        """Checkpoint names whose tensor, when the checkpoint holds it, must equal another's that fills the
        same parameter (a tied LM head: {"lm_head.weight": "model.embed_tokens.weight"}); {} if none."""
        ...

    def eval(self) -> Any: ...


class CausalLMFactory(Protocol):
    """A model class: built once per rank with that rank's TP group."""

    def __call__(
        self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device, fused: bool = False
    ) -> CausalLM: ...
