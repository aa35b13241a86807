"""The tensor-parallel group a worker belongs to: rank, size and the collectives the layers use.

An instance is passed to every layer instead of living in a module global, so a TP=1 engine never touches
torch.distributed and two engines in one process do not share state.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension (same result on every rank)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        # Gathered as a concatenation along dim 0 (the form every backend accepts), then re-split.
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x)
        return torch.cat(out.chunk(self.world_size, dim=0), dim=-1)

    def all_reduce_min_int(self, value: int, device: torch.device) -> int:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast_bytes(self, data: bytes | None, device: torch.device, max_len: int = 4096) -> bytes:
        """Rank 0's bytes on every rank (used to share socket addresses under torchrun)."""
        buf = torch.zeros(max_len + 4, dtype=torch.uint8, device=device)
        if self.rank == 0:
            assert data is not None and len(data) <= max_len, "internal: address too long"
            buf[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
            buf[4 : 4 + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        if self.world_size > 1:
            dist.broadcast(buf, src=0)
        raw = bytes(buf.cpu().tolist())
        return raw[4 : 4 + int.from_bytes(raw[:4], "little")]


# Newer torch renames all_gather_into_tensor to all_gather_single and warns on the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def init_process_group(
    backend: str, init_method: str, rank: int, world_size: int, timeout_s: float, device: torch.device
) -> TPGroup:
    kwargs = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,  # type: ignore[arg-type]
    )
    return TPGroup(rank=rank, world_size=world_size)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
