"""The one-row Triton matmul (layers/skinny_gemm_triton.py) in Triton's interpreter against a float64
matmul, the Matmul objects the linear layers dispatch through, and the engine's batch-1 decode with the
Triton kernels against HF transformers (tests/test_triton_decode.py runs the engine with several rows)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import GEMMA2, hf_greedy, run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

KERNEL_VS_FLOAT64 = """
import torch
import torch.nn.functional as F
from tp_runtime.layers import fused_triton
from tp_runtime.layers.activation import silu_and_mul
from tp_runtime.layers.linear import TritonMatmul, decode_graph_pass
from tp_runtime.layers.skinny_gemm_triton import SkinnyConfig, few_rows_linear, skinny_linear
torch.manual_seed(0)
# Error bound: a few units of the dtype's last place of sum |x_i w_i| + |b| (the interpreter rounds
# float32 -> bfloat16/float16 toward zero where CUDA rounds to nearest, also inside the SiLU-mul).
TOL = {torch.float32: 1e-6, torch.bfloat16: 4 * 2 ** -8, torch.float16: 4 * 2 ** -11}
# (the last: x in the weight tile's layout, 16-column partial sums, as FP8 weights take it)
CONFIGS = [None, SkinnyConfig(4, 64, 4), SkinnyConfig(8, 32, 2, 2), SkinnyConfig(16, 128, 4),
           SkinnyConfig(4, 64, 4, 1, True, 16)]
checked = 0
for dtype in TOL:
    # (rows, N, K): N and K that the tiles divide and that they do not; K shorter than one tile
    for rows, n, k in ((1, 64, 256), (1, 37, 200), (2, 33, 130), (1, 5, 3), (3, 48, 96)):
        for silu in (False, True):
            # A bias with every other config, the other half of them for the next shape: each (dtype,
            # shape, SiLU) runs with and without one, each config too.
            for c, cfg in enumerate(CONFIGS):
                with_bias = (c + rows + n + silu) % 2 == 1
                x = torch.randn(rows, 2 * k if silu else k).to(dtype)
                w = (torch.randn(n, k) / k ** 0.5).to(dtype)
                b = torch.randn(n).to(dtype) if with_bias else None
                x_in = silu_and_mul(x.double()) if silu else x.double()
                if silu and dtype != torch.float32:  # the kernel rounds silu(g) and the product
                    x_in = silu_and_mul(x).double()
                want = x_in @ w.double().T + (b.double() if with_bias else 0)
                got = skinny_linear(x, w, b, silu_mul=silu, config=cfg)
                assert got.dtype == dtype and got.shape == (rows, n)
                scale = x_in.abs() @ w.double().abs().T + (b.double().abs() if with_bias else 0)
                err = ((got.double() - want).abs() / scale).max().item()
                assert err <= TOL[dtype], (dtype, rows, n, k, silu, with_bias, cfg, err)
                checked += 1
# No columns: zeros, or the bias (the kernel would read a first weight tile, so it is not launched).
b5 = torch.randn(5)
assert torch.equal(skinny_linear(torch.randn(2, 0), torch.randn(5, 0)), torch.zeros(2, 5))
assert torch.equal(skinny_linear(torch.randn(2, 0), torch.randn(5, 0), b5), b5.expand(2, 5))
# The few-rows kernel (tensor-core dot products). Not bfloat16 here: the interpreter's bfloat16 dot is
# wrong (scripts/check_skinny_gemm.py checks it on the GPU).
for dtype in (torch.float32, torch.float16):
    for rows, n, k in ((2, 64, 256), (5, 37, 200), (17, 33, 130), (32, 96, 512)):
        for cfg in (SkinnyConfig(16, 64, 4, 2), SkinnyConfig(32, 128, 4, 3)):
            for with_bias in (False, True):
                x, w = torch.randn(rows, k).to(dtype), (torch.randn(n, k) / k ** 0.5).to(dtype)
                b = torch.randn(n).to(dtype) if with_bias else None
                want = x.double() @ w.double().T + (b.double() if with_bias else 0)
                got = few_rows_linear(x, w, b, cfg)
                scale = x.double().abs() @ w.double().abs().T + (b.double().abs() if with_bias else 0)
                err = ((got.double() - want).abs() / scale).max().item()
                assert got.dtype == dtype and err <= TOL[dtype], (dtype, rows, n, k, cfg, with_bias, err)
                checked += 1
