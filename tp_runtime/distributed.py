"""The tensor-parallel group a worker belongs to: rank, size and the collectives the layers use.

An instance is passed to every layer instead of living in a module global, so a TP=1 engine never touches
torch.distributed and two engines in one process do not share state.

The sum all-reduce of the row-parallel layers is an `AllReduce` strategy chosen once at start-up
(`make_all_reduce`) and held by the group:

- `IdentityAllReduce`: world size 1.
- `DistAllReduce`: torch.distributed.all_reduce (NCCL on GPU, gloo on CPU).
- `SymmMemAllReduce`: PyTorch symmetric memory (peer GPUs read each other's buffer over NVLink) for
  messages up to the size of a decode step, NCCL for larger ones (prefill). One symmetric buffer is
  allocated and exchanged once; every call copies into it, so a call allocates no symmetric memory and
  uses fixed addresses (CUDA-graph capturable). It also fuses the all-reduce with the residual add +
  RMSNorm after it (`add_rms_norm`, layers/allreduce_norm_triton.py) for decode-sized messages; a model
  whose strategy `fuses_add_rms_norm` leaves its row-parallel outputs unreduced for the norm to sum.

NVLink multicast (NVLS) is never used: `disable_nvlink_multicast` forces the variables that turn it off in
NCCL, PyTorch's symmetric memory and NVSHMEM, before the process group exists.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from tp_runtime.errors import TPRuntimeError

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------
# Thresholds, by message size in bytes, for 2 ranks on H200 NVLink. Measured before this module (per
# all-reduce): one-shot captured in a CUDA graph 6.2 us at 8 KiB and 8.1 us at 256 KiB against NCCL's
# 16.3 / 17.7 us; eager, two-shot 10.0 / 9.0 us against one-shot's 10.6 / 14.6 us. One-shot reads every
# peer's whole message with few blocks, so its time grows with the size while two-shot's stays flat:
# one-shot up to 256 KiB, two-shot above (vLLM likewise uses two-shot, not NCCL, for 2 Hopper GPUs up
# to 8 MiB and more). scripts/check_all_reduce.py times all three per size and suggests values; the
# two-shot -> NCCL crossover above 256 KiB in a graph is not measured yet.
# ---------------------------------------------------------------------------------------------------------
# Up to this size: one-shot (each rank reads every peer's buffer and sums; one kernel, copy fused in).
ONE_SHOT_MAX_BYTES = 256 << 10
# Above ONE_SHOT_MAX_BYTES and up to this size (and the buffer's): two-shot (each rank reduces its
# 1/world slice from every peer, writes it to every peer). Larger messages go to NCCL.
TWO_SHOT_MAX_BYTES = 8 << 20
# One-shot copies the message into the buffer inside its kernel up to this size, with a separate copy
# kernel above (measured on one H200, in a graph: fused 3.9 vs 4.7 us at 8 KiB, 5.3 vs 6.0 at 256 KiB;
# 10.3 vs 9.3 us at 2 MiB, 16.6 vs 13.5 at 4 MiB). Matters only if ONE_SHOT_MAX_BYTES is raised.
ONE_SHOT_FUSED_COPY_MAX_BYTES = 512 << 10
# The all-reduce's part of the symmetric buffer never exceeds this (the caller's max_message_bytes is
# capped to it); the fused all-reduce + add + RMSNorm adds three regions of one such slot per rank.
MAX_SYMM_BUFFER_BYTES = 8 << 20
# Dtypes torch's symmetric-memory all-reduce kernels implement (float16 is not among them).
SYMM_MEM_DTYPES = (torch.bfloat16, torch.float32)
# The kernels need the message size (and the buffer offset) to be a multiple of 4 bytes.
_SYMM_MEM_SIZE_MULTIPLE = 4
# The buffer is sized in multiples of this, so every dtype view of it is whole and 16-byte aligned.
_BUFFER_ALIGN = 256
_MAX_CACHED_VIEWS = 512
# Rows (tokens) the fused all-reduce + add + RMSNorm takes at most, and no more than the GPU has SMs, so
# its one-program-per-row grid is resident at once (each program waits for its peers' same row). Larger
# messages (prefill) reduce, then normalise.
FUSED_NORM_MAX_ROWS = 1024
# Its rows rotate over this many regions (layers/allreduce_norm_triton.py says why three).
_REGIONS = 3

STRATEGIES = ("auto", "nccl", "symm_mem")

NCCL = "nccl"
ONE_SHOT = "one_shot"
TWO_SHOT = "two_shot"

_MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def disable_nvlink_multicast() -> None:
    """Turn NVLink multicast (NVLS) off in NCCL, torch symmetric memory and NVSHMEM for this process.

    Forces the values (a value set by the user is overwritten): a program using multicast can take the
    host's shared GPUs out of service. Must run before the process group / symmetric memory are created.
    """
    for name, value in _MULTICAST_OFF.items():
        os.environ[name] = value


# ---------------------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------------------


class AllReduce(ABC):
    """Sum all-reduce over the TP group. `__call__` may reduce `x` in place and return it, or return a
    new tensor: callers must use the return value. Every rank calls it with tensors of the same shape and
    dtype, in the same order."""

    name: str = "all_reduce"

    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def describe(self) -> str:
        """One line for logs: the strategy and its limits."""
        return self.name

    @property
    def fuses_add_rms_norm(self) -> bool:
        """Whether `add_rms_norm` can fuse at all (a model then leaves its row-parallel outputs unreduced
        for the norm after them to sum)."""
        return False

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor | None:
        """weight * RMSNorm(all_reduce(x) + residual) in one kernel, `residual` updated in place to
        all_reduce(x) + residual; None where this strategy cannot for this message (the caller then
        reduces and normalises). The answer depends only on shapes and dtypes, so every rank agrees."""
        return None

    def close(self) -> None:  # noqa: B027  (optional hook; most strategies hold nothing)
        """Release what the strategy holds (the symmetric buffer)."""


class IdentityAllReduce(AllReduce):
    """World size 1: the sum over one rank is the tensor itself."""

    name = "identity"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


class DistAllReduce(AllReduce):
    """torch.distributed.all_reduce in place (NCCL on GPU, gloo on CPU)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        try:
            self.name = str(dist.get_backend(group)) if dist.is_initialized() else "dist"
        except (RuntimeError, ValueError):
            self.name = "dist"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


