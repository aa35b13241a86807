"""Correctness of the CUDA paths on a GPU machine: the Triton attention kernels against brute force, and
greedy tokens of small random HF checkpoints on CUDA against HF transformers on the CPU (head_dim 12, 80,
96; GQA, MQA, a sliding window; chunked prefill and preemption), plus bf16 logprobs against fp32, and
fresh prompts through FlashAttention's varlen path against brute force and the padded SDPA path.

    python scripts/gpu_check.py --out results.json

Prints one line per check and exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def kernel_checks() -> list[dict[str, Any]]:
    from tp_runtime.layers.paged_decode_triton import paged_decode_attention, paged_prefill_attention

    results = []
    gen = torch.Generator().manual_seed(0)
    for head_dim, heads, kv_heads, window, block_size in [
        (128, 32, 8, None, 16),
        (12, 6, 2, None, 16),
        (80, 8, 1, None, 32),
        (96, 12, 4, 40, 16),
        (72, 4, 4, None, 16),
    ]:
        for dtype in (torch.float32, torch.bfloat16):
            lens = [1, 37, 300, 1025, 64]
            blocks_per = [-(-n // block_size) for n in lens]
            num_blocks = sum(blocks_per) + 3
            kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype).cuda()
            vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype).cuda()
            perm = torch.randperm(num_blocks, generator=gen)
            width = max(blocks_per) + 2
            tables = torch.zeros(len(lens), width, dtype=torch.int64)
            start = 0
            for i, b in enumerate(blocks_per):
                tables[i, :b] = perm[start : start + b]
                start += b
            tables = tables.cuda()
            seq_lens = torch.tensor(lens, device="cuda")
            q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype).cuda()
            scale = head_dim**-0.5
            want = torch.stack(
                [
                    _reference(
                        q[i : i + 1].double(), kc.double(), vc.double(), tables[i], lens[i] - 1, window, scale
                    )[0]
                    for i in range(len(lens))
                ]
            )
            tol = 2e-5 if dtype == torch.float32 else 2e-2
            for splits in (1, 2, 5, 16):
                got = paged_decode_attention(q, kc, vc, tables, seq_lens, scale, window, splits)
                err = (got.double() - want).abs().max().item()
                _report(
                    results,
                    {
                        "check": f"decode d={head_dim} h={heads}/{kv_heads} w={window} bs={block_size} "
                        f"{dtype} splits={splits}",
                        "max_err": err,
                        "ok": err < tol,
                    },
                )
            # A continuation chunk of the longest sequence: its last 70 tokens after 955 of context.
            i = 3
            ctx, n = lens[i] - 70, 70
            qp = torch.randn(n, heads, head_dim, generator=gen).to(dtype).cuda()
            got = paged_prefill_attention(qp, kc, vc, tables[i], ctx, scale, window)
            want_p = _reference(qp.double(), kc.double(), vc.double(), tables[i], ctx, window, scale)
            err = (got.double() - want_p).abs().max().item()
            _report(
                results,
                {
                    "check": f"prefill d={head_dim} h={heads}/{kv_heads} w={window} {dtype}",
                    "max_err": err,
                    "ok": err < tol,
                },
            )
    return results


def fresh_prompt_checks() -> list[dict[str, Any]]:
    """Fresh prompts through FlashAttention's varlen path (PackedVarlen) in bf16/fp16 against the float64
    brute force and against the padded SDPA path: q/k/v as the strided views a fused QKV projection gives,
    a decode row first, a continuation chunk between the fresh prompts (not back to back), and GQA, MQA
    and a single local KV head."""
    from tp_runtime.layers.attention import (
        AttentionMetadata,
        PrefillChunk,
        TritonAttention,
        make_attention_backend,
        paged_attention,
    )

    results = []
    gen = torch.Generator().manual_seed(1)
    for head_dim, heads, kv_heads in [(128, 32, 8), (64, 8, 1), (96, 12, 4), (128, 4, 4)]:
        for dtype in (torch.bfloat16, torch.float16):
            backend = make_attention_backend("triton", torch.device("cuda"), kv_heads, 16, num_heads=heads,
                                             head_dim=head_dim, dtype=dtype)  # fmt: skip
            padded = TritonAttention(kv_heads, 16, 1, split_kv=True)
            lengths, continuation = [300, 1, 77, 512], 40  # the 1-token prompt is a decode row's shape
            rows = 1 + sum(lengths) + continuation
            qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).cuda()
            q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
            k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
            v = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
            kc = torch.randn(64, 16, kv_heads, head_dim, generator=gen).to(dtype).cuda()
            vc = torch.randn(64, 16, kv_heads, head_dim, generator=gen).to(dtype).cuda()
            chunks, starts, row = [], [], 1
            for i, n in enumerate(lengths):
                if i == 2:  # a continuation chunk of 40 tokens after 24 in the cache, blocks 10..13
                    table = torch.arange(10, 14, device="cuda")
                    chunks.append(PrefillChunk(row, row + continuation, 24, table))
                    row += continuation
                chunks.append(PrefillChunk(row, row + n, 0, torch.zeros(0, dtype=torch.int64, device="cuda")))
                starts.append(row)
                row += n
            scale = head_dim**-0.5
            outs = {}
            for name, chosen in (("varlen", backend), ("padded", padded)):
                meta = AttentionMetadata(
                    backend=chosen, slot_mapping=torch.zeros(0, dtype=torch.int64, device="cuda"),
                    num_decode_tokens=1, decode_block_tables=torch.tensor([[3, 5]], device="cuda"),
                    decode_seq_lens=torch.tensor([20], device="cuda"), prefills=chunks,
                )  # fmt: skip
                outs[name] = paged_attention(q, k, v, kc, vc, meta, scale, None, None).float()
            worst = 0.0
            for s0, n in zip(starts, lengths, strict=True):
                qs, ks, vs = (x[s0 : s0 + n].double() for x in (q, k, v))
                group = heads // kv_heads
                ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
                scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
                scores = scores.masked_fill(torch.ones(n, n, device="cuda").triu(1).bool(), float("-inf"))
                want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
                worst = max(worst, (outs["varlen"][s0 : s0 + n] - want).abs().max().item())
            agree = (outs["varlen"] - outs["padded"]).abs().max().item()
            varlen_used = type(backend.fresh_prompts).__name__ == "PackedVarlen"
            _report(results, {
                "check": f"fresh prompts varlen d={head_dim} heads={heads}/{kv_heads} {dtype}",
                "varlen_used": varlen_used, "max_abs_err_vs_fp64": worst, "max_abs_diff_vs_padded": agree,
                "ok": varlen_used and worst < 2e-2 and agree < 2e-2,
            })  # fmt: skip
    return results


def fp8_checks() -> list[dict[str, Any]]:
    """The FP8 linear layer's CUDA kernels (layers/quantization/fp8.py) against float64 brute force on the
    dequantized weight: the weight-only Triton kernel for one row (exact products: only the output's
    rounding), W8A8 for more (each row of x rounded to e4m3 too: a looser bound): the Triton FP8 GEMM
    (K split for few tiles of a long K; the same bits on a second call) to 64 rows, for block-scaled
    weights and float16 x, _scaled_mm past that; and the activations' quantization kernels (per row,
    per row and 128 columns) bit for bit against their reference, NaN and inf included."""
    from tp_runtime.layers.activation import silu_and_mul
    from tp_runtime.layers.norm import GemmaRMSNorm, RMSNorm
    from tp_runtime.layers.quantization.activation_quant_triton import (
        quantize_groups_fp8,
        quantize_rows_fp8,
        quantize_rows_fp8_reference,
    )
    from tp_runtime.layers.quantization.fp8 import CudaFp8Kernels, dequantize

    results = []
    gen = torch.Generator().manual_seed(0)
    shapes = ((1, 4096), (1, 28672), (32, 14336), (130, 4096), (512, 4096), (7, 100), (256, 14336))
    shapes += ((128, 40000), (4, 40000))  # wider than a program holds: looped over, split over programs
    for rows, k in shapes:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = (torch.randn(rows, k, generator=gen) * torch.logspace(-4, 3, rows)[:, None]).to(dtype).cuda()
            q, scale = quantize_rows_fp8(x)
            q_ref, scale_ref = quantize_rows_fp8_reference(x)
            same = torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)
            _report(results, {"check": f"fp8 activation quantization rows={rows} k={k} {dtype}", "ok": same})
            q, scale = quantize_groups_fp8(x, 128)
            q_ref, scale_ref = quantize_rows_fp8_reference(x, 128)
            same = torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)
            _report(results, {"check": f"fp8 group quantization rows={rows} k={k} {dtype}", "ok": same})
            # With the SiLU-mul applied inside: the separate kernel's product, quantized, bit for bit.
            gate_up = torch.cat([x, x.flip(1)], dim=1) * 0.01  # (float16's range: no infinities)
            h = silu_and_mul(gate_up, fused=True)
            fused_pairs = (
                (quantize_rows_fp8(gate_up, silu_mul=True), quantize_rows_fp8(h)),
                (quantize_groups_fp8(gate_up, 128, silu_mul=True), quantize_groups_fp8(h, 128)),
            )
            same = all(
                torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
                for a, b in fused_pairs
            )
            _report(results, {"check": f"fp8 quantization of silu_mul rows={rows} k={k} {dtype}", "ok": same})
    # A NaN or an infinity makes its row's scale NaN or infinite and its values NaN (CUDA's plain max and
    # min would hide them), as torch's arithmetic does.
    x = torch.randn(4, 300, generator=gen).cuda()
    x[0, 7], x[1, 3], x[2, 5] = float("nan"), float("inf"), -float("inf")
    q, scale = quantize_rows_fp8(x)
    q_ref, scale_ref = quantize_rows_fp8_reference(x)
    values = q.float()
    nan_kept = bool(scale[0].isnan() and scale[1].isinf() and values[0].isnan().all())
    nan_kept = nan_kept and bool(values[1, 3].isnan())
    same = torch.equal(q[3].view(torch.uint8), q_ref[3].view(torch.uint8))
    same = same and torch.equal(scale[3], scale_ref[3])
    _report(results, {"check": "fp8 activation quantization of NaN and inf rows", "ok": nan_kept and same})
    kernels = CudaFp8Kernels.for_device(torch.device("cuda"))
    # A deferred norm (NormedInput) quantizing its own rows: the residual of the plain kernel bit for bit;
    # the scales and e4m3 codes of the plain norm's output quantized, but where the row's sum of squares
    # rounds differently (ptxas orders the cross-warp sum of the quantizing kernel's three reductions
    # its own way, so a row's 1/rms can move by an ulp): at most one code apart, on a few elements in a
    # million (0-2 of 3.1M on an H100); through the FP8 method, the output of the tensor path to 1 %.
    for rows, width in ((1, 4096), (4, 4096), (32, 8192), (600, 5120)):
        for cls in (RMSNorm, GemmaRMSNorm):
            norm = cls(width, 1e-5, torch.bfloat16, torch.device("cuda"), fused=True)
            norm.weight.data.copy_(torch.randn(width, generator=gen) * 0.3)
            x = (torch.randn(rows, width, generator=gen) * 3).bfloat16().cuda()
            res = torch.randn(rows, width, generator=gen).bfloat16().cuda()
            res_a, res_b, res_c, res_d = res.clone(), res.clone(), res.clone(), res.clone()
            q_ref, s_ref = quantize_rows_fp8(norm(x, res_a))
            q, sc = norm.deferred(x, res_b).quantized()
            steps = (q.view(torch.uint8).int() - q_ref.view(torch.uint8).int()).abs()
            off = int((steps > 0).sum())
            codes_ok = int(steps.max()) <= 1 and off <= max(2, q.numel() // 100_000)
            scales_ok = bool(((sc - s_ref).abs() <= s_ref.abs() * 2.0**-7).all())
            wq = (torch.randn(1024, width, generator=gen) * 0.05).to(torch.float8_e4m3fn).cuda()
            ws = (torch.rand(1024, 1, generator=gen) + 0.5).cuda() * 1e-2
            want = kernels.linear(norm(x, res_c), wq, ws, width, None, False).double()
            got = kernels.linear(norm.deferred(x, res_d), wq, ws, width, None, False).double()
            err = ((got - want).abs().max() / want.abs().max()).item()
            residual_ok = torch.equal(res_a, res_b) and torch.equal(res_c, res_d)
            _report(results, {
                "check": f"fp8 norm quantizing its rows {cls.__name__} rows={rows} width={width}",
                "codes_one_step_apart": off, "scales_ok": scales_ok, "rel_err_vs_tensor_path": err,
                "ok": codes_ok and scales_ok and residual_ok and err < 1e-2,
            })  # fmt: skip
    shapes = [(4096, 4096, 0), (6144, 4096, 128), (1024, 14336, 0), (28672, 4096, 128), (200, 96, 0)]
    shapes += [(4096, 14336, 0)]  # few tiles of a long K: split in two
    for n, k, block_k in shapes:
        w = torch.randn(n, k, generator=gen) * 0.02
        cols = 1 if block_k == 0 else -(-k // block_k)
        scale = (torch.rand(n, cols, generator=gen) + 0.5) * 1e-4
        full = scale.repeat_interleave(block_k or k, 1)[:, :k]
        wq = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn).cuda()
        scale = scale.cuda()
        wd = dequantize(wq, scale, block_k or k, torch.float64)
        cases = [(r, torch.bfloat16) for r in (1, 2, 4, 16, 17, 32, 512)]
        cases += [(48, torch.float16), (600, torch.float16)]
        if (n, k) == (4096, 14336):
            cases = [(8, torch.bfloat16), (32, torch.bfloat16)]
        for rows, dtype in cases:
            for silu_mul in (False, True) if rows in (1, 32, 512, 600) else (False,):
                x = torch.randn(rows, 2 * k if silu_mul else k, generator=gen).to(dtype).cuda()
                got = kernels.linear(x, wq, scale, block_k or k, None, silu_mul)
                again = kernels.linear(x, wq, scale, block_k or k, None, silu_mul)
                same = torch.equal(got, again)
                got = got.double()
                xin = x.double()
                if silu_mul:
                    act = torch.nn.functional.silu(x[:, :k].float()) * x[:, k:].float()
                    xin = act.to(dtype).double()
                want = xin @ wd.T
                err = ((got - want).abs().max() / want.abs().max()).item()
                bound = 1e-2 if rows == 1 else 6e-2
                _report(results, {
                    "check": f"fp8 linear {n}x{k} block_k={block_k} rows={rows} {dtype} silu_mul={silu_mul}",
                    "rel_err_vs_fp64": err, "same_bits_twice": same, "ok": err < bound and same,
                })  # fmt: skip
    return results


def fp8_moe_checks() -> list[dict[str, Any]]:
    """FP8 experts on the GPU (SparseMoE's fp8_grouped: layers/quantization/fp8_moe_triton.py) against
    float64 sums of what they multiply (each pair's activations rounded to e4m3 by the torch reference,
    which CUDA's kernel matches bit for bit, times its expert's dequantized weights): Mixtral- and
    Qwen3-MoE-shaped layers with per-channel and 128x128 block scales, 1-600 tokens; the same bits on a
    second call and from a CUDA graph's replay (no host sync in the path)."""
    import torch.nn.functional as F

    from tp_runtime.config import QuantConfig
    from tp_runtime.distributed import TPGroup
    from tp_runtime.layers.moe import SparseMoE
    from tp_runtime.layers.quantization.activation_quant_triton import quantize_rows_fp8_reference
    from tp_runtime.layers.quantization.fp8 import Fp8LinearMethod

    def qdq(a: torch.Tensor, group: int | None) -> torch.Tensor:
        q, s = quantize_rows_fp8_reference(a, group)
        return q.double() * s.double().repeat_interleave(group or a.shape[1], 1)[:, : a.shape[1]]

    results = []
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    # (hidden, expert width, experts, top-k, routing as Mixtral's, half the experts idle); 64-column scale
    # blocks on both stacks stand for the narrower blocks a TP shard that starts inside a 128-column block
    # gives w2 (which the CPU tests load rank by rank)
    shapes = (
        (1024, 1792, 8, 2, True, False), (2048, 768, 128, 8, False, False), (1024, 1792, 16, 2, True, True),
    )  # fmt: skip
    for hidden, inter, experts, top_k, mixtral, idle in shapes:
        for scales, block in (("channel", None), ("block", (128, 128)), ("block", (128, 64))):
            if block == (128, 64) and experts != 128:
                continue
            config = QuantConfig("compressed-tensors", scales, block)
            layer = SparseMoE(
                hidden, inter, experts, top_k, renormalize=mixtral, fp32_weights=mixtral,
                expert_names=("w1", "w3", "w2"), tp=TPGroup(), dtype=torch.bfloat16, device=device,
                fused=True, method=Fp8LinearMethod.for_device(config, device),
            )  # fmt: skip
            for name, param in layer.named_parameters():
                if param.dtype == torch.float8_e4m3fn:
                    values = torch.randn(param.shape, generator=gen, device=device) * 100
                    param.data.copy_(values.clamp(-448, 448).to(param.dtype))
                elif name.endswith("_scale"):
                    param.data.copy_(torch.rand(param.shape, generator=gen, device=device) * 2e-4 + 1e-4)
                else:
                    param.data.copy_(torch.randn(param.shape, generator=gen, device=device) * 0.05)
            if idle:  # positive x: these experts' router rows make their logits the lowest
                layer.router.data[: experts // 2] = -layer.router.data[: experts // 2].abs()
                layer.router.data[experts // 2 :] = layer.router.data[experts // 2 :].abs()
            w13, w2 = layer.w13_stack.dequantized(torch.float64), layer.w2_stack.dequantized(torch.float64)
            group = block[1] if block else None
            for tokens in (1, 7, 64, 600):
                x = torch.randn(tokens, hidden, generator=gen, device=device).to(torch.bfloat16)
                x = x.abs() if idle else x
                with torch.no_grad():
                    got = layer(x)
                    again = layer(x)
                    weights, ids = layer.route(x)
                    graph = torch.cuda.CUDAGraph()
                    static_x = x.clone()
                    with torch.cuda.graph(graph):
                        static_out = layer(static_x)
                    graph.replay()
                    torch.cuda.synchronize()
                # Float64 per expert: the pairs it got, through the layer's own roundings of gate/up and h.
                want = torch.zeros(tokens, hidden, dtype=torch.float64, device=device)
                xd = qdq(x, group)
                for e in ids.unique().tolist():
                    token, slot = (ids == e).nonzero(as_tuple=True)
                    gate, up = (xd[token] @ w13[e].T).to(torch.bfloat16).chunk(2, dim=1)
                    h = F.silu(gate.float()).to(torch.bfloat16) * up
                    part = qdq(h, group) @ w2[e].T
                    want.index_add_(0, token, part * weights[token, slot].double()[:, None])
                err = ((got.double() - want).norm() / want.norm()).item()
                same = torch.equal(got, again) and torch.equal(got, static_out)
                _report(results, {
                    "check": f"fp8 experts {experts}x{hidden}x{inter} top{top_k} {scales} {block} "
                             f"tokens={tokens}" + (" half idle" if idle else ""),
                    "impl": layer.impl, "experts_hit": ids.unique().numel(), "rel_err_vs_fp64": err,
                    "same_bits_twice_and_in_graph": same,
                    "ok": layer.impl == "fp8_grouped" and err < 2e-2 and same
                    and (not idle or ids.min().item() >= experts // 2),
                })  # fmt: skip
    return results


def fp8_kv_checks(root: Path) -> list[dict[str, Any]]:
    """The FP8 KV cache (kv_cache_dtype="fp8"): split-KV decode and paged prefill over e4m3 caches with
    per-layer scales against the float64 brute force on the dequantized caches; the fused rotary + cache
    write storing write_kv's bytes; greedy tokens of a tiny checkpoint on CUDA (fp32, Triton kernels,
    graphs) against HF on the CPU with an FP8-rounded cache."""
    from conftest import build_checkpoint
    from test_kv_fp8 import PROMPTS, engine_greedy, hf_fp8_greedy

    from tp_runtime.layers.attention import write_kv
    from tp_runtime.layers.fused_triton import rotary_and_cache_
    from tp_runtime.layers.paged_decode_triton import paged_decode_attention, paged_prefill_attention

    results: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(1)
    scales = (0.3, 0.07)
    for head_dim, heads, kv_heads, window in [(128, 32, 8, None), (64, 8, 1, 40), (80, 12, 4, None)]:
        lens, block_size = [1, 37, 300, 1025], 16
        blocks_per = [-(-n // block_size) for n in lens]
        num_blocks = sum(blocks_per) + 2
        caches = [
            (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) * 2 / s)
            .clamp(-448, 448)
            .to(torch.float8_e4m3fn)
            .cuda()
            for s in scales
        ]
        kd, vd = (c.double() * s for c, s in zip(caches, scales, strict=True))
        perm = torch.randperm(num_blocks, generator=gen)
        tables = torch.zeros(len(lens), max(blocks_per), dtype=torch.int64)
        start = 0
        for i, b in enumerate(blocks_per):
            tables[i, :b] = perm[start : start + b]
            start += b
        tables = tables.cuda()
        seq_lens = torch.tensor(lens, device="cuda")
        scale = head_dim**-0.5
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype).cuda()
            want = torch.stack(
                [
                    _reference(q[i : i + 1].double(), kd, vd, tables[i], lens[i] - 1, window, scale)[0]
                    for i in range(len(lens))
                ]
            )
            tol = 2e-5 if dtype == torch.float32 else 2e-2
            for splits in (1, 4):
                got = paged_decode_attention(
                    q, *caches, tables, seq_lens, scale, window, splits, kv_scales=scales
                )
                err = (got.double() - want).abs().max().item()
                _report(
                    results,
                    {
                        "check": f"fp8 kv decode d={head_dim} h={heads}/{kv_heads} w={window} "
                        f"{dtype} splits={splits}",
                        "max_err": err,
                        "ok": err < tol,
                    },
                )
            ctx, n = lens[3] - 70, 70
            qp = torch.randn(n, heads, head_dim, generator=gen).to(dtype).cuda()
            got = paged_prefill_attention(qp, *caches, tables[3], ctx, scale, window, kv_scales=scales)
            err = (
                (got.double() - _reference(qp.double(), kd, vd, tables[3], ctx, window, scale))
                .abs()
                .max()
                .item()
            )
            _report(
                results,
                {
                    "check": f"fp8 kv prefill d={head_dim} h={heads}/{kv_heads} w={window} {dtype}",
                    "max_err": err,
                    "ok": err < tol,
                },
            )
    for dtype in (torch.bfloat16, torch.float32):
        tokens, heads, kv_heads, head_dim = 300, 32, 8, 128
        q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype).cuda()
        k = (3 * torch.randn(tokens, kv_heads, head_dim, generator=gen)).to(dtype).cuda()
        v = (0.05 * torch.randn(tokens, kv_heads, head_dim, generator=gen)).to(dtype).cuda()
        k[0, 0, :2] = torch.tensor([1e4, -1e4])
        cos, sin = (torch.randn(tokens, head_dim, generator=gen).cuda() for _ in range(2))
        slots = torch.randperm(32 * 16, generator=gen)[:tokens].cuda()
        fused = [
            torch.zeros(32, 16, kv_heads, head_dim, dtype=torch.float8_e4m3fn, device="cuda") for _ in "kv"
        ]
        plain = [torch.zeros_like(c) for c in fused]
        rotary_and_cache_(q, k, v, cos, sin, *fused, slots, scales)
        write_kv(*plain, k, v, slots, scales)  # k: rotated by the kernel
        differ = sum(
            int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) for a, b in zip(fused, plain, strict=True)
        )
        _report(
            results,
            {
                "check": f"fp8 kv fused rotary + cache write {dtype}",
                "bytes_differing": differ,
                "ok": differ == 0,
            },
        )
    model_dir = build_checkpoint(root, "LlamaForCausalLM")
    want = hf_fp8_greedy(model_dir, PROMPTS)
    for options in (
        {},
        {
            "max_num_batched_tokens": 16,
            "num_kv_blocks": 22,
            "block_size": 4,
            "max_num_seqs": 4,
            "max_model_len": 48,
        },
    ):
        got = engine_greedy(model_dir, PROMPTS, device="cuda", kv_cache_dtype="fp8", **options)
        same = sum(g == w for g, w in zip(got, want, strict=True))
        _report(
            results,
            {
                "check": f"fp8 kv engine (cuda fp32) vs HF rounded cache {options or 'default'}",
                "sequences_equal": f"{same}/{len(want)}",
                "ok": same == len(want),
            },
        )
    return results


def _report(results: list[dict[str, Any]], result: dict[str, Any]) -> None:
    print(("ok  " if result["ok"] else "FAIL"), {k: v for k, v in result.items() if k != "ok"}, flush=True)
    results.append(result)


def _reference(q, kc, vc, table, first_pos, window, scale):  # type: ignore[no-untyped-def]
    """Brute force: queries at positions first_pos.. over the sequence's gathered keys, float64."""
    n, heads, d = q.shape
    kv_heads = kc.shape[2]
    last = first_pos + n
    keys = kc[table].reshape(-1, kv_heads, d)[:last]
    values = vc[table].reshape(-1, kv_heads, d)[:last]
    group = heads // kv_heads
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    q_pos = torch.arange(first_pos, last, device=q.device)[:, None]
    k_pos = torch.arange(last, device=q.device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def engine_checks(root: Path) -> list[dict[str, Any]]:
    from conftest import build_checkpoint, hf_greedy, random_prompts

    from tp_runtime import LLM, SamplingParams

    shapes = [
        (
            "head_dim 12",
            "LlamaForCausalLM",
            dict(hidden_size=72, num_attention_heads=6, num_key_value_heads=2),
        ),
        (
            "head_dim 80 MQA",
            "LlamaForCausalLM",
            dict(hidden_size=160, num_attention_heads=2, num_key_value_heads=1),
        ),
        (
            "head_dim 96",
            "Qwen2ForCausalLM",
            dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=2),
        ),
        ("sliding window", "MistralForCausalLM", dict(sliding_window=24)),
    ]
    results = []
    for name, arch, overrides in shapes:
        path = build_checkpoint(root, arch, **overrides)
        # 60 and 56, 52 and 48 share fresh-prompt attention batches (padded to the longer of each pair).
        prompts = random_prompts((5, 17, 33, 48, 60, 9, 56, 52), 300)
        want = hf_greedy(path, prompts, 24)
        for label, kwargs in [
            ("", {}),
            (
                " chunked+preempted",
                dict(max_num_batched_tokens=32, num_kv_blocks=14, max_num_seqs=4, max_model_len=96),
            ),
            (" torch attention", dict(attention_backend="torch")),
        ]:
            with LLM(path, device="cuda", dtype="float32", **kwargs) as llm:  # type: ignore[arg-type]
                outs = llm.generate(
                    [{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                    use_tqdm=False,
                )
            got = [o.outputs[0].token_ids for o in outs]
            same = sum(g == w for g, w in zip(got, want, strict=True))
            _report(
                results,
                {
                    "check": f"greedy vs HF: {name}{label}",
                    "same": f"{same}/{len(want)}",
                    "ok": same == len(want),
                },
            )
        _report(results, _bf16_vs_fp32(path, prompts, name))
    results += _sampling_controls_checks(root)
    return results


def _sampling_controls_checks(root: Path) -> list[dict[str, Any]]:
    """logit_bias, allowed_token_ids, min_tokens and penalties on CUDA (async scheduling, decode graphs,
    the padded sync path) give the CPU engine's greedy tokens (the CPU tests check those against a float64
    brute force over HF forwards)."""
    from conftest import build_checkpoint, random_prompts

    from tp_runtime import LLM, SamplingParams

    path = build_checkpoint(root, "LlamaForCausalLM")
    prompts = random_prompts((5, 17, 33, 48, 60, 9), 300)
    params = [
        SamplingParams(temperature=0, max_tokens=20, logit_bias={7: 30.0, 11: -100.0, 250: 2.5}),
        SamplingParams(temperature=0, max_tokens=20, allowed_token_ids=[3, 5, 8, 13, 21, 34, 55, 89]),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=12, logit_bias={2: 50.0}),
        SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(
            temperature=0,
            max_tokens=20,
            allowed_token_ids=[2, 40, 41, 42],
            logit_bias={41: 1.0},
            min_tokens=5,
        ),
        SamplingParams(temperature=0, max_tokens=20, frequency_penalty=0.7, logit_bias={99: -3.0}),
    ]
    reqs = [{"prompt_token_ids": p} for p in prompts]

    def run(**kwargs: Any) -> list[list[int]]:
        with LLM(path, dtype="float32", **kwargs) as llm:
            outs = llm.generate(reqs, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    want = run(device="cpu")
    results: list[dict[str, Any]] = []
    for label, kwargs in [("async", {}), ("sync", dict(async_scheduling=False))]:
        got = run(device="cuda", **kwargs)
        same = sum(g == w for g, w in zip(got, want, strict=True))
        _report(
            results,
            {
                "check": f"sampling controls, cuda {label} vs cpu",
                "same": f"{same}/{len(want)}",
                "ok": same == len(want),
            },
        )
    return results


def _bf16_vs_fp32(path: Path, prompts: list[list[int]], name: str) -> dict[str, Any]:
    """Logprob of each generated token, bf16 against fp32, over the prefix where both chose the same."""
    from tp_runtime import LLM, SamplingParams

    runs = {}
    for dtype in ("float32", "bfloat16"):
        with LLM(path, device="cuda", dtype=dtype) as llm:
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts],
                SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1),
                use_tqdm=False,
            )
        runs[dtype] = [
            [
                (t, lp[t].logprob)
                for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [], strict=True)
            ]
            for o in outs
        ]
    worst = 0.0
    for a, b in zip(runs["float32"], runs["bfloat16"], strict=True):
        for (ta, la), (tb, lb) in zip(a, b, strict=True):
            if ta != tb:
                break
            worst = max(worst, abs(la - lb))
    return {"check": f"bf16 vs fp32 logprobs: {name}", "max_abs_diff": worst, "ok": worst < 0.25}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--only-fresh-prompts", action="store_true", help="only the varlen path's checks")
    parser.add_argument("--only-fp8", action="store_true", help="only the FP8 kernels' checks")
    parser.add_argument("--only-kv-fp8", action="store_true", help="only the FP8 KV cache's checks")
    args = parser.parse_args()
    if args.only_kv_fp8:
        with tempfile.TemporaryDirectory() as tmp:
            failed = [r for r in fp8_kv_checks(Path(tmp)) if not r["ok"]]
        print(f"fp8 kv cache: {len(failed)} failed")
        sys.exit(1 if failed else 0)
    if args.only_fp8:
        failed = [r for r in fp8_checks() + fp8_moe_checks() if not r["ok"]]
        print(f"fp8: {len(failed)} failed")
        sys.exit(1 if failed else 0)
    if args.only_fresh_prompts:
        failed = [r for r in fresh_prompt_checks() if not r["ok"]]
        print(f"fresh prompts: {len(failed)} failed")
        sys.exit(1 if failed else 0)
    results = kernel_checks()
    results += fp8_checks()
    results += fp8_moe_checks()
    results += fresh_prompt_checks()
    with tempfile.TemporaryDirectory() as tmp:
        results += engine_checks(Path(tmp))
        results += fp8_kv_checks(Path(tmp))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    failed = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
