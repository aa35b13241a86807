"""Programmatic dependent launch (Hopper and later) for the Triton kernels of a decode step.

At small batch a decode step is a chain of a few hundred short kernels, each of which normally starts only
once the one before it has finished and its memory is flushed; the GPU idles for that gap, and a matmul's
first weight loads wait for it. Launched with `launch_pdl`, a kernel may start as soon as every program of
the kernel before it has called `griddepcontrol.launch_dependents`: its programs become resident, load what
no kernel of the step writes (a matmul's weights), and then wait in `griddepcontrol.wait` until that kernel
has completed.

Every kernel launched so keeps one rule: each of its programs calls `wait_for_previous` before it reads
anything an earlier kernel wrote and before it writes anything. So a kernel completes only after the one
before it has, and the chain's order holds as before through kernels launched without the attribute too
(torch's, which wait for everything before them as usual).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """Let the next kernel launch (its programs then wait in `wait_for_previous` for this one to end)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Wait until the kernel before this one has completed and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def release_and_wait(PDL: tl.constexpr):
    """Both, for a kernel with nothing to load before its inputs are ready."""
    release_dependents(PDL)
    wait_for_previous(PDL)


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9  # griddepcontrol: sm90 and later


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels on `t`'s device launch with programmatic dependent launch: CUDA devices of compute
    capability 9.0 or later (not Triton's interpreter, which runs on CPU tensors)."""
    if not t.is_cuda:
        return False
    return _device_supports(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_args(t: torch.Tensor) -> dict[str, bool]:
    """A kernel's `PDL` argument and Triton's `launch_pdl` option together, so the two always agree (a
    kernel launched with PDL must run its waits)."""
    on = enabled(t)
    return {"PDL": on, "launch_pdl": on}