def select_method(
    nbytes: int,
    dtype: torch.dtype,
    capacity_bytes: int,
    *,
    one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES,
    two_shot_max_bytes: int = TWO_SHOT_MAX_BYTES,
    has_one_shot: bool = True,
    has_two_shot: bool = True,
) -> str:
    """How a message of `nbytes` bytes of `dtype` is all-reduced by SymmMemAllReduce: ONE_SHOT, TWO_SHOT
    or NCCL. Pure, and identical on every rank for the same message (all ranks must take the same path)."""
    if dtype not in SYMM_MEM_DTYPES or nbytes <= 0 or nbytes % _SYMM_MEM_SIZE_MULTIPLE:
        return NCCL
    if nbytes > capacity_bytes:
        return NCCL
    if has_one_shot and nbytes <= one_shot_max_bytes:
        return ONE_SHOT
    if has_two_shot and nbytes <= two_shot_max_bytes:
        return TWO_SHOT
    return NCCL


@dataclass(frozen=True)
class SymmMemOps:
    """The torch.ops.symm_mem operators this torch provides (None: absent), found once at start-up."""

    # (symm_buffer, reduce_op, group_name, out) -> out
    one_shot_out: Callable[..., Any] | None = None
    # (symm_buffer, local_input, reduce_op, group_name, out) -> out: copies local_input in the same kernel
    one_shot_copy_out: Callable[..., Any] | None = None
    # (symm_buffer, reduce_op, group_name, out) -> out (world sizes 2, 4, 8 only)
    two_shot_out: Callable[..., Any] | None = None
    # (symm_buffer, reduce_op, group_name) -> symm_buffer, reduced in place
    two_shot_inplace: Callable[..., Any] | None = None

    @property
    def has_one_shot(self) -> bool:
        return self.one_shot_out is not None or self.one_shot_copy_out is not None

    @property
    def has_two_shot(self) -> bool:
        return self.two_shot_out is not None or self.two_shot_inplace is not None


def detect_symm_mem_ops() -> SymmMemOps:
    def op(name: str) -> Callable[..., Any] | None:
        try:
            packet = getattr(torch.ops.symm_mem, name)
        except (AttributeError, RuntimeError):
            return None
        # The overload itself: calling it skips the packet's overload resolution on every call.
        return getattr(packet, "default", packet)

    return SymmMemOps(
        one_shot_out=op("one_shot_all_reduce_out"),
        one_shot_copy_out=op("one_shot_all_reduce_copy_out"),
        two_shot_out=op("two_shot_all_reduce_out"),
        two_shot_inplace=op("two_shot_all_reduce_"),
    )