# The Matmul objects: one row through the one-row kernel; 2-32 rows of a 16-bit dtype through the
# few-rows kernel where few_rows_config picks it; the rest through cuBLAS (F.linear), bit for bit.
m = TritonMatmul(132, graphs_only=False)
w16, x16 = torch.randn(40, 4096).half(), torch.randn(4, 4096).half()
assert torch.equal(m.linear(x16, w16, None), few_rows_linear(x16, w16, None, SkinnyConfig(32, 256, 4, 4)))
x33 = torch.randn(33, 4096).half()
assert torch.equal(m.linear(x33, w16, None), F.linear(x33, w16))
assert torch.equal(m.linear(x16[:, :1000], w16[:, :1000], None), F.linear(x16[:, :1000], w16[:, :1000]))
assert torch.equal(m.linear(x16.float(), w16.float(), None), F.linear(x16.float(), w16.float()))
for dtype in (torch.float32, torch.bfloat16):
    w, b = torch.randn(24, 40).to(dtype), torch.randn(24).to(dtype)
    one, two = torch.randn(1, 40).to(dtype), torch.randn(2, 40).to(dtype)
    gate_up = torch.randn(1, 80).to(dtype)
    assert torch.equal(m.linear(one, w, b), skinny_linear(one, w, b))
    assert torch.equal(m.linear(two, w, b), F.linear(two, w, b))
    assert torch.equal(m.silu_mul_linear(gate_up, w, None), skinny_linear(gate_up, w, silu_mul=True))
# graphs_only (a GPU's choice): the kernels inside decode-graph passes only, cuBLAS elsewhere; the
# model-level pass reaches every layer's matmul.
on_gpu = TritonMatmul(132, graphs_only=True)
holder = torch.nn.Module()
holder.layer = torch.nn.Module()
holder.layer.matmul = on_gpu
one, gate_up = torch.randn(1, 2048).bfloat16(), torch.randn(1, 4096).bfloat16()
w = torch.randn(24, 2048).bfloat16()
assert torch.equal(on_gpu.linear(one, w, None), F.linear(one, w))
# (outside a graph pass the SiLU-mul is the fused SiLU-mul kernel, then cuBLAS)
assert torch.equal(on_gpu.silu_mul_linear(gate_up, w, None), F.linear(fused_triton.silu_and_mul(gate_up), w))
with decode_graph_pass(holder):
    assert torch.equal(on_gpu.linear(one, w, None), skinny_linear(one, w))
    assert torch.equal(on_gpu.silu_mul_linear(gate_up, w, None), skinny_linear(gate_up, w, silu_mul=True))
    assert not torch.equal(on_gpu.linear(one, w, None), F.linear(one, w))  # the kernel's own sum order
