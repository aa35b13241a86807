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

from tp_runtime.layers import pdl, skinny_gemm_triton

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


def _statements(kernel: JITFunction) -> list[ast.stmt]:
    body = ast.parse(inspect.cleandoc("\n" + kernel.src) if kernel.src[0].isspace() else kernel.src)
    statements: list[ast.stmt] = body.body[0].body  # type: ignore[attr-defined]
    if isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant):
        statements = statements[1:]  # the docstring
    return statements


def _is_call(statement: ast.stmt, text: str) -> bool:
    return (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Call)
        and (ast.unparse(statement.value) == text)
    )


def test_every_kernel_launched_with_pdl_waits_before_touching_what_kernels_write() -> None:
    """It starts with release_and_wait(PDL), or with release_dependents(PDL) and then, up to
    wait_for_previous(PDL), reads only its weight (`w_ptr`, which no kernel of a step writes): the only
    calls there are index arithmetic and the weight-tile load (itself load-only), no other pointer is
    touched and no program returns before it has waited for the kernel before it."""
    kernels = _kernels_with_pdl()
    assert len(kernels) >= 7, sorted(kernels)  # norm, rotary + cache, SiLU-mul, decode, combine, 2 matmuls
    prefetching = []
    for name, kernel in kernels.items():
        statements = _statements(kernel)
        if _is_call(statements[0], "release_and_wait(PDL)"):
            continue
        first = ast.unparse(statements[0])
        assert _is_call(statements[0], "release_dependents(PDL)"), f"{name} starts with {first!r}"
        waits = [i for i, st in enumerate(statements) if _is_call(st, "wait_for_previous(PDL)")]
        assert waits, f"{name} never calls wait_for_previous(PDL)"
        before = ast.Module(body=statements[1 : waits[0]], type_ignores=[])
        names = {node.id for node in ast.walk(before) if isinstance(node, ast.Name)}
        pointers = {arg for arg in kernel.arg_names if arg.endswith("_ptr")}
        assert "w_ptr" in pointers and not (names & pointers) - {"w_ptr"}, (
            f"{name} touches {sorted((names & pointers) - {'w_ptr'})} before waiting"
        )
        calls = {ast.unparse(node.func) for node in ast.walk(before) if isinstance(node, ast.Call)}
        allowed = {"tl.program_id", "tl.arange", "_load_w_tile"}
        assert calls <= allowed | {c for c in calls if c.endswith(".to")}, f"{name} calls {sorted(calls)}"
        assert not any(isinstance(node, ast.Return) for node in ast.walk(before)), f"{name} returns early"
        prefetching.append(name)
    loader_source = skinny_gemm_triton._load_w_tile.src
    assert "tl.load" in loader_source and "store" not in loader_source and "atomic" not in loader_source
    assert prefetching == ["tp_runtime.layers.skinny_gemm_triton._skinny_row_kernel"]


def test_off_where_there_is_no_hopper_gpu() -> None:
    assert not pdl.enabled(torch.zeros(1))  # CPU tensors (Triton's interpreter): plain launches