def _import_symm_mem() -> ModuleType:
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def _aligned16(t: torch.Tensor) -> bool:
    return (t.storage_offset() * t.element_size()) % 16 == 0


@dataclass(frozen=True)
class FusedNormBuffers:
    """Where the fused all-reduce + add + RMSNorm (layers/allreduce_norm_triton.py) keeps its rows: three
    regions of one slot per rank, past the all-reduce's own bytes in every rank's symmetric buffer."""

    data_ptrs: torch.Tensor  # int64 [world, 3]: the address of each rank's three regions
    regions: torch.Tensor  # uint8: this rank's three regions (emptied by prepare_fused_norm)
    epochs: torch.Tensor  # int32 [max_rows]: the region each row's next call uses
    slot_bytes: int  # one rank's rows in one region
    max_rows: int
    kernel: Callable[..., torch.Tensor]

    @staticmethod
    def extra_bytes(slot_bytes: int, world_size: int) -> int:
        return _REGIONS * world_size * slot_bytes

    @classmethod
    def create(
        cls, buffer_ptrs: list[int], offset: int, slot_bytes: int, regions: torch.Tensor, max_rows: int
    ) -> FusedNormBuffers:
        """`offset`: where the regions start in every rank's buffer; `regions`: this rank's, which hold
        rows only after prepare_fused_norm; `max_rows`: the same on every rank (see fused_max_rows)."""
        from tp_runtime.layers.allreduce_norm_triton import allreduce_add_rms_norm

        device = regions.device
        region_bytes = len(buffer_ptrs) * slot_bytes
        data = [[base + offset + r * region_bytes for r in range(_REGIONS)] for base in buffer_ptrs]
        return cls(
            data_ptrs=torch.tensor(data, dtype=torch.int64, device=device),
            regions=regions,
            epochs=torch.zeros(max_rows, dtype=torch.int32, device=device),
            slot_bytes=slot_bytes,
            max_rows=max_rows,
            kernel=allreduce_add_rms_norm,
        )


