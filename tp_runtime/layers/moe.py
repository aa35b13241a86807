"""Sparse mixture-of-experts feed-forward (Mixtral, Qwen3-MoE), tensor-parallel.

Every rank holds every expert, each cut like a dense MLP: gate/up column-parallel (rows of the expert's
intermediate dimension), down row-parallel. The down projection is linear, so a rank can sum its experts'
weighted partial outputs for a token first and the layer needs ONE all-reduce, as a dense MLP does. The
router is replicated: every rank computes the same routing from the same (already all-reduced) input.

Expert weights are stacked into two parameters, w13 [E, 2·I/tp, H] (each expert's gate rows, then its up
rows) and w2 [E, H, I/tp]; the checkpoint's per-expert tensors fill their slices. Three ways to run them,
picked once from the device and dtype (`impl`):
- "loop" (CPU): for each expert that got tokens, gather them, run its MLP, add the weighted result, as
  transformers does. Idle experts are skipped; the per-expert token counts are read on the host.
- "grouped" (CUDA, bf16, sm90/sm100): (token, expert) pairs sorted by expert on the device and two
  torch._grouped_mm calls with device-side group offsets: no host sync, so it runs inside the decode CUDA
  graphs, and the work scales with the routed pairs.
- "dense" (CUDA otherwise, where _grouped_mm would fall back to a host loop): every expert on every token
  with batched matmuls, weighted by a routing matrix that is zero for unrouted pairs. No host sync either.
  It does num_experts / top_k times the routed work and holds [E, tokens, I/tp] activations: negligible
  next to reading the weights at decode batch sizes (where most experts are hit anyway), costly for long
  prefills; it is the fp32/fp16 fallback, used on GPUs mainly for correctness checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tp_runtime.distributed import TPGroup
from tp_runtime.layers.activation import silu_and_mul
from tp_runtime.layers.linear import TensorSource, _copy_checked, _param, divide

if TYPE_CHECKING:
    from tp_runtime.models.interface import CheckpointEntry

MOE_IMPLS = ("loop", "grouped", "dense")


def pick_moe_impl(device: torch.device, dtype: torch.dtype, hidden_size: int, local_intermediate: int) -> str:
    if device.type != "cuda":
        return "loop"
    # _grouped_mm's sync-free CUTLASS kernels: bf16 on sm90/sm100, rows aligned to 16 bytes (8 elements).
    grouped = (
        hasattr(torch, "_grouped_mm")
        and dtype == torch.bfloat16
        and torch.cuda.get_device_capability(device)[0] in (9, 10)
        and hidden_size % 8 == 0
        and local_intermediate % 8 == 0
    )
    return "grouped" if grouped else "dense"


class SparseMoE(nn.Module):
    """Top-k routed SiLU-gated experts. `expert_names`: the checkpoint names of an expert's gate, up and
    down projections (Mixtral: w1, w3, w2). `renormalize`: scale the top-k weights to sum to 1.
    `fp32_weights`: weight each expert's output in float32 (Mixtral) rather than the model dtype (Qwen3-MoE),
    as transformers does for each."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        fp32_weights: bool,
        expert_names: tuple[str, str, str],
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool,
        impl: str | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.fp32_weights = renormalize, fp32_weights
        self.expert_names = expert_names
        self.fused = fused
        self.local_intermediate = n = divide(intermediate_size, tp.world_size)
        self.router = _param((num_experts, hidden_size), dtype, device)
        self.w13 = _param((num_experts, 2 * n, hidden_size), dtype, device)
        self.w2 = _param((num_experts, hidden_size, n), dtype, device)
        self.router.weight_loader = self._load_router  # type: ignore[attr-defined]
        self.w13.weight_loader = self._load_w13  # type: ignore[attr-defined]
        self.w2.weight_loader = self._load_w2  # type: ignore[attr-defined]
        self.impl = impl or pick_moe_impl(device, dtype, hidden_size, n)
        if self.impl not in MOE_IMPLS:
            raise ValueError(f"MoE impl must be one of {MOE_IMPLS}, got {self.impl!r}")

    # ------------------------------------------------------------------ loading

    def _load_router(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        _copy_checked(param.data, source.full(), "router")

    def _load_w13(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        """shard_id = 2·expert + (0 gate, 1 up); this rank's rows of the intermediate dimension."""
        expert, half = divmod(shard_id, 2)
        n = self.local_intermediate
        data = source.narrow(0, self.tp.rank * n, n)
        _copy_checked(param.data[expert, half * n : (half + 1) * n], data, "expert gate/up")

    def _load_w2(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        """shard_id = expert; this rank's columns of the intermediate dimension."""
        n = self.local_intermediate
        _copy_checked(param.data[shard_id], source.narrow(1, self.tp.rank * n, n), "expert down")

    def checkpoint_entries(self, prefix: str) -> Iterator[CheckpointEntry]:
        gate, up, down = self.expert_names
        h, i = self.hidden_size, self.intermediate_size
        yield f"{prefix}gate.weight", (self.num_experts, h), self.router, 0
        for e in range(self.num_experts):
            p = f"{prefix}experts.{e}."
            yield f"{p}{gate}.weight", (i, h), self.w13, 2 * e
            yield f"{p}{up}.weight", (i, h), self.w13, 2 * e + 1
            yield f"{p}{down}.weight", (h, i), self.w2, e

    # ------------------------------------------------------------------ forward

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [tokens, k] and their weights, as transformers computes them: softmax
        over all experts in float32, top-k, optionally renormalised."""
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.fp32_weights else weights.to(x.dtype)), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.impl == "loop":
            out = self._loop(x, weights, ids)
        elif self.impl == "grouped":
            out = self._grouped(x, weights, ids)
        else:
            out = self._dense(x, weights, ids)
        return self.tp.all_reduce(out)

    def _expert_mlp(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(x, self.w13[expert]), self.fused), self.w2[expert])

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        flat = ids.flatten()
        pairs_by_expert = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, in token order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        for expert, pairs in enumerate(pairs_by_expert.split(counts)):
            if not counts[expert]:
                continue  # no token chose this expert: its weights are not read
            tokens = pairs // self.top_k
            y = self._expert_mlp(x[tokens], expert) * weights.flatten()[pairs].unsqueeze(-1)
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        tokens, k = ids.shape
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        # Group ends as int32 on the device (bincount would read the maximum on the host).
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        gate_up = torch._grouped_mm(x[order // k], self.w13.transpose(1, 2), offs=offs)
        y_sorted = torch._grouped_mm(silu_and_mul(gate_up, self.fused), self.w2.transpose(1, 2), offs=offs)
        y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted).view(tokens, k, -1)
        # Summed over the k slots in a fixed order (not with atomics), so every run gives the same bits.
        return (y * weights.unsqueeze(-1)).to(x.dtype).sum(1)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        tokens, experts = x.shape[0], self.num_experts
        routing = torch.zeros(tokens, experts, dtype=weights.dtype, device=x.device).scatter_(1, ids, weights)
        gate_up = torch.matmul(x, self.w13.transpose(1, 2))  # [E, tokens, 2·I/tp]
        h = silu_and_mul(gate_up.view(experts * tokens, -1), self.fused).view(experts, tokens, -1)
        y = torch.bmm(h, self.w2.transpose(1, 2))  # [E, tokens, H]
        return (y * routing.t().unsqueeze(-1)).to(x.dtype).sum(0)
