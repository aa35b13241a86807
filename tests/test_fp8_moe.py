"""FP8 mixture-of-experts experts on the GPU path (layers/quantization/fp8_moe_triton.py and SparseMoE's
"fp8_grouped"), run in Triton's interpreter on CPU tensors: the grouped GEMM and the whole layer against
float64 sums of what they multiply (the CPU path, which multiplies by the dequantized experts, is
compared against transformers in tests/test_fp8.py)."""

from __future__ import annotations

from conftest import run_interpreted

GROUPED_GEMM_VS_FLOAT64 = """
import torch
from tp_runtime.layers.quantization.fp8_moe_triton import Fp8MoeConfig, fp8_moe_gemm, route_tiles
torch.manual_seed(0)
checked = 0
# (tokens, top-k, experts, N, K, scale block (0: per row), tokens per tile): one token; fewer pairs than
# experts; an expert with more pairs than a tile (40 tokens over 4 experts in tiles of 16); a K the tiles
# do not divide, and one shorter than a K tile; experts no pair chose; no tokens at all.
CASES = ((1, 2, 8, 64, 256, 0, None), (5, 2, 8, 48, 96, 32, None), (40, 2, 4, 33, 130, 0, 16),
         (3, 8, 16, 64, 128, 64, None), (70, 2, 4, 20, 64, 0, 16), (9, 1, 6, 16, 40, 0, 32),
         (0, 2, 4, 16, 64, 0, None))
for tokens, top_k, experts, n, k, block, block_m in CASES:
    for cfg in (None, Fp8MoeConfig(16, 32, 1, 1)):
        ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]) if tokens else (
            torch.empty(0, top_k, dtype=torch.long))
        if tokens > 8:
            ids[ids == experts - 1] = 0  # one expert idle
        tiles = route_tiles(ids, experts, block_m)
        groups, cols = (1, k) if block == 0 else (-(-k // block), block)
        w = (torch.randn(experts, n, k) * 40).to(torch.float8_e4m3fn)
        ws = torch.rand(experts, n, groups) + 0.5
        x = (torch.randn(tokens, k) * 40).to(torch.float8_e4m3fn)
        xs = torch.rand(tokens, groups) + 0.5
        wd = w.double() * ws.double().repeat_interleave(cols, 2)[:, :, :k]
        xd = x.double() * xs.double().repeat_interleave(cols, 1)[:, :k]
        flat = ids.flatten()
        want = torch.zeros(flat.numel(), n, dtype=torch.float64)
        bound = torch.zeros_like(want)
        for p in range(flat.numel()):
            want[p] = xd[p // top_k] @ wd[flat[p]].T
            bound[p] = xd[p // top_k].abs() @ wd[flat[p]].abs().T
        order = tiles.order.long()
        # Every pair once, grouped by expert, in pair order within an expert.
        assert sorted(order.tolist()) == list(range(flat.numel()))
        keys = [(int(flat[i]), int(i)) for i in order]
        assert keys == sorted(keys)
        # The gate/up side: rows gathered by token, output in sorted order.
        got = fp8_moe_gemm(x, xs, w, ws, cols, tiles, torch.float32, a_rows=tiles.order // top_k, config=cfg)
        assert got.shape == (flat.numel(), n)
        assert ((got.double() - want[order]).abs() <= 1e-6 * bound[order] + 1e-30).all(), (tokens, n, k)
        # The down side: rows in sorted order, output scattered back to (token, slot) order.
        xg, xsg = x[order // top_k].contiguous(), xs[order // top_k].contiguous()
        got = fp8_moe_gemm(xg, xsg, w, ws, cols, tiles, torch.bfloat16, out_rows=tiles.order, config=cfg)
        assert ((got.double() - want).abs() <= 4 * 2 ** -8 * bound + 1e-30).all(), (tokens, n, k)
        checked += 1
w8 = torch.randn(2, 8, 64).to(torch.float8_e4m3fn)
tiles = route_tiles(torch.tensor([[0], [1]]), 2)
f32 = torch.float32
# Not e4m3; scales of the wrong shape; blocks narrower than an MMA's K; fewer experts than the tiles';
# sorted-order rows that are not one per pair.
for bad in (
    lambda: fp8_moe_gemm(torch.randn(2, 64), torch.ones(2, 1), w8, torch.ones(2, 8, 1), 64, tiles, f32),
    lambda: fp8_moe_gemm(w8[0, :2], torch.ones(2, 1), w8, torch.ones(2, 8, 2), 32, tiles, f32),
    lambda: fp8_moe_gemm(w8[0, :2], torch.ones(2, 4), w8, torch.ones(2, 8, 4), 16, tiles, f32),
    lambda: fp8_moe_gemm(w8[0, :2], torch.ones(2, 1), w8[:1], torch.ones(1, 8, 1), 64, tiles, f32),
    lambda: fp8_moe_gemm(w8[0, :3], torch.ones(3, 1), w8, torch.ones(2, 8, 1), 64, tiles, f32),
):
    try:
        bad()
    except ValueError as e:
        assert "fp8_moe_gemm:" in str(e)
    else:
        raise AssertionError("a misfit fp8_moe_gemm call was accepted")
print("OK", checked)
"""