def fused_max_rows(device: torch.device, group: dist.ProcessGroup | None) -> int:
    """The most rows the fused kernel takes: the fewest SMs of any rank's GPU (collective), so every
    rank declines the same messages and each grid is resident at once."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    t = torch.tensor([min(FUSED_NORM_MAX_ROWS, sms)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def _aligned(nbytes: int) -> int:
    return max(_BUFFER_ALIGN, -(-nbytes // _BUFFER_ALIGN) * _BUFFER_ALIGN)


class SymmMemAllReduce(AllReduce):
    """All-reduce through one symmetric buffer for small messages, `fallback` (NCCL) for the rest.

    Per call (no host sync; no allocation unless x is non-contiguous or not 16-byte aligned): copy `x`
    into the buffer's first bytes (viewed as x's dtype and shape; fused into the one-shot kernel), then
    a torch.ops.symm_mem kernel reduces every rank's buffer into `x`, which is returned.

    Reusing the one buffer for consecutive all-reduces on a stream is safe: torch's one-shot kernel
    (one_shot_all_reduce_kernel in CUDASymmetricMemoryOps.cu) starts with a barrier over the signal pads
    (every peer's copy into its buffer is visible before anyone reads it) and ENDS with another
    (`__syncthreads(); sync_remote_blocks`): block b of a rank leaves only after block b of every peer
    has finished reading, and blocks read the same offsets on every rank, so when the kernel has
    finished on a rank no peer still reads that rank's buffer, and the next stream-ordered copy into it
    cannot race with the current reduction. The two-shot kernels end with the same barrier. A
    signal-pad slot is only set again once its owner has consumed the last signal, so consecutive
    kernels (of any grid size) cannot confuse their barriers. Hence one buffer, not two alternating.
    """

    name = "symm_mem"

    def __init__(
        self,
        buffer: torch.Tensor,
        group_name: str,
        world_size: int,
        fallback: AllReduce,
        ops: SymmMemOps,
        *,
        one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES,
        two_shot_max_bytes: int = TWO_SHOT_MAX_BYTES,
        handle: Any = None,
        fused_norm: FusedNormBuffers | None = None,
        rank: int = 0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError("internal: the symmetric buffer must be a 1-d uint8 tensor")
        if not ops.has_one_shot and not ops.has_two_shot:
            raise ValueError("torch.ops.symm_mem has no one-shot or two-shot all-reduce")
        self.buffer = buffer
        self.capacity_bytes = buffer.numel()
        self.group_name = group_name
        self.world_size = world_size
        self.fallback = fallback
        self.ops = ops
        self.one_shot_max_bytes = one_shot_max_bytes
        self.two_shot_max_bytes = two_shot_max_bytes
        self._handle = handle  # keeps the rendezvous (peer mappings) alive with the buffer
        self.fused_norm = fused_norm
        self.rank = rank  # this rank's index among the buffers (the group rank)
        self.group = group
        # The dtype the fused path's regions were emptied for (None: not prepared), and the row width
        # of its first call: rows keep their bytes only in one layout (prepare_fused_norm starts another).
        self._fused_dtype: torch.dtype | None = None
        self._fused_width: int | None = None
        # The two-shot "out" kernel exists for these world sizes only; others reduce in place + copy.
        self._two_shot_out_ok = ops.two_shot_out is not None and world_size in (2, 4, 8)
        self._flat = {dt: buffer.view(dt) for dt in SYMM_MEM_DTYPES}
        # Views of the buffer's head shaped like a message, by (dtype, shape): saves the host a slice
        # and a view per call. Bounded: eager prefill brings many shapes.
        self._views: dict[tuple[torch.dtype, torch.Size], torch.Tensor] = {}

    # -- set-up -------------------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        device: torch.device,
        max_message_bytes: int,
        group: dist.ProcessGroup | None = None,
        *,
        fallback: AllReduce | None = None,
        one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES,
        two_shot_max_bytes: int = TWO_SHOT_MAX_BYTES,
    ) -> SymmMemAllReduce:
        """Allocate the buffer and exchange it with the peers (collective: every rank calls it), then
        check one all-reduce of known values. Raises on any failure."""
        disable_nvlink_multicast()
        symm_mem = _import_symm_mem()
        ops = detect_symm_mem_ops()
        pg = group if group is not None else dist.group.WORLD
        if pg is None:
            raise RuntimeError("the default process group is not initialised")
        group_name = str(pg.group_name)
        world_size = dist.get_world_size(pg)
        capacity = _aligned(min(max_message_bytes, MAX_SYMM_BUFFER_BYTES))
        # Past the all-reduce's bytes: the fused all-reduce + add + RMSNorm's, where Triton can run.
        fuse = _triton_available()
        extra = FusedNormBuffers.extra_bytes(capacity, world_size) if fuse else 0
        # Older torch needs the group registered first; newer torch deprecates the call (harmless).
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        is_enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
        if enable is not None and (is_enabled is None or not is_enabled(group_name)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(group_name)
        whole = symm_mem.empty(capacity + extra, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(whole, group_name)
        fused_norm = None
        if fuse:
            ptrs, max_rows = list(handle.buffer_ptrs), fused_max_rows(device, pg)
            fused_norm = FusedNormBuffers.create(ptrs, capacity, capacity, whole[capacity:], max_rows)
        impl = cls(
            whole[:capacity],
            group_name,
            world_size,
            fallback if fallback is not None else DistAllReduce(group),
            ops,
            one_shot_max_bytes=one_shot_max_bytes,
            two_shot_max_bytes=two_shot_max_bytes,
            handle=handle,
            fused_norm=fused_norm,
            rank=dist.get_rank(pg),
            group=pg,
        )
        impl.self_test(dist.get_rank(pg))
        impl.enable_fused_norm(torch.float32)
        return impl

    def self_test(self, rank: int) -> None:
        """One all-reduce of each available kind on exactly representable values; raises if a sum is
        wrong. Host-synchronising: start-up only."""
        n = 1024
        expected = float(sum(range(1, self.world_size + 1)))
        device = self.buffer.device
        methods = [
            m for m, ok in ((ONE_SHOT, self.ops.has_one_shot), (TWO_SHOT, self.ops.has_two_shot)) if ok
        ]
        for method in methods:
            x = torch.full((n,), float(rank + 1), dtype=torch.float32, device=device)
            y = self.run_method(method, x)
            got = y.cpu()
            if not torch.equal(got, torch.full((n,), expected, dtype=torch.float32)):
                raise RuntimeError(
                    f"symmetric-memory {method} all-reduce self-test gave {got[:4].tolist()}..., "
                    f"expected {expected}"
                )

    def enable_fused_norm(self, dtype: torch.dtype) -> bool:
        """Check the fused all-reduce + add + RMSNorm in `dtype` and leave it prepared for `dtype`, or, if
        any rank's check fails, drop the fusion on every rank (the plain symmetric-memory all-reduce still
        serves). Collective. Returns whether it is enabled."""
        if self.fused_norm is None:
            return False
        problem = self._fused_self_test_problem(dtype)
        if not _all_ranks_ok(problem is None, self.group):
            logger.warning("fused all-reduce + add + RMSNorm disabled: %s", problem or "failed on a peer")
            self.fused_norm = None
            return False
        self.prepare_fused_norm(dtype)
        return True

    def _fused_self_test_problem(self, dtype: torch.dtype) -> str | None:
        """Run the fused kernel on known values in `dtype`; what went wrong, or None. Every call runs on
        every rank whatever the results (a rank that stopped early would leave its peers waiting for its
        rows). Rows of 64 (sized to fit the smallest slot); row counts 3, 2, 3, 3 use every region and
        rows whose call counts differ."""
        f = self.fused_norm
        assert f is not None
        n, device = 64, self.buffer.device
        expected = float(sum(range(1, self.world_size + 1)))
        most = max(1, min(3, f.max_rows, f.slot_bytes // (n * dtype.itemsize)))
        problems: list[str] = []
        try:
            self.prepare_fused_norm(dtype)
            for rows in (most, max(1, most - 1), most, most):
                x = torch.full((rows, n), float(self.rank + 1), dtype=dtype, device=device)
                weight = torch.linspace(0.5, 2.0, n, dtype=torch.float32, device=device).to(dtype)
                residual = torch.ones_like(x)
                out = self.add_rms_norm(x, residual, weight, 1e-6)
                summed = torch.full((rows, n), expected + 1.0, dtype=torch.float32, device=device)
                normed = (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
                want = (weight.float() * normed.float()).to(dtype)
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                close = out is not None and torch.allclose(out.float(), want.float(), rtol=tol, atol=tol)
                if not close or not torch.equal(residual.float(), summed):
                    problems.append(f"its self-test in {dtype} gave a wrong result")
        except Exception as exc:  # a Triton compile error, say: fall back to the unfused path
            problems.append(f"{type(exc).__name__}: {exc}")
        return problems[0] if problems else None

    def prepare_fused_norm(self, dtype: torch.dtype) -> None:
        """Empty every region for rows of `dtype` and restart the call counts (collective: every rank calls
        it, between the same two fused calls). The fused path then takes `dtype` and the row width of its
        first call, and declines any other layout until the next prepare."""
        f = self.fused_norm
        if f is None:
            return
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"the fused all-reduce + add + RMSNorm has no {dtype}")
        self._synchronize_ranks()  # no rank is still inside a fused call
        usable = f.regions.numel() // dtype.itemsize * dtype.itemsize
        f.regions[:usable].view(dtype).fill_(-0.0)
        f.epochs.zero_()
        self._fused_dtype, self._fused_width = dtype, None
        self._synchronize_ranks()  # every region is empty before any rank sends a row

    def _synchronize_ranks(self) -> None:
        if self.buffer.device.type == "cuda":
            torch.cuda.synchronize(self.buffer.device)
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier(group=self.group)

    # -- per call -----------------------------------------------------------------------------------------

    def method_for(self, x: torch.Tensor) -> str:
        return select_method(
            x.numel() * x.element_size(),
            x.dtype,
            self.capacity_bytes,
            one_shot_max_bytes=self.one_shot_max_bytes,
            two_shot_max_bytes=self.two_shot_max_bytes,
            has_one_shot=self.ops.has_one_shot,
            has_two_shot=self.ops.has_two_shot,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run_method(self.method_for(x), x)

    def run_method(self, method: str, x: torch.Tensor) -> torch.Tensor:
        """All-reduce `x` by `method` (ONE_SHOT, TWO_SHOT or NCCL), whatever its size would pick. The
        symmetric methods need a float32/bfloat16 message that fits the buffer (benchmarks force them)."""
        if method == NCCL:
            return self.fallback(x)
        if x.dtype not in self._flat:
            raise ValueError(f"symmetric-memory all-reduce does not support {x.dtype}")
        nbytes = x.numel() * x.element_size()
        if nbytes > self.capacity_bytes:
            raise ValueError(
                f"message of {nbytes} bytes exceeds the symmetric buffer ({self.capacity_bytes})"
            )
        if x.numel() == 0:
            return x
        if not x.is_contiguous() or not _aligned16(x):
            # The kernels store 16 bytes at a time into their output (x): give them an aligned one.
            x = x.clone(memory_format=torch.contiguous_format)
        key = (x.dtype, x.shape)
        symm = self._views.get(key)
        if symm is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()
            symm = self._views[key] = self._flat[x.dtype][: x.numel()].view(x.shape)
        if method == ONE_SHOT:
            return self._one_shot(symm, x)
        if method == TWO_SHOT:
            return self._two_shot(symm, x)
        raise ValueError(f"unknown all-reduce method {method!r}")

    def _one_shot(self, symm: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        # The fused kernel copies x into the buffer itself (saves a launch; but it copies with the
        # reduction's few blocks, slower than a copy kernel for large messages). Writing the sum back
        # into x is safe: each thread reads its elements of x (copy phase) before it writes the same
        # elements (reduce phase).
        fused_ok = x.numel() * x.element_size() <= ONE_SHOT_FUSED_COPY_MAX_BYTES or ops.one_shot_out is None
        if ops.one_shot_copy_out is not None and fused_ok:
            ops.one_shot_copy_out(symm, x, "sum", self.group_name, x)
            return x
        if ops.one_shot_out is None:
            raise RuntimeError("internal: no one-shot all-reduce for this tensor")
        symm.copy_(x)
        ops.one_shot_out(symm, "sum", self.group_name, x)
        return x

    def _two_shot(self, symm: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        symm.copy_(x)
        if self._two_shot_out_ok:
            assert ops.two_shot_out is not None
            ops.two_shot_out(symm, "sum", self.group_name, x)
            return x
        if ops.two_shot_inplace is None:
            raise RuntimeError("internal: no two-shot all-reduce for this tensor")
        ops.two_shot_inplace(symm, "sum", self.group_name)
        x.copy_(symm)
        return x

    @property
    def fuses_add_rms_norm(self) -> bool:
        return self.fused_norm is not None

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor | None:
        f = self.fused_norm
        if (
            f is None
            or x.dtype != self._fused_dtype
            or x.dim() != 2
            or x.shape[0] > f.max_rows
            or x.numel() * x.element_size() > f.slot_bytes
            or residual.shape != x.shape
            or x.stride(1) != 1
            or residual.stride(1) != 1
        ):
            return None
        if self._fused_width is None:
            self._fused_width = x.shape[1]
        elif x.shape[1] != self._fused_width:
            return None
        return f.kernel(
            x, residual, weight, eps, rank=self.rank, world_size=self.world_size, data_ptrs=f.data_ptrs,
            slot_elems=f.slot_bytes // x.element_size(), epochs=f.epochs,
        )  # fmt: skip

    def describe(self) -> str:
        one = f"one-shot <= {self.one_shot_max_bytes}" if self.ops.has_one_shot else "no one-shot"
        two = (
            f"two-shot <= {self.two_shot_max_bytes}"
            if self.ops.has_two_shot and self.two_shot_max_bytes > self.one_shot_max_bytes
            else "no two-shot"
        )
        fused = "; fused all-reduce + add + RMSNorm" if self.fused_norm is not None else ""
        return (
            f"symm_mem ({one} B, {two} B, buffer {self.capacity_bytes} B, "
            f"float32/bfloat16; else {self.fallback.name}{fused})"
        )

    def close(self) -> None:
        self._flat.clear()
        self._views.clear()
        self.fused_norm = None
        self._handle = None


# ---------------------------------------------------------------------------------------------------------
# Choosing a strategy at start-up
# ---------------------------------------------------------------------------------------------------------


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _local_symm_mem_problem(device: torch.device) -> str | None:
    """Why this rank cannot use symmetric memory (None: it can, as far as it can tell alone)."""
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if not torch.cuda.is_available():
        return "CUDA is unavailable"
    try:
        _import_symm_mem()
    except Exception as e:
        return f"cannot import torch.distributed._symmetric_memory ({type(e).__name__}: {e})"
    ops = detect_symm_mem_ops()
    if not ops.has_one_shot and not ops.has_two_shot:
        return "torch.ops.symm_mem has no one-shot or two-shot all-reduce"
    return None


def _device_identity(device: torch.device) -> tuple[str, str | None, int | None]:
    """(host, GPU uuid, local index) of this rank's GPU, for peers to check they can reach it."""
    index: int | None = None
    uuid: str | None = None
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
        except Exception:
            uuid = None
    return socket.gethostname(), uuid, index