assert torch.equal(on_gpu.linear(one, w, None), F.linear(one, w))
# The LM head: the few-rows kernel for a vocabulary shard; a layer as wide is no LM head.
wide, x4 = torch.randn(32768, 64).half(), torch.randn(4, 64).half()
assert torch.equal(m.logits(x4, wide), few_rows_linear(x4, wide, None, SkinnyConfig(64, 128, 4, 3)))
assert torch.equal(m.linear(x4, wide, None), F.linear(x4, wide))
print("OK", checked)
"""


def test_kernel_matches_float64() -> None:
    status, checked = run_interpreted(KERNEL_VS_FLOAT64).split()
    assert status == "OK" and int(checked) == 3 * 5 * 2 * 5 + 2 * 4 * 2 * 2


def test_launch_shapes_and_argument_checks() -> None:
    from tp_runtime.layers.skinny_gemm_triton import SkinnyConfig, default_config

    for sms in (16, 78, 132):
        for n in (1, 3, 64, 1000, 4096, 6144, 12287, 12288, 128256, 262144):
            cfg = default_config(n, sms)
            assert cfg.block_n in (4, 8, 16) and cfg.block_k >= 256 and cfg.num_warps in (4, 8)
            assert -(-n // cfg.block_n) < 2**31  # programs along the grid's first axis
            # About 8 four-row programs per SM: a last wave under 80 % full doubles the rows per program.
            waves = -(-n // 4) / (8 * sms)
            if n < 12288:
                assert (cfg.block_n == 8) == (1 < waves < 1.8), (n, sms, cfg)
            assert not cfg.x_tile and cfg.group == 1  # 16-bit weights keep the kernel's first form
    # FP8 weights: 2 KB of each row per tile, x in the tile's layout, 16-column partial sums.
    for n, k, rows_per_tile in ((6144, 4096, 4), (4096, 4096, 4), (28672, 4096, 8), (4096, 14336, 16)):
        cfg = default_config(n, 132, k, weight_bytes=1)
        assert (cfg.block_n, cfg.block_k, cfg.x_tile, cfg.group) == (rows_per_tile, 2048, True, 16), (n, k)
    from tp_runtime.layers.skinny_gemm_triton import few_rows_config, few_rows_linear, skinny_linear

    bf16 = torch.bfloat16
    assert few_rows_config(1, 4096, 4096, bf16, 132) is None  # one row: the one-row kernel
    assert few_rows_config(33, 4096, 4096, bf16, 132) is None  # more than one tile of rows: cuBLAS
    assert few_rows_config(8, 4096, 4096, torch.float32, 132) is None  # no TF32 products
    assert few_rows_config(8, 28672, 4096, bf16, 132) is None  # merged gate/up: cuBLAS measured faster
    assert few_rows_config(8, 4096, 2048, bf16, 132) is None  # short K: as fast as cuBLAS
    assert few_rows_config(8, 4096, 14336, bf16, 132) == SkinnyConfig(32, 512, 4, 4)
    assert few_rows_config(32, 128256, 4096, torch.float16, 132, lm_head=True) == SkinnyConfig(64, 128, 4, 3)
    assert few_rows_config(32, 57344, 8192, bf16, 132) is None  # as wide as an LM head, but not one
    with pytest.raises(ValueError, match="does not fit"):
        skinny_linear(torch.zeros(1, 5), torch.zeros(4, 6))
    with pytest.raises(ValueError, match="at most 32 rows"):
        few_rows_linear(torch.zeros(33, 6), torch.zeros(4, 6), None, SkinnyConfig(16, 64, 4))
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(torch.zeros(1, 6), torch.zeros(4, 6), torch.zeros(5))


def test_fused_models_multiply_through_the_triton_matmul() -> None:
    from torch import nn

    from tp_runtime.layers.linear import TORCH_MATMUL, Matmul, TritonMatmul, use_matmul

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
            self.a.matmul = TORCH_MATMUL  # type: ignore[assignment]

    model = Two()
    triton_matmul = TritonMatmul(8, graphs_only=False)
    use_matmul(model, triton_matmul)
    assert model.a.matmul is triton_matmul and not isinstance(getattr(model.b, "matmul", None), Matmul)


def test_fused_model_matmuls_and_the_graph_pass(make_checkpoint: Callable[..., Path]) -> None:
    """A model built with the fused kernels gives every linear layer and its LM head one TritonMatmul; the
    decode-graph pass (nested too) switches it on for all of them; the LM head multiplies via `logits`."""
    from tp_runtime.config import build_model_config
    from tp_runtime.distributed import TPGroup
    from tp_runtime.layers.embedding import ParallelLMHead
    from tp_runtime.layers.linear import (
        ColumnParallelLinear,
        Matmul,
        RowParallelLinear,
        TritonMatmul,
        decode_graph_pass,
    )
    from tp_runtime.models.registry import model_class

    cfg = build_model_config(str(make_checkpoint("LlamaForCausalLM")), dtype="float32", device="cpu")
    model = model_class(cfg.architecture)(cfg, TPGroup(), torch.float32, torch.device("cpu"), fused=True)
    layer_types = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
    layers = [m for m in model.modules() if isinstance(m, layer_types)]
    assert len(layers) == 4 * cfg.num_layers + 1
    matmul = layers[0].matmul
    assert isinstance(matmul, TritonMatmul) and all(m.matmul is matmul for m in layers)
    matmul.graphs_only = True  # as on a GPU: the kernels only inside the pass
    with decode_graph_pass(model):
        with decode_graph_pass(model):
            assert matmul._in_graph_pass
        assert matmul._in_graph_pass
    assert not matmul._in_graph_pass
    plain = model_class(cfg.architecture)(cfg, TPGroup(), torch.float32, torch.device("cpu"))
    assert all(type(m.matmul) is Matmul for m in plain.modules() if isinstance(m, layer_types))

    class Spy(Matmul):
        calls = 0

        def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            Spy.calls += 1
            return super().logits(x, weight)

    plain.lm_head.matmul = Spy()
    plain.compute_logits(torch.randn(1, cfg.hidden_size))
    assert Spy.calls == 1


ONE_ROW_ENGINE = """
import json, sys
from tp_runtime import LLM, SamplingParams
with LLM(sys.argv[1], device="cpu", dtype="float32", attention_backend="triton", fused_kernels="triton",
         cuda_graphs=sys.argv[3]) as llm:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
            for p in json.loads(sys.argv[2])]
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


@pytest.mark.parametrize(
    ("arch", "graphs"),
    [("LlamaForCausalLM", "padded"), ("Qwen2ForCausalLM", "off"), ("Gemma2ForCausalLM", "padded")],
)
def test_batch_one_decode_with_triton_kernels_matches_hf(
    make_checkpoint: Callable[..., Path], arch: str, graphs: str
) -> None:
    """One sequence at a time: every decode step's matmuls (QKV with Qwen2's bias, the output projection,
    the down projection with the SiLU-mul folded in, the LM head) run the one-row kernel."""
    # Gemma 2 in the shared test shape (head_dim 32, windows, both soft-caps), not its 256-wide default heads
    model_dir = make_checkpoint(arch, **(GEMMA2 if arch == "Gemma2ForCausalLM" else {}))
    prompts = [[5, 9, 200], list(range(3, 30))]
    got = json.loads(run_interpreted(ONE_ROW_ENGINE, str(model_dir), json.dumps(prompts), graphs))
    # Gemma 2 against HF's eager attention (SDPA drops the soft-cap).
    attention = "eager" if arch == "Gemma2ForCausalLM" else None
    want = hf_greedy(model_dir, prompts, 8, attn_implementation=attention)
    assert got == want


