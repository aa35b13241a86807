"""Sparse mixture-of-experts feed-forward (Mixtral, Qwen3-MoE; Qwen2-MoE's, with its shared expert, in
models/qwen2_moe.py), tensor-parallel.

Every rank holds every expert, each cut like a dense MLP: gate/up column-parallel (rows of the expert's
intermediate dimension), down row-parallel. The down projection is linear, so a rank can sum its experts'
weighted partial outputs for a token first and the layer needs ONE all-reduce, as a dense MLP does. The
router is replicated: every rank computes the same routing from the same (already all-reduced) input.

Expert weights are stacked into two parameters, w13 [E, 2·I/tp, H] (each expert's gate rows, then its up
rows) and w2 [E, H, I/tp]; the checkpoint's per-expert tensors fill their slices. Each stack is stored and
loaded by the model's LinearMethod, one expert at a time, as it does a linear layer's weight
(`ExpertWeights`): in the model dtype, or FP8 with its scales (w13_scale, w2_scale) in fp8.py's layout.
Four ways to run them, picked once from the device, the dtype and the method (`impl`):
- "loop" (CPU): for each expert that got tokens, gather them, run its MLP, add the weighted result, as
  transformers does. Idle experts are skipped; the per-expert token counts are read on the host. FP8
  experts multiply by their dequantized weights (what the tests compare against transformers with).
- "grouped" (CUDA, bf16, sm90/sm100): (token, expert) pairs sorted by expert on the device and two
  torch._grouped_mm calls with device-side group offsets: no host sync, so it runs inside the decode CUDA
  graphs, and the work scales with the routed pairs.
- "fp8_grouped" (CUDA, FP8 experts, sm90/sm100): the same sorted pairs through the Triton W8A8 grouped
  GEMM (quantization/fp8_moe_triton.py), activations quantized per token as the FP8 linear layers' are.
- "dense" (CUDA otherwise, where _grouped_mm would fall back to a host loop): every expert on every token
  with batched matmuls, weighted by a routing matrix that is zero for unrouted pairs. No host sync either.
  It does num_experts / top_k times the routed work and holds [E, tokens, I/tp] activations: negligible
  next to reading the weights at decode batch sizes (where most experts are hit anyway), costly for long
  prefills; it is the fp32/fp16 fallback, used on GPUs mainly for correctness checks (FP8 experts
  without their kernels are dequantized for it one expert at a time, on every call).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from tp_runtime.distributed import TPGroup
from tp_runtime.layers.activation import silu_and_mul
from tp_runtime.layers.linear import TensorSource, _copy_checked, _param, divide, renewed
from tp_runtime.layers.normed_input import NormedInput, as_tensor
from tp_runtime.layers.quantization import UNQUANTIZED, LinearMethod, Shard

if TYPE_CHECKING:
    from tp_runtime.models.interface import CheckpointEntry

MOE_IMPLS = ("loop", "grouped", "fp8_grouped", "dense")
# FP8 experts with per-row scales take torch._scaled_grouped_mm (CUTLASS) rather than the Triton grouped
# GEMM from this many (token, expert) pairs per expert of the layer, in layers of at most
# FP8_CUTLASS_MAX_EXPERTS experts. On an H200 a Mixtral-8x7B layer took 646 against 692 µs at 32 pairs an
# expert and 1378 against 2157 at 256; with Qwen3-30B-A3B's 128 small experts CUTLASS was level at 64
# pairs an expert (582 against 580 µs) and far behind at 256 (2187 against 1397). Fewer pairs: the Triton
# GEMM, which reads the weights faster (decode). BENCHMARKS.md, "GPU: FP8".
FP8_CUTLASS_PAIRS_PER_EXPERT = 32
FP8_CUTLASS_MAX_EXPERTS = 16


def pick_moe_impl(
    device: torch.device,
    dtype: torch.dtype,
    hidden_size: int,
    local_intermediate: int,
    method: LinearMethod = UNQUANTIZED,
    scale_block_k: int = 0,
) -> str:
    """`scale_block_k`: the FP8 scales' columns per block (0: one scale per row)."""
    if device.type != "cuda":
        return "loop"
    if method.quantized:
        from tp_runtime.layers.quantization.fp8 import CudaFp8Kernels

        kernels = getattr(method, "kernels", None)
        # The grouped GEMM's launch shapes are the Triton FP8 GEMM's (sm90/sm100), its K tiles FP8 MMAs'.
        fits = scale_block_k == 0 or (scale_block_k >= 32 and not scale_block_k & (scale_block_k - 1))
        triton_gemm = isinstance(kernels, CudaFp8Kernels) and kernels.triton_gemm
        return "fp8_grouped" if triton_gemm and fits else "dense"
    # _grouped_mm's sync-free CUTLASS kernels: bf16 on sm90/sm100, rows aligned to 16 bytes (8 elements).
    grouped = (
        hasattr(torch, "_grouped_mm")
        and dtype == torch.bfloat16
        and torch.cuda.get_device_capability(device)[0] in (9, 10)
        and hidden_size % 8 == 0
        and local_intermediate % 8 == 0
    )
    return "grouped" if grouped else "dense"