def _peer_problem(
    me: int, identities: list[tuple[str, str | None, int | None]], can_access: Callable[[int, int], bool]
) -> str | None:
    """Whether this rank's GPU can read every peer's GPU directly (same host, visible, P2P-capable)."""
    host, _, my_index = identities[me]
    if my_index is None:
        return "no local GPU index"
    local_by_uuid: dict[str, int] = {}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            try:
                local_by_uuid[str(torch.cuda.get_device_properties(i).uuid)] = i
            except Exception:
                continue
    for peer, (peer_host, peer_uuid, peer_index) in enumerate(identities):
        if peer == me:
            continue
        if peer_host != host:
            return f"rank {peer} is on another host ({peer_host})"
        index = local_by_uuid.get(peer_uuid) if peer_uuid is not None else peer_index
        if index is None:
            return f"rank {peer}'s GPU is not visible to this process"
        if index == my_index:
            return f"rank {peer} shares this rank's GPU"
        if not can_access(my_index, index):
            return f"GPU {my_index} cannot access peer GPU {index} (no P2P)"
    return None


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_ranks_ok(ok: bool, group: dist.ProcessGroup | None) -> bool:
    """Agreement (collective): True only if every rank says ok, so all ranks take the same strategy."""
    t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(int(t.item()))


def _probe_symm_mem(
    device: torch.device,
    max_message_bytes: int,
    group: dist.ProcessGroup | None,
    fallback: AllReduce,
    create: Callable[..., SymmMemAllReduce] | None = None,
) -> tuple[SymmMemAllReduce | None, str | None]:
    """Collective: (the symmetric-memory strategy, None) if every rank can set it up, else (None, why).
    Every rank returns the same kind of answer."""
    problem = _local_symm_mem_problem(device)
    identities: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(identities, _device_identity(device), group=group)
    if problem is None:
        problem = _peer_problem(
            dist.get_rank(group), identities, lambda a, b: bool(torch.cuda.can_device_access_peer(a, b))
        )
    if not _all_ranks_ok(problem is None, group):
        return None, problem or "a peer rank cannot use symmetric memory"
    make = create if create is not None else SymmMemAllReduce.create
    impl: SymmMemAllReduce | None = None
    try:
        impl = make(device, max_message_bytes, group, fallback=fallback)
    except Exception as e:
        problem = f"set-up failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if not _all_ranks_ok(impl is not None, group):
        if impl is not None:
            impl.close()
        return None, problem or "set-up failed on a peer rank"
    return impl, None