FP8_VS_FLOAT64 = """
import torch
from tp_runtime.layers.activation import silu_and_mul
from tp_runtime.layers.quantization.fp8 import CudaFp8Kernels
from tp_runtime.layers.skinny_gemm_triton import SkinnyConfig, few_rows_linear, skinny_linear
torch.manual_seed(0)
checked = 0
# FP8 weights with per-row scales (one column) or per 16/32-column block scales, in the one-row and
# few-rows kernels, against float64 products of the weight times its scales. float32 x: the kernels'
# products are exact, so the bound is float32's.
for rows, n, k in ((1, 64, 256), (1, 37, 200), (3, 33, 130), (17, 48, 96)):
    for block_k in (0, 16, 32):
        for with_bias in (False, True):
            w = torch.randn(n, k).to(torch.float8_e4m3fn)
            cols = 1 if block_k == 0 else -(-k // block_k)
            scale = torch.rand(n, cols) + 0.5
            full = scale.double().repeat_interleave(block_k or k, 1)[:, :k]
            wd = w.double() * full
            b = torch.randn(n) if with_bias else None
            for silu in (False, True) if rows == 1 else (False,):
                x = torch.randn(rows, 2 * k if silu else k)
                x_in = silu_and_mul(x.double()) if silu else x.double()
                want = x_in @ wd.T + (b.double() if with_bias else 0)
                bound = x_in.abs() @ wd.abs().T + (b.double().abs() if with_bias else 0)
                if rows == 1:
                    for one_row in (SkinnyConfig(8, 64, 4), SkinnyConfig(4, 64, 4, 1, True, 16), None):
                        got = skinny_linear(x, w, b, silu_mul=silu, config=one_row, scale=scale,
                                            scale_block_k=block_k or k)
                        err = ((got.double() - want).abs() / bound).max().item()
                        assert err <= 1e-6, (rows, n, k, block_k, with_bias, silu, one_row, err)
                else:
                    got = few_rows_linear(x, w, b, SkinnyConfig(16, 64, 4, 2), scale=scale,
                                          scale_block_k=block_k or k)
                err = ((got.double() - want).abs() / bound).max().item()
                assert got.dtype == torch.float32 and err <= 1e-6, (rows, n, k, block_k, with_bias, silu, err)
                checked += 1
# The CUDA method's dispatch. One row: the weight-only kernel above (a 16-bit x; its weight converted in
# registers). Two rows or more (here 4 with the SiLU-mul, and 24): W8A8 through the Triton GEMM for
# per-row-scaled weights and 32-column blocks (the GEMM's own test below). What no W8A8 path takes
# (scale blocks narrower than an FP8 MMA's K) stays on the weight-only kernels to 32 rows; without the
# Triton GEMM (before Hopper) they take per-row-scaled weights to 16 rows.
from tp_runtime.layers.quantization import activation_quant_triton as aq
from tp_runtime.layers.quantization.fp8_gemm_triton import fp8_gemm
from tp_runtime.layers.skinny_gemm_triton import fp8_few_rows_config
kernels = CudaFp8Kernels(132)
w = torch.randn(64, 128).to(torch.float8_e4m3fn)
scale = torch.rand(64, 1) + 0.5
x1, x4 = torch.randn(1, 128).half(), torch.randn(4, 256).half()
want1 = skinny_linear(x1, w, scale=scale, scale_block_k=128)
assert torch.equal(kernels.linear(x1, w, scale, 128, None, False), want1)
# One row with the SiLU-mul: its own kernel, then the one-row kernel; the same values as the one-row
# kernel computing it inside (it rounds as the SiLU-mul kernel does).
g1 = torch.randn(1, 256).half()
h1 = silu_and_mul(g1, fused=True)
want_silu = skinny_linear(h1, w, scale=scale, scale_block_k=128)
assert torch.equal(kernels.linear(g1, w, scale, 128, None, True), want_silu)
assert torch.equal(skinny_linear(g1, w, silu_mul=True, scale=scale, scale_block_k=128), want_silu)
got = kernels.linear(x4, w, scale, 128, None, True)
h4 = silu_and_mul(x4, fused=True)
assert torch.equal(got, fp8_gemm(*aq.quantize_rows_fp8(h4), w, scale, 128, x4.dtype))
# (each activation rounded to e4m3 is within 2^-4 of itself, but for subnormals and the fp16 roundings)
wd = w.double() * scale.double()
want = silu_and_mul(x4.double()) @ wd.T
bound = silu_and_mul(x4.double()).abs() @ wd.abs().T
assert ((got.double() - want).abs() <= 2**-4 * bound + 1e-3 * want.abs().max()).all()
pre_hopper = CudaFp8Kernels(132, triton_gemm=False)
x4b = x4[:, :128].bfloat16().contiguous()
want = few_rows_linear(x4b, w, None, fp8_few_rows_config(64, 4, 132), scale=scale, scale_block_k=128)
assert torch.equal(pre_hopper.linear(x4b, w, scale, 128, None, False), want)
# Few tiles of a long K split in two, on the method's own lock buffer, which stays zeroed; without FP8
# tensor cores (before sm89) 24 rows stay weight-only.
engine = CudaFp8Kernels(132, device=torch.device("cpu"))
long_w = (torch.randn(64, 8192) * 0.05).to(torch.float8_e4m3fn)
x2 = torch.randn(2, 8192)
long_blocks = torch.rand(64, 256) + 0.5
for s, bk in ((scale, 8192), (long_blocks, 32)):
    full = s.double().repeat_interleave(bk, 1)[:, :8192]
    got = engine.linear(x2, long_w, s, bk, None, False).double()
    want = x2.double() @ (long_w.double() * full).T
    bound = x2.double().abs() @ (long_w.double() * full).abs().T
    assert ((got - want).abs() <= 2**-4 * bound + 1e-3 * want.abs().max()).all()
    assert not engine.split_k_locks.any()
from tp_runtime.layers.quantization import fp8_gemm_triton
assert fp8_gemm_triton.default_config(2, 64, 8192, False, 132).split_k == 2
no_fp8_mma = CudaFp8Kernels(132, fp8_mma=False)
x24 = torch.randn(24, 128)
few24 = fp8_few_rows_config(64, 24, 132)
want = few_rows_linear(x24.bfloat16(), w, None, few24, scale=scale, scale_block_k=128)
assert torch.equal(no_fp8_mma.linear(x24.bfloat16(), w, scale, 128, None, False), want)
narrow = torch.rand(64, 8) + 0.5
want = few_rows_linear(x24.half(), w, None, fp8_few_rows_config(64, 24, 132), scale=narrow, scale_block_k=16)
assert torch.equal(kernels.linear(x24.half(), w, narrow, 16, None, False), want)
blocks = torch.rand(64, 4) + 0.5
for x, s, bk in ((x24.half(), scale, 128), (x24.bfloat16(), scale, 128), (x24.bfloat16(), blocks, 32)):
    xq, xs = aq.quantize_rows_fp8(x) if bk == 128 else aq.quantize_groups_fp8(x, bk)
    assert torch.equal(kernels.linear(x, w, s, bk, None, False), fp8_gemm(xq, xs, w, s, bk, x.dtype))
# Under a bfloat16 x the few-rows kernel multiplies in float16, as exactly as float32 does (x and the e4m3
# weight convert exactly), with x clamped to float16's range rather than made infinite.
for dtype in (torch.bfloat16, torch.float16):
    xw = torch.randn(3, 128).to(dtype)
    got = few_rows_linear(xw, w, None, SkinnyConfig(64, 256, 4, 3), scale=scale, scale_block_k=128)
    want = xw.double() @ wd.T
    bound = xw.double().abs() @ wd.abs().T
    # one bfloat16 step: the interpreter rounds float32 to bfloat16 toward zero
    assert ((got.double() - want).abs() <= 2**-7 * want.abs() + 1e-6 * bound).all()
huge = torch.tensor([[1e5, -3e5, 1.0]]).bfloat16()
got = few_rows_linear(huge, w[:, :3], None, SkinnyConfig(16, 64, 4, 2), scale=scale, scale_block_k=3).double()
want = torch.tensor([[65504.0, -65504.0, 1.0]]).double() @ (w[:, :3].double() * scale.double()).T
assert torch.isfinite(got).all() and ((got - want).abs() <= 2**-7 * want.abs() + 1e-2).all()
try:
    skinny_linear(x1, w)
except ValueError as e:
    assert "without its scales" in str(e)
else:
    raise AssertionError("an FP8 weight without scales was accepted")
print("OK", checked)
"""