def test_grouped_fp8_gemm_matches_float64() -> None:
    status, checked = run_interpreted(GROUPED_GEMM_VS_FLOAT64).split()
    assert status == "OK" and int(checked) == 7 * 2


ROUTE_KERNEL_VS_TORCH = """
import random
import torch
from tp_runtime.layers.quantization.fp8_moe_triton import ROUTE_KERNEL_MAX_PAIRS, route_tiles
random.seed(0)
torch.manual_seed(0)
checked = 0
# The one-program tile schedule gives route_tiles' torch ops' tiles exactly: one expert or 256, top-1 to
# top-8, one token to the kernel's most pairs, spread or crowded onto a quarter of the experts, default
# and explicit tile heights (tiles past the real ones are marked by the expert count; their rows unused).
cases = [(1, 1, 1, None), (256, 8, ROUTE_KERNEL_MAX_PAIRS // 8, None), (8, 2, 1, 16), (3, 3, 5, 32)]
cases += [(random.choice([2, 8, 16, 60, 128]), random.randint(1, 4), random.randint(1, 200),
           random.choice([None, 16, 128])) for _ in range(12)]
for experts, top_k, tokens, block_m in cases:
    for crowded in (False, True):
        if crowded:
            ids = torch.randint(0, max(1, experts // 4), (tokens, top_k))
        else:
            ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
        want = route_tiles(ids, experts, block_m, kernel=False)
        got = route_tiles(ids, experts, block_m, kernel=True)
        assert got.block_m == want.block_m and torch.equal(got.order, want.order), (experts, top_k, tokens)
        assert torch.equal(got.expert_end, want.expert_end) and torch.equal(got.tile_expert, want.tile_expert)
        real = want.tile_expert < experts
        assert torch.equal(got.tile_row[real], want.tile_row[real])
        checked += 1
print("OK", checked)
"""


def test_route_kernel_matches_torch() -> None:
    status, checked = run_interpreted(ROUTE_KERNEL_VS_TORCH).split()
    assert status == "OK" and int(checked) == 16 * 2