def make_all_reduce(
    world_size: int,
    device: torch.device,
    *,
    strategy: str = "auto",
    max_message_bytes: int = 0,
    group: dist.ProcessGroup | None = None,
) -> AllReduce:
    """Choose the all-reduce once at start-up. Collective when it probes symmetric memory (strategy
    "auto" or "symm_mem", CUDA, world size > 1, max_message_bytes > 0): every rank must call it.

    strategy: "auto" (symmetric memory if every rank can use it, else torch.distributed), "nccl"
    (torch.distributed only: NCCL on GPU, gloo on CPU) or "symm_mem" (raise if unavailable).
    max_message_bytes: the largest message to reduce through symmetric memory (the all-reduce's part of
    the buffer, capped at MAX_SYMM_BUFFER_BYTES; with the fused all-reduce + add + RMSNorm the buffer is
    1 + 3 * world_size times that), e.g. max_num_seqs * hidden_size * dtype size; 0 disables it.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"all-reduce strategy must be one of {STRATEGIES}, got {strategy!r}")
    if world_size == 1:
        return IdentityAllReduce()
    fallback = DistAllReduce(group)
    if strategy == "nccl":
        return fallback
    if device.type != "cuda" or max_message_bytes <= 0:
        if strategy == "symm_mem":
            raise RuntimeError(
                f"symmetric-memory all-reduce needs a CUDA device and max_message_bytes > 0 "
                f"(device {device}, max_message_bytes {max_message_bytes})"
            )
        return fallback
    impl, problem = _probe_symm_mem(device, max_message_bytes, group, fallback)
    if impl is None:
        if strategy == "symm_mem":
            raise RuntimeError(f"symmetric-memory all-reduce unavailable: {problem}")
        logger.warning("symmetric-memory all-reduce unavailable, using %s: %s", fallback.name, problem)
        return fallback
    logger.info("all-reduce: %s", impl.describe())
    return impl


# ---------------------------------------------------------------------------------------------------------
# The group
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    # The all-reduce strategy (chosen once by make_all_reduce). None: identity for world size 1, else
    # torch.distributed.all_reduce on the default group.
    all_reduce_strategy: AllReduce | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.all_reduce_strategy is None:
            default = IdentityAllReduce() if self.world_size == 1 else DistAllReduce()
            object.__setattr__(self, "all_reduce_strategy", default)

    @property
    def strategy(self) -> AllReduce:
        s = self.all_reduce_strategy
        assert s is not None  # set in __post_init__
        return s

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks. May reduce x in place or return a new tensor: use the result."""
        return self.strategy(x)

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
        return self.all_reduce_min_ints([value], device)[0]

    def all_reduce_min_ints(self, values: list[int], device: torch.device) -> list[int]:
        """The smallest of each value over the ranks (every rank passes as many)."""
        if self.world_size == 1 or not values:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return [int(v) for v in t.tolist()]

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