def test_fp8_kernels_match_float64() -> None:
    status, checked = run_interpreted(FP8_VS_FLOAT64).split()
    assert status == "OK" and int(checked) == 4 * 3 * 2 + 2 * 3 * 2


ACTIVATION_QUANT_VS_TORCH = """
import torch
from tp_runtime.config import FP8_E4M3_MAX
from tp_runtime.layers.quantization import activation_quant_triton as aq
torch.manual_seed(0)
checked = 0
# Rows of very different magnitudes (one all zero), K that the block divides and that it does not, a
# row stride wider than K; a program holds a row up to 32,768 columns, and past that splits it over
# programs of 2,048 columns (below 128 rows) or loops over it (from 128 rows). The interpreter rounds to
# e4m3 unlike CUDA, so the kernel writes its float32 values here: they and the scales must be the
# correctly rounded ones bit for bit (scripts/gpu_check.py checks the e4m3 bytes on a GPU).
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for rows, k, width in (
        (1, 4096, 4096), (3, 100, 100), (32, 1500, 1500), (5, 1, 1), (4, 2048, 2100), (3, 9000, 9001),
        (130, 40, 40), (128, 1500, 1600), (3, 33000, 33001), (128, 33000, 33000),
    ):  # fmt: skip
        if k > 32768 and dtype != torch.bfloat16:
            continue  # the split and looping paths once are enough
        x = (torch.randn(rows, width) * torch.logspace(-6, 3, rows)[:, None]).to(dtype)[:, :k]
        if rows > 2:
            x[1] = 0
        q32, scale = torch.empty(rows, k), torch.empty(rows, 1)
        aq._launch(x, q32, scale)
        q_ref, scale_ref = aq.quantize_rows_fp8_reference(x)
        assert torch.equal(scale, scale_ref), (dtype, rows, k, (scale - scale_ref).abs().max())
        assert torch.equal(q32, aq.fp8_scaled_reference(x)[0]), (dtype, rows, k)
        assert torch.equal(q32.to(torch.float8_e4m3fn).view(torch.uint8), q_ref.view(torch.uint8))
        checked += 1
# With silu_mul the kernel quantizes what the separate SiLU-mul kernel (tested against torch in
# test_triton_decode.py) would have written, bit for bit, from a row stride wider than 2K too.
from tp_runtime.layers.fused_triton import silu_and_mul
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    # (2, 20000): held whole in 16-bit, split over programs in float32 (registers).
    shapes = ((1, 4096), (3, 100), (32, 1500), (4, 2500), (130, 40), (128, 2500), (2, 20000), (2, 33000))
    for rows, k in shapes:
        if k > 32768 and dtype != torch.bfloat16:
            continue
        gate_up = torch.randn(rows, 2 * k + 6) * torch.logspace(-3, 1.5, rows)[:, None]
        gate_up = gate_up.to(dtype)[:, : 2 * k]
        h = silu_and_mul(gate_up)
        q32, scale = torch.empty(rows, k), torch.empty(rows, 1)
        aq._launch(gate_up, q32, scale, silu_mul=True)
        q_ref, scale_ref = aq.quantize_rows_fp8_reference(h)
        assert torch.equal(scale, scale_ref), (dtype, rows, k, (scale - scale_ref).abs().max())
        assert torch.equal(q32, aq.fp8_scaled_reference(h)[0]), (dtype, rows, k)
        checked += 1
# NaN and infinities propagate as in torch: a row holding one gets a NaN or infinite scale, NaN values,
# in every program of the row (a NaN in the row's last slice reaches its first).
for rows, k in ((4, 5000), (4, 40000)):  # a row in one program, and split over programs
    x = torch.randn(rows, k)
    x[0, k - 100], x[1, 3], x[2, 5] = float("nan"), float("inf"), -float("inf")
    q32, scale = torch.empty(rows, k), torch.empty(rows, 1)
    aq._launch(x, q32, scale)
    q_ref, scale_ref = aq.quantize_rows_fp8_reference(x)
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(q32, aq.fp8_scaled_reference(x)[0], rtol=0, atol=0, equal_nan=True)
    assert scale[0].isnan() and scale[1].isinf() and q32[0].isnan().all() and q32[1, 3].isnan()
for bad, silu_mul in (
    (torch.zeros(4), False), (torch.zeros(4, 8).t(), False), (torch.zeros(4, 8, dtype=torch.int32), False),
    (torch.zeros(4, 7), True),
):  # fmt: skip
    try:
        aq.quantize_rows_fp8(bad, silu_mul=silu_mul)
    except ValueError as e:
        assert "quantize_rows_fp8 takes" in str(e)
    else:
        raise AssertionError(f"{bad.shape} {bad.dtype} was accepted")
print("OK", checked)
"""