@dataclass
class _ExpertView:
    """One expert's part of a stack, as a LinearMethod's loaders see a linear layer. Its rows may start
    inside a checkpoint's scale block (fp8.py stores block scales per row; w2's columns get scales as
    fine as their first column needs), so any TP size that divides the experts' width loads."""

    weight: torch.Tensor
    weight_scale: torch.Tensor | None
    tp: TPGroup
    scale_block_k: int
    shards_may_cut_blocks: bool = True


class ExpertWeights:
    """One stacked expert weight of a SparseMoE: `w13` (each expert's gate rows, then its up rows: rows of
    the intermediate dimension, column-parallel) or `w2` (down: its columns, row-parallel). Its
    LinearMethod makes, loads and scales it as it does a linear layer's weight, one expert at a time; the
    loader routes the checkpoint's per-expert tensors and their scales here as it does a linear layer's
    (loader.QuantizedCheckpoint)."""

    def __init__(
        self,
        moe: SparseMoE,
        name: str,
        shape: tuple[int, int, int],
        column_parallel: bool,
        method: LinearMethod,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self._moe, self.name, self.shape = moe, name, shape
        self.column_parallel = column_parallel
        self._dtype, self._device = dtype, device
        self.use_method(method)

    @property
    def weight(self) -> nn.Parameter:
        param: nn.Parameter = getattr(self._moe, self.name)
        return param

    @property
    def scale(self) -> torch.Tensor | None:
        scale: torch.Tensor | None = getattr(self._moe, f"{self.name}_scale")
        return scale

    @property
    def tp(self) -> TPGroup:
        return self._moe.tp

    def use_method(self, method: LinearMethod) -> None:
        """Store the stack as `method` does; its weights are made anew, empty."""
        self.method = method
        experts, rows, cols = self.shape
        holder = nn.Module()
        first_col = 0 if self.column_parallel else self.tp.rank * cols
        method.create_weights(holder, rows, cols, self._dtype, self._device, experts, first_col)
        weight = cast(nn.Parameter, holder._parameters["weight"])
        setattr(self._moe, self.name, renewed(self._moe._parameters.get(self.name), weight))
        self._moe.register_parameter(f"{self.name}_scale", getattr(holder, "weight_scale", None))
        self.scale_block_k: int = getattr(holder, "scale_block_k", cols)
        self.weight.weight_loader = self._load_weight  # type: ignore[attr-defined]
        if hasattr(self._moe, "_run"):  # a change after construction (the loader's ignore list)
            self._moe.use_impl()

    def _shard(self, shard_id: int) -> tuple[int, Shard]:
        """(expert, this rank's part): w13's shard_id is 2·expert + (0 gate, 1 up), w2's the expert."""
        n = self._moe.local_intermediate
        start = self.tp.rank * n
        if self.column_parallel:
            expert, half = divmod(shard_id, 2)
            return expert, Shard(0, start, n, half * n)
        return shard_id, Shard(1, start, n)

    def _view(self, expert: int) -> _ExpertView:
        scale = self.scale
        scale = None if scale is None else scale.data[expert]
        return _ExpertView(self.weight.data[expert], scale, self.tp, self.scale_block_k)

    def _load_weight(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        expert, shard = self._shard(shard_id)
        self.method.load_weight(self._view(expert), source, shard)

    def load_scale(self, source: TensorSource, shard_id: int, weight_shape: tuple[int, ...]) -> None:
        expert, shard = self._shard(shard_id)
        self.method.load_scale(self._view(expert), source, shard, weight_shape)

    def activation_groups(self) -> int:
        """Columns per activation scale the stack's FP8 scales need: 0 for one per row (per-channel or
        per-tensor scales, or blocks as wide as the stack's inputs)."""
        scale = self.scale
        return self.scale_block_k if scale is not None and scale.shape[-1] > 1 else 0

    def dequantized(self, dtype: torch.dtype, expert: int | None = None) -> torch.Tensor:
        """The weights of one expert (or the whole stack) in `dtype`, as the CPU and fallback paths use
        them."""
        weight = self.weight if expert is None else self.weight[expert]
        scale = self.scale
        if scale is None:
            return weight
        from tp_runtime.layers.quantization.fp8 import dequantize

        return dequantize(weight, scale if expert is None else scale[expert], self.scale_block_k, dtype)


class SparseMoE(nn.Module):
    """Top-k routed SiLU-gated experts. `expert_names`: the checkpoint names of an expert's gate, up and
    down projections (Mixtral: w1, w3, w2). `renormalize`: scale the top-k weights to sum to 1.
    `fp32_weights`: weight each expert's output in float32 (Mixtral) rather than the model dtype (Qwen3-MoE),
    as transformers does for each. `method`: how the experts' weights are stored and multiplied (the
    model's LinearMethod: unquantized, or FP8)."""

    w13: nn.Parameter
    w2: nn.Parameter
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None

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
        method: LinearMethod = UNQUANTIZED,
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
        self.router.weight_loader = self._load_router  # type: ignore[attr-defined]
        e, h = num_experts, hidden_size
        self.w13_stack = ExpertWeights(self, "w13", (e, 2 * n, h), True, method, dtype, device)
        self.w2_stack = ExpertWeights(self, "w2", (e, h, n), False, method, dtype, device)
        self._device, self._dtype, self._impl = device, dtype, impl
        self.use_impl()

    @property
    def stacks(self) -> tuple[ExpertWeights, ExpertWeights]:
        return self.w13_stack, self.w2_stack

    def use_impl(self) -> None:
        """Pick how the experts run from the device, the dtype and the stacks' method (again after the
        loader has changed the method: an ignore list that covers the experts)."""
        blocks = [s.activation_groups() for s in self.stacks if s.activation_groups()]
        if self.w13_stack.method.quantized != self.w2_stack.method.quantized:
            # An ignore list that keeps one of the two unquantized: both dequantized on every call.
            self.impl = self._impl or ("loop" if self._device.type != "cuda" else "dense")
        else:
            self.impl = self._impl or pick_moe_impl(
                self._device,
                self._dtype,
                self.hidden_size,
                self.local_intermediate,
                self.w13_stack.method,
                min(blocks, default=0),
            )
        runs: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
            "loop": self._loop,
            "grouped": self._grouped,
            "fp8_grouped": self._fp8_grouped,
            "dense": self._dense,
        }
        if self.impl not in runs:
            raise ValueError(f"MoE impl must be one of {MOE_IMPLS}, got {self.impl!r}")
        fp8 = [stack.scale is not None for stack in self.stacks]
        narrow = [g for g in blocks if g < 32 or g & (g - 1)]  # the Triton GEMM's K tile must fit a block
        if (self.impl == "fp8_grouped" and (not all(fp8) or narrow)) or (self.impl == "grouped" and any(fp8)):
            raise ValueError(
                f"MoE impl {self.impl!r} cannot run these experts (FP8 stacks: {fp8}, scale blocks of "
                f"{blocks or 'whole rows'} columns)"
            )
        if self._impl is None and self.impl == "dense" and any(fp8):
            why = (
                "the checkpoint leaves one of a layer's two expert stacks unquantized"
                if not all(fp8)
                else "their grouped GEMM needs an sm90/sm100 GPU and scale blocks of at least 32 columns (a "
                "tensor_parallel_size whose shards start inside a checkpoint's scale block narrows them: "
                f"{blocks or 'whole rows'})"
            )
            message = f"FP8 experts are dequantized on every forward here, which is slow: {why}"
            warnings.warn(message, stacklevel=2)
        self._run = runs[self.impl]
        # Many pairs per expert of few experts, per-row scales under bfloat16 on sm90: see
        # FP8_CUTLASS_PAIRS_PER_EXPERT.
        self._scaled_grouped_mm = (
            self.impl == "fp8_grouped"
            and self.num_experts <= FP8_CUTLASS_MAX_EXPERTS
            and self._dtype == torch.bfloat16
            and hasattr(torch, "_scaled_grouped_mm")
            and self._device.type == "cuda"
            and torch.cuda.get_device_capability(self._device) == (9, 0)
            and not any(s.activation_groups() for s in self.stacks)
            and not (self.hidden_size % 16 or self.local_intermediate % 16)
        )

    # ------------------------------------------------------------------ loading

    def _load_router(self, param: nn.Parameter, source: TensorSource, shard_id: int = 0) -> None:
        _copy_checked(param.data, source.full(), "router")

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

    def forward(self, x: torch.Tensor | NormedInput) -> torch.Tensor:
        x = as_tensor(x)  # the router reads it too
        weights, ids = self.route(x)
        return self.tp.all_reduce(self._run(x, weights, ids))

    def _expert_mlp(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        w13 = self.w13_stack.dequantized(x.dtype, expert)
        w2 = self.w2_stack.dequantized(x.dtype, expert)
        return F.linear(silu_and_mul(F.linear(x, w13), self.fused), w2)

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

    def _pairs_by_expert(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (token, slot) pairs sorted by expert (stable) and each expert's group end, int32 on the
        device (bincount would read the maximum on the host): the grouped GEMMs' order and offsets."""
        flat = ids.flatten()
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=ids.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        return flat.argsort(stable=True), counts.cumsum(0, dtype=torch.int32)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        tokens, k = ids.shape
        order, offs = self._pairs_by_expert(ids)
        gate_up = torch._grouped_mm(x[order // k], self.w13.transpose(1, 2), offs=offs)
        y_sorted = torch._grouped_mm(silu_and_mul(gate_up, self.fused), self.w2.transpose(1, 2), offs=offs)
        y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted).view(tokens, k, -1)
        return _weighted_sum(y, weights, x.dtype)

    def _fp8_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        from tp_runtime.layers.quantization import activation_quant_triton as aq
        from tp_runtime.layers.quantization.fp8_moe_triton import fp8_moe_gemm, route_tiles

        tokens, k = ids.shape
        pairs = tokens * k
        if self._scaled_grouped_mm and pairs >= FP8_CUTLASS_PAIRS_PER_EXPERT * min(self.num_experts, pairs):
            return self._fp8_scaled_grouped_mm(x, weights, ids)
        w13, w2 = self.w13_stack, self.w2_stack
        assert w13.scale is not None and w2.scale is not None, "internal: fp8_grouped without FP8 experts"

        def quantize(
            a: torch.Tensor, stack: ExpertWeights, silu_mul: bool = False
        ) -> tuple[torch.Tensor, torch.Tensor]:
            a = a if a.stride(-1) == 1 else a.contiguous()
            group = stack.activation_groups()
            if group:
                return aq.quantize_groups_fp8(a, group, silu_mul=silu_mul)
            return aq.quantize_rows_fp8(a, silu_mul=silu_mul)

        tiles = route_tiles(ids, self.num_experts)
        xq, x_scale = quantize(x, w13)
        gate_up = fp8_moe_gemm(
            xq, x_scale, w13.weight, w13.scale, w13.scale_block_k, tiles, x.dtype, a_rows=tiles.order // k
        )
        hq, h_scale = quantize(gate_up, w2, silu_mul=True)  # the SiLU-mul inside the quantization
        # Rows back in (token, slot) order, each expert's output written where its pair belongs.
        y = fp8_moe_gemm(
            hq, h_scale, w2.weight, w2.scale, w2.scale_block_k, tiles, x.dtype, out_rows=tiles.order
        )
        return _weighted_sum(y.view(tokens, k, -1), weights, x.dtype)

    def _fp8_scaled_grouped_mm(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        from tp_runtime.layers.quantization import activation_quant_triton as aq

        tokens, k = ids.shape
        w13, w2 = self.w13_stack, self.w2_stack
        assert w13.scale is not None and w2.scale is not None, "internal: fp8_grouped without FP8 experts"
        order, offs = self._pairs_by_expert(ids)
        xq, x_scale = aq.quantize_rows_fp8(x[order // k])  # per token, as the Triton path's
        gate_up = torch._scaled_grouped_mm(
            xq, w13.weight.transpose(1, 2), x_scale.view(-1), w13.scale[..., 0], offs=offs, out_dtype=x.dtype
        )
        hq, h_scale = aq.quantize_rows_fp8(gate_up, silu_mul=True)
        y_sorted = torch._scaled_grouped_mm(
            hq, w2.weight.transpose(1, 2), h_scale.view(-1), w2.scale[..., 0], offs=offs, out_dtype=x.dtype
        )
        y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted).view(tokens, k, -1)
        return _weighted_sum(y, weights, x.dtype)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        tokens, experts = x.shape[0], self.num_experts
        routing = torch.zeros(tokens, experts, dtype=weights.dtype, device=x.device).scatter_(1, ids, weights)
        if any(stack.scale is not None for stack in self.stacks):
            # FP8 experts without their kernels: one expert's weights dequantized at a time, so the
            # scratch is an expert's, not the stack's.
            out = torch.zeros_like(x)
            for e in range(experts):
                y = self._expert_mlp(x, e) * routing[:, e : e + 1]
                out += y.to(x.dtype)
            return out
        w13, w2 = self.w13, self.w2
        gate_up = torch.matmul(x, w13.transpose(1, 2))  # [E, tokens, 2·I/tp]
        h = silu_and_mul(gate_up.view(experts * tokens, -1), self.fused).view(experts, tokens, -1)
        y = torch.bmm(h, w2.transpose(1, 2))  # [E, tokens, H]
        return (y * routing.t().unsqueeze(-1)).to(x.dtype).sum(0)


def _weighted_sum(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [tokens, k, H] weighted by the routing and summed over the k slots in a fixed order (not with
    atomics), so every run gives the same bits."""
    return (y * weights.unsqueeze(-1)).to(dtype).sum(1)