LAYER_VS_FLOAT64 = """
import torch
import torch.nn.functional as F
from tp_runtime.config import QuantConfig
from tp_runtime.distributed import TPGroup
from tp_runtime.layers.moe import SparseMoE
from tp_runtime.layers.quantization import activation_quant_triton as aq
from tp_runtime.layers.quantization.fp8 import Fp8Kernels, Fp8LinearMethod
# The interpreter's e4m3 rounding is not CUDA's (activation_quant_triton.py's tests check the kernels on
# their own): the layer quantizes activations here with the torch reference, which rounds as CUDA does.
aq.quantize_rows_fp8 = aq.quantize_rows_fp8_reference
aq.quantize_groups_fp8 = aq.quantize_rows_fp8_reference
torch.manual_seed(0)
checked = 0
# The layer's FP8 grouped path against float64 sums of what it multiplies: each (token, expert) pair's
# activations rounded to e4m3 per token (or per token and block) and its expert's dequantized weights,
# weighted by the routing. Per-channel and 32x32 block scales (several blocks on both the hidden and the
# intermediate side), Mixtral's and Qwen3-MoE's routing, float32 and bfloat16, 1-40 tokens.
def qdq(a, group):
    q, s = aq.quantize_rows_fp8_reference(a.float(), group)
    return q.double() * s.double().repeat_interleave(group or a.shape[1], 1)[:, : a.shape[1]]
for scales, block in (("channel", None), ("block", (32, 32))):
    group = block[1] if block else None
    config = QuantConfig("compressed-tensors", scales, block)
    for dtype in (torch.float32, torch.bfloat16):
        for fp32_weights in (True, False):
            layer = SparseMoE(
                hidden_size=96, intermediate_size=64, num_experts=6, top_k=2, renormalize=fp32_weights,
                fp32_weights=fp32_weights, expert_names=("w1", "w3", "w2"), tp=TPGroup(), dtype=dtype,
                device=torch.device("cpu"), fused=False, impl="fp8_grouped",
                method=Fp8LinearMethod(config, Fp8Kernels()),
            )
            gen = torch.Generator().manual_seed(1)
            for name, param in layer.named_parameters():
                if param.dtype == torch.float8_e4m3fn:
                    param.data.copy_((torch.randn(param.shape, generator=gen) * 100).to(param.dtype))
                elif name.endswith("_scale"):
                    param.data.copy_(torch.rand(param.shape, generator=gen) * 1e-3 + 1e-4)
                else:
                    param.data.copy_(torch.randn(param.shape, generator=gen))
            assert layer.w13.dtype == torch.float8_e4m3fn
            if block:
                assert layer.w2_scale.shape == (6, 96, 2) and layer.w13_scale.shape == (6, 128, 3)
            w13 = layer.w13_stack.dequantized(torch.float64)
            w2 = layer.w2_stack.dequantized(torch.float64)
            for tokens in (1, 3, 40):
                x = torch.randn(tokens, 96, generator=gen).to(dtype)
                with torch.no_grad():
                    got = layer(x)
                    weights, ids = layer.route(x)
                assert got.dtype == dtype and got.shape == x.shape
                want = torch.zeros(tokens, 96, dtype=torch.float64)
                xd = qdq(x, group)
                for t in range(tokens):
                    for j in range(2):
                        e = ids[t, j]
                        gate_up = (xd[t] @ w13[e].T).float()
                        if dtype == torch.bfloat16:  # the interpreter rounds to bfloat16 toward zero
                            gate_up = (gate_up.view(torch.int32) & -65536).view(torch.float32)
                        gate, up = gate_up.to(dtype).chunk(2)
                        h = (F.silu(gate) * up)[None]
                        want[t] += (qdq(h, group)[0] @ w2[e].T) * weights[t, j].double()
                if dtype == torch.float32:
                    err = ((got.double() - want).norm(dim=1) / want.norm(dim=1)).max().item()
                    assert err < 1e-4, (scales, tokens, err)
                else:
                    # The output's rounding to bfloat16, and h's where float32 sums in another order
                    # round to another bfloat16 (and then to another e4m3 value).
                    err = ((got.double() - want).norm() / want.norm()).item()
                    assert err < 1e-2, (scales, tokens, err)
                checked += 1
print("OK", checked)
"""


def test_fp8_expert_layer_matches_float64() -> None:
    status, checked = run_interpreted(LAYER_VS_FLOAT64).split()
    assert status == "OK" and int(checked) == 2 * 2 * 2 * 3