FP8_GEMM_VS_FLOAT64 = """
import torch
from tp_runtime.layers.quantization import activation_quant_triton as aq
from tp_runtime.layers.quantization.fp8_gemm_triton import Fp8GemmConfig, fp8_gemm
torch.manual_seed(0)
checked = 0
# The W8A8 GEMM on e4m3 operands (their products exact in float32), against float64 sums of the
# dequantized operands: per-row scales on both sides, or per 32/64/128-column block (the weight's scale
# repeated over its rows, x's per row and block). Sizes the tiles divide and do not, a K shorter than a
# tile and not a whole number of blocks, more rows than one token tile, a bias, a strided x; K split
# over programs (explicitly, and by the default shape for few tiles of a long K).
CONFIGS = [None, Fp8GemmConfig(16, 16, 32, 1, 1, 2, split_k=3), Fp8GemmConfig(32, 32, 64, 2, 2, 1)]
for rows, n, k in ((1, 64, 256), (17, 48, 96), (40, 33, 130), (5, 100, 512), (70, 20, 64), (3, 64, 2048)):
    for block_k in (0, 32, 64, 128):
        # A bias with every other config, alternating by shape and block: each shape and each config
        # runs with and without one.
        for c, cfg in enumerate(CONFIGS):
            with_bias = (c + rows + block_k // 32) % 2 == 1
            groups = 1 if block_k == 0 else -(-k // block_k)
            w = (torch.randn(n, k) * 40).to(torch.float8_e4m3fn)
            ws = torch.rand(n, groups) + 0.5
            xq = (torch.randn(rows, k + 3) * 40).to(torch.float8_e4m3fn)[:, :k]
            xs = torch.rand(rows, groups) + 0.5
            b = torch.randn(n) if with_bias else None
            cols = block_k or k
            wd = w.double() * ws.double().repeat_interleave(cols, 1)[:, :k]
            xd = xq.double() * xs.double().repeat_interleave(cols, 1)[:, :k]
            want = xd @ wd.T + (b.double() if with_bias else 0)
            bound = xd.abs() @ wd.abs().T + (b.double().abs() if with_bias else 0)
            # (the interpreter rounds to bfloat16 toward zero: a few units of its last place)
            for out_dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 4 * 2 ** -8)):
                got = fp8_gemm(xq, xs, w, ws, cols, out_dtype, b, cfg)
                assert got.dtype == out_dtype and got.shape == (rows, n)
                err = ((got.double() - want).abs() / bound).max().item()
                assert err <= tol, (rows, n, k, block_k, with_bias, cfg, out_dtype, err)
            checked += 1
empty = fp8_gemm(torch.empty(3, 0, dtype=torch.float8_e4m3fn), torch.ones(3, 1), torch.empty(
    5, 0, dtype=torch.float8_e4m3fn), torch.ones(5, 1), 1, torch.float32, torch.arange(5.0))
assert torch.equal(empty, torch.arange(5.0).expand(3, 5))
# Split-K leaves its locks zeroed for the next call, and its sums do not depend on which program ends last.
w = (torch.randn(40, 512) * 40).to(torch.float8_e4m3fn)
xq = (torch.randn(2, 512) * 40).to(torch.float8_e4m3fn)
split = Fp8GemmConfig(16, 16, 32, 1, 1, 2, split_k=5)
locks = torch.zeros(3, dtype=torch.int32)  # 40 rows in tiles of 16
first = fp8_gemm(xq, torch.ones(2, 1), w, torch.ones(40, 1), 512, torch.float32, None, split, locks=locks)
assert not locks.any()
again = fp8_gemm(xq, torch.ones(2, 1), w, torch.ones(40, 1), 512, torch.float32, None, split, locks=locks)
assert torch.equal(first, again) and not locks.any()
torch.testing.assert_close(first, xq.double().matmul(w.double().T).float(), rtol=1e-6, atol=1e-3)
w8 = torch.randn(8, 64).to(torch.float8_e4m3fn)
ones = torch.ones(40, 1)
for bad in (
    lambda: fp8_gemm(torch.randn(2, 64), torch.ones(2, 1), w8, torch.ones(8, 1), 64, torch.float32),
    lambda: fp8_gemm(w8[:2], torch.ones(2, 2), w8, torch.ones(8, 1), 64, torch.float32),
    lambda: fp8_gemm(w8[:2], torch.ones(2, 4), w8, torch.ones(8, 4), 16, torch.float32),
    lambda: fp8_gemm(w8[:2], torch.ones(2, 2), w8, torch.ones(8, 2), 48, torch.float32),
    lambda: fp8_gemm(w8[:2], torch.ones(2, 2), w8, torch.ones(2, 8).t(), 32, torch.float32),
    lambda: fp8_gemm(xq, ones[:2], w, ones, 512, torch.float32, None, split, 1, locks[:1]),
):
    try:
        bad()
    except ValueError as e:
        assert "fp8_gemm:" in str(e)
    else:
        raise AssertionError("a misfit fp8_gemm call was accepted")
print("OK", checked)
"""


