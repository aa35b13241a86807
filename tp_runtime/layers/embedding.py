"""Vocab-parallel embedding and LM head: each rank holds a contiguous block of vocabulary rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tp_runtime.distributed import TPGroup
from tp_runtime.layers.linear import TORCH_MATMUL, Matmul, TensorSource


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        # Pad so every rank holds the same number of rows; padded rows stay zero and are never looked up.
        self.rows_per_rank = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = nn.Parameter(
            torch.zeros(self.rows_per_rank, hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        if source.shape[0] != self.vocab_size:
            raise ValueError(
                f"checkpoint embedding has {source.shape[0]} rows, config says {self.vocab_size}"
            )
        n = max(self.vocab_end - self.vocab_start, 0)
        if n:
            param.data[:n].copy_(source.narrow(0, self.vocab_start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocab block, gathered so every rank holds the full logits."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(vocab_size, hidden_size, tp, dtype, device)
        self.matmul: Matmul = TORCH_MATMUL

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.matmul.logits(hidden, self.weight)
        return self.tp.all_gather_last_dim(local)[..., : self.vocab_size]