# The process groups this process has joined: every rank of a program joins them in the same order.
_GROUPS_JOINED = itertools.count()


def init_process_group(
    backend: str,
    init_method: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    device: torch.device,
    *,
    all_reduce_strategy: str = "auto",
    max_message_bytes: int = 0,
    model_dtype: torch.dtype | None = None,
    join_timeout_s: float | None = None,
) -> TPGroup:
    """Join the process group and choose the all-reduce (see make_all_reduce; collective on CUDA). With
    `model_dtype`, a strategy that fuses the all-reduce with the RMSNorm after it is prepared for it.
    `timeout_s`: the collectives'; `join_timeout_s` (default the same): how long joining waits for every
    rank (the store's waits)."""
    if all_reduce_strategy not in STRATEGIES:
        raise ValueError(f"all-reduce strategy must be one of {STRATEGIES}, got {all_reduce_strategy!r}")
    disable_nvlink_multicast()
    kwargs = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    timeout = timedelta(seconds=timeout_s)
    join_timeout = timedelta(seconds=timeout_s if join_timeout_s is None else join_timeout_s)
    store, _, _ = next(dist.rendezvous(init_method, rank=rank, world_size=world_size, timeout=join_timeout))
    # A torchrun program may start engines one after another, each joining a group through the same store
    # (torchrun's): under a prefix of their own, the ranks of the next group do not read the addresses
    # the last one left there (torch names every default group alike).
    store = dist.PrefixStore(f"tp_runtime/{next(_GROUPS_JOINED)}/", store)
    # Every rank checks in and waits for the others for the join's own time: gloo's and NCCL's joins wait
    # for the collectives' timeout and then fail inside torch.
    store.set(f"joined/{rank}", "1")
    try:
        store.wait([f"joined/{r}" for r in range(world_size)], join_timeout)
    except dist.DistStoreError as exc:
        missing = [r for r in range(world_size) if not store.check([f"joined/{r}"])]
        raise TPRuntimeError(
            f"rank {rank}: ranks {missing} of {world_size} did not join the process group within "
            f"{join_timeout.total_seconds():g} s (startup_timeout_s). Under torchrun every rank runs the "
            "program: rank 0 makes the LLM, every other rank calls run_torchrun_worker(model, **the same "
            "options)"
        ) from exc
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        **kwargs,  # type: ignore[arg-type]
    )
    strategy = make_all_reduce(
        world_size, device, strategy=all_reduce_strategy, max_message_bytes=max_message_bytes
    )
    if model_dtype is not None and isinstance(strategy, SymmMemAllReduce):
        strategy.enable_fused_norm(model_dtype)
    return TPGroup(rank=rank, world_size=world_size, all_reduce_strategy=strategy)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