def test_fp8_gemm_matches_float64() -> None:
    status, checked = run_interpreted(FP8_GEMM_VS_FLOAT64).split()
    assert status == "OK" and int(checked) == 6 * 4 * 3


GROUP_QUANT_VS_TORCH = """
import torch
from tp_runtime.config import FP8_E4M3_MAX
from tp_runtime.layers.quantization import activation_quant_triton as aq
torch.manual_seed(0)
checked = 0
# As the per-row test below, by groups of columns: groups of very different magnitudes (one all zero), K
# that the groups divide and that they do not (a short last group), more groups than one program holds.
for dtype in (torch.bfloat16, torch.float32):
    for rows, k, group in ((1, 4096, 128), (3, 100, 32), (2, 5000, 128), (4, 7, 16), (2, 300, 256)):
        groups = -(-k // group)
        x = (torch.randn(rows, k + 5) * torch.logspace(-6, 3, k + 5)).to(dtype)[:, :k]
        x[0, :group] = 0
        q32, scale = torch.empty(rows, k), torch.empty(rows, groups)
        aq._launch_groups(x, q32, scale, group)
        q_ref, scale_ref = aq.quantize_rows_fp8_reference(x, group)
        assert scale_ref.shape == (rows, groups)
        assert torch.equal(scale, scale_ref), (dtype, rows, k, group, (scale - scale_ref).abs().max())
        assert torch.equal(q32, aq.fp8_scaled_reference(x, group)[0]), (dtype, rows, k, group)
        assert torch.equal(q32.to(torch.float8_e4m3fn).view(torch.uint8), q_ref.view(torch.uint8))
        checked += 1
# silu_mul: the groups of what the separate SiLU-mul kernel would have written.
from tp_runtime.layers.fused_triton import silu_and_mul
for dtype in (torch.bfloat16, torch.float32):
    for rows, k, group in ((1, 4096, 128), (3, 100, 32), (2, 5000, 128)):
        groups = -(-k // group)
        gate_up = (torch.randn(rows, 2 * k) * torch.logspace(-3, 2, 2 * k)).to(dtype)
        h = silu_and_mul(gate_up)
        q32, scale = torch.empty(rows, k), torch.empty(rows, groups)
        aq._launch_groups(gate_up, q32, scale, group, silu_mul=True)
        q_ref, scale_ref = aq.quantize_rows_fp8_reference(h, group)
        assert torch.equal(scale, scale_ref), (dtype, rows, k, group)
        assert torch.equal(q32, aq.fp8_scaled_reference(h, group)[0]), (dtype, rows, k, group)
        checked += 1
# A NaN or an infinity reaches only its own group's scale and values.
x = torch.randn(2, 256)
x[0, 7], x[1, 200] = float("nan"), float("inf")
q32, scale = torch.empty(2, 256), torch.empty(2, 2)
aq._launch_groups(x, q32, scale, 128)
assert scale[0, 0].isnan() and scale[1, 1].isinf() and q32[0, :128].isnan().all() and q32[1, 200].isnan()
assert scale[0, 1].isfinite() and scale[1, 0].isfinite() and q32[0, 128:].isfinite().all()
for bad, group in ((torch.zeros(4, 8).t(), 4), (torch.zeros(4, 8), 3)):
    try:
        aq.quantize_groups_fp8(bad, group)
    except ValueError as e:
        assert "quantize_groups_fp8 takes" in str(e)
    else:
        raise AssertionError(f"{bad.shape} in groups of {group} was accepted")
print("OK", checked)
"""


