"""Programmatic dependent launch (layers/pdl.py): a kernel launched with it may start before the kernel
before it has finished, so each must wait for it before touching memory. The rule is checked on the kernels'
source here (no GPU runs them on CPU); on the GPU, scripts/gpu_check.py compares their results."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest
import torch

pytest.importorskip("triton")
from triton.runtime.jit import JITFunction

from tp_runtime.layers import pdl

MODULES = [
    "tp_runtime.layers.fused_triton",
    "tp_runtime.layers.paged_decode_triton",
    "tp_runtime.layers.skinny_gemm_triton",
    "tp_runtime.layers.allreduce_norm_triton",
    "tp_runtime.layers.quantization.activation_quant_triton",
    "tp_runtime.layers.quantization.fp8_gemm_triton",
    "tp_runtime.layers.quantization.fp8_moe_triton",
    "tp_runtime.worker.sampling_triton",
]


def _kernels_with_pdl() -> dict[str, JITFunction]:
    found = {}
    for name in MODULES:
        for attr, value in vars(importlib.import_module(name)).items():
            if isinstance(value, JITFunction) and "PDL" in value.arg_names and value.fn.__module__ == name:
                found[f"{name}.{attr}"] = value
    return found


def test_every_kernel_launched_with_pdl_waits_before_anything_else() -> None:
    """Its first statement (after the docstring) is release_and_wait(PDL): nothing is read or written
    before the kernel before it has completed."""
    kernels = _kernels_with_pdl()
    assert len(kernels) >= 7, sorted(kernels)  # norm, rotary + cache, SiLU-mul, decode, combine, 2 matmuls
    for name, kernel in kernels.items():
        body = ast.parse(inspect.cleandoc("\n" + kernel.src) if kernel.src[0].isspace() else kernel.src)
        statements = body.body[0].body  # type: ignore[attr-defined]
        if isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant):
            statements = statements[1:]  # the docstring
        first = statements[0]
        assert (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Call)
            and ast.unparse(first.value) == "release_and_wait(PDL)"
        ), f"{name} starts with {ast.unparse(first)!r}"


def test_off_where_there_is_no_hopper_gpu() -> None:
    assert not pdl.enabled(torch.zeros(1))  # CPU tensors (Triton's interpreter): plain launches