def test_group_activation_quantization_matches_torch() -> None:
    status, checked = run_interpreted(GROUP_QUANT_VS_TORCH).split()
    assert status == "OK" and int(checked) == 2 * 5 + 2 * 3


def test_activation_quantization_matches_torch() -> None:
    status, checked = run_interpreted(ACTIVATION_QUANT_VS_TORCH).split()
    assert status == "OK" and int(checked) == 3 * 10 - 4 + 3 * 8 - 2


NORM_QUANT_VS_UNFUSED = """
import torch
from tp_runtime.config import FP8_E4M3_MAX
from tp_runtime.layers import fused_triton
from tp_runtime.layers.norm import GemmaRMSNorm, RMSNorm
from tp_runtime.layers.quantization import activation_quant_triton as aq
from tp_runtime.layers.quantization.fp8 import CudaFp8Kernels
torch.manual_seed(0)
checked = 0
# The add + RMSNorm kernel quantizing its own rows (the next W8A8 layer's input) writes the values and
# scales that quantizing the plain kernel's output would, and the same updated residual: Llama's and
# Gemma's norms, with and without a residual, widths a power of two and not, rows of very different
# magnitudes. (Float32 values: the interpreter's e4m3 rounding is not CUDA's; gpu_check.py checks
# the bytes on a GPU.)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for rows, cols in ((1, 64), (5, 100), (33, 4096)):
        for unit_offset in (False, True):
            for with_residual in (False, True):
                x = (torch.randn(rows, cols) * torch.logspace(-2, 2, rows)[:, None]).to(dtype)
                weight = (torch.randn(cols) * 0.5).to(dtype)
                res_a = torch.randn(rows, cols).to(dtype) if with_residual else None
                res_b = None if res_a is None else res_a.clone()
                h = fused_triton.rms_norm(x, weight, 1e-5, res_a, unit_offset=unit_offset)
                q_ref, scale_ref = aq.quantize_rows_fp8_reference(h)
                q32, scale = torch.empty(rows, cols), torch.empty(rows, 1)
                aq._launch_norm(x, weight, 1e-5, res_b, unit_offset, q32, scale)
                assert torch.equal(scale, scale_ref), (dtype, rows, cols, unit_offset, with_residual)
                assert torch.equal(q32, aq.fp8_scaled_reference(h)[0]), (dtype, rows, cols, unit_offset)
                assert res_a is None or torch.equal(res_a, res_b)
                checked += 1
# Through the FP8 method: a deferred norm (NormedInput) gives the bits of the norm's output passed as a
# tensor, at one row (weight-only: the norm computed plainly) and at 4 and 24 rows (W8A8 on the norm's own
# quantization), per-row scales; 128-column block scales take the plain norm then group quantization.
kernels = CudaFp8Kernels(132)
w = torch.randn(64, 128).to(torch.float8_e4m3fn)
for rows in (1, 4, 24):
    for s, bk in ((torch.rand(64, 1) + 0.5, 128), (torch.rand(64, 4) + 0.5, 32)):
        for cls in (RMSNorm, GemmaRMSNorm):
            norm = cls(128, 1e-6, torch.bfloat16, torch.device("cpu"), fused=True)
            norm.weight.data.copy_(torch.randn(128) * 0.3)
            x = torch.randn(rows, 128).bfloat16()
            res_a = torch.randn(rows, 128).bfloat16()
            res_b = res_a.clone()
            want = kernels.linear(norm(x, res_a), w, s, bk, None, False)
            got = kernels.linear(norm.deferred(x, res_b), w, s, bk, None, False)
            assert torch.equal(got, want) and torch.equal(res_a, res_b), (rows, bk, cls)
            checked += 1
print("OK", checked)
"""


def test_norm_quantizing_its_rows_matches_the_unfused_kernels() -> None:
    status, checked = run_interpreted(NORM_QUANT_VS_UNFUSED).split()
    assert status == "OK" and int(checked) == 3 * 3 * 2 * 2 + 3 * 2 * 2
