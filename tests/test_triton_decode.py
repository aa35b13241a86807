"""The Triton kernels (paged decode attention; fused residual + RMSNorm, rotary, SiLU-mul), run by Triton's
CPU interpreter (the kernels themselves run on CUDA).

Skipped where Triton is not installed. Each check runs in a subprocess because TRITON_INTERPRET must be
set before Triton is imported.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import GEMMA2, hf_greedy, run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
REPO = Path(__file__).resolve().parents[1]

KERNEL_VS_BRUTE_FORCE = """
import math, torch
from tp_runtime.layers.paged_decode_triton import paged_decode_attention
torch.manual_seed(0)
B, H, KVH, D, BS, NB = 3, 8, 2, 64, 16, 20
kc, vc, q = torch.randn(NB, BS, KVH, D), torch.randn(NB, BS, KVH, D), torch.randn(B, H, D)
seq_lens = torch.tensor([5, 33, 70])
tables = torch.stack([torch.randperm(NB)[:6] for _ in range(B)])
for window in (None, 8):
    out = paged_decode_attention(q, kc, vc, tables, seq_lens, D ** -0.5, window)
    for b in range(B):
        L = int(seq_lens[b])
        keys, vals = kc[tables[b]].reshape(-1, KVH, D)[:L], vc[tables[b]].reshape(-1, KVH, D)[:L]
        for h in range(H):
            s = (keys[:, h // (H // KVH)] @ q[b, h]) * D ** -0.5
            if window:
                s[: max(0, L - window)] = -math.inf
            ref = torch.softmax(s, 0) @ vals[:, h // (H // KVH)]
            assert torch.allclose(out[b, h], ref, atol=1e-5), (window, b, h)
print("OK")
"""

# Shared by the split-KV decode and prefill checks: an independent brute force (per sequence, gather the
# keys through the block table, softmax in float64) and random paged caches.
BRUTE_FORCE = """
import math, os, sys, numpy as np, torch, triton.language as tl
from triton.runtime import interpreter
from tp_runtime.layers import paged_decode_triton as kernels
torch.manual_seed(0)
DEVICE = sys.argv[1]  # the kernels' inputs; the reference runs on CPU

if os.environ.get("TRITON_INTERPRET") == "1":
    # Triton's interpreter multiplies bfloat16 tl.dot operands as their raw uint16 bits; widen them to
    # float32 first (exact). On CUDA tl.dot takes bfloat16 natively.
    def widen(x):
        if x.dtype != tl.bfloat16:
            return x
        return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
    interpreter_dot = interpreter.InterpreterBuilder.create_dot
    def widened_dot(self, a, b, *rest):
        return interpreter_dot(self, widen(a), widen(b), *rest)
    interpreter.InterpreterBuilder.create_dot = widened_dot

def attend(q, keys, vals, q_pos, window, scale, softcap=None):
    # q [n, H, D] at positions q_pos [n]; keys/vals [T, KVH, D] at positions 0..T-1 -> [n, H, D] float64;
    # softcap: scores -> softcap * tanh(scores / softcap) before masking
    H, KVH = q.shape[1], keys.shape[1]
    k_pos = torch.arange(keys.shape[0])
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(H):
        s = q[:, h].double() @ keys[:, h // (H // KVH)].double().T * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        out[:, h] = torch.softmax(s.masked_fill(~allowed, -math.inf), 1) @ vals[:, h // (H // KVH)].double()
    return out

def paged_cache(lens, BS, KVH, D, dtype):
    # Disjoint shuffled blocks per sequence; slots past each length hold NaN, as never-written memory may.
    width = max(math.ceil(L / BS) for L in lens) + 1
    NB = len(lens) * width + 1
    tables = torch.randperm(NB)[: len(lens) * width].view(len(lens), width)
    kc, vc = (torch.randn(NB, BS, KVH, D).to(dtype) for _ in range(2))
    for b, L in enumerate(lens):
        for cache in (kc, vc):
            flat = cache[tables[b]].view(-1, KVH, D)
            flat[L:] = math.nan
            cache[tables[b]] = flat.view(-1, BS, KVH, D)
    # The runtime passes a column slice of a wider int64 buffer (row stride > width).
    buf = torch.full((len(lens), width + 3), 10**9, dtype=torch.int64)
    buf[:, 1 : 1 + width] = tables
    return kc, vc, tables, buf.to(DEVICE)[:, 1 : 1 + width]

def close(got, want, dtype):
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    err = (got.double() - want).abs().max().item()
    return torch.allclose(got.double(), want, atol=tol, rtol=tol), err
"""

DECODE_VS_BRUTE_FORCE = """
def check(dtype, H, KVH, D, BS, lens, windows, splits_list, softcap=None):
    kc, vc, tables, tables_dev = paged_cache(lens, BS, KVH, D, dtype)
    qkv = torch.randn(len(lens), H + 2, D).to(dtype)
    q, q_dev = qkv[:, 1 : H + 1], qkv.to(DEVICE)[:, 1 : H + 1]  # a strided view, as of the QKV output
    lens_dev = torch.tensor([[L, 7] for L in lens]).to(DEVICE)[:, 0]  # seq_lens: a strided column
    caches, scale = (kc.to(DEVICE), vc.to(DEVICE)), D ** -0.5
    for window in windows:
        want = torch.cat([
            attend(q[b : b + 1], kc[tables[b]].view(-1, KVH, D)[:L], vc[tables[b]].view(-1, KVH, D)[:L],
                   torch.tensor([L - 1]), window, scale, softcap)
            for b, L in enumerate(lens)
        ])
        for splits in splits_list:
            got = kernels.paged_decode_attention(q_dev, *caches, tables_dev, lens_dev, scale, window, splits,
                                                 softcap=softcap)
            assert got.dtype == dtype and got.shape == q.shape
            ok, err = close(got.cpu(), want, dtype)
            assert ok, (dtype, H, KVH, D, BS, lens, window, splits, softcap, kernels.DECODE_BLOCK_N, err)

f32, bf16 = torch.float32, torch.bfloat16
# GQA group 4, head_dim 24, one-token and tile-boundary lengths, splits 1/2/3/7 (some splits empty)
check(f32, 8, 2, 24, 16, [1, 37, 130, 64], [None, 20], [1, 2, 3, 7])
# MQA, head_dim 12, cache blocks of 32, more splits than tiles
check(f32, 4, 1, 12, 32, [200, 1, 65], [None, 50], [1, 3, 16])
# group 1, head_dim 80
check(f32, 3, 3, 80, 16, [5, 190, 1], [None, 70], [1, 2, 7])
# KV tile smaller than the cache block (16 < 32, 16 < 64): one tile reads part of one block
kernels.DECODE_BLOCK_N = 16
check(f32, 4, 2, 96, 32, [1, 100, 33], [None, 30], [1, 3])
check(f32, 4, 2, 96, 64, [129, 2], [None, 30], [1, 5])
kernels.DECODE_BLOCK_N = 64
# bfloat16, head_dim 128 and 256 (a halved KV tile)
check(bf16, 8, 2, 128, 16, [1, 90, 257], [None, 64], [1, 4])
check(bf16, 4, 2, 256, 32, [3, 150], [None, 40], [1, 3])
# Attention logit soft-capping (Gemma 2): a cap of 1.5 bends scores of std ~1 hard; with a window and
# split-KV (some splits empty), MQA, and bfloat16
check(f32, 8, 2, 24, 16, [1, 37, 130, 64], [None, 20], [1, 2, 7], softcap=1.5)
check(f32, 4, 1, 12, 32, [200, 1, 65], [None, 50], [1, 16], softcap=1.5)
check(bf16, 8, 4, 128, 16, [1, 90, 257], [None, 64], [1, 4], softcap=1.5)
print("OK")
"""

PREFILL_VS_BRUTE_FORCE = """
def check(dtype, H, KVH, D, BS, cases, windows, softcap=None):
    for context_len, chunk_len in cases:
        T = context_len + chunk_len
        kc, vc, tables, _ = paged_cache([T], BS, KVH, D, dtype)
        table = tables[0][: math.ceil(T / BS)]
        qkv = torch.randn(chunk_len, H + 2, D).to(dtype)
        q, q_dev = qkv[:, 1 : H + 1], qkv.to(DEVICE)[:, 1 : H + 1]
        for window in windows:
            want = attend(q, kc[table].view(-1, KVH, D)[:T], vc[table].view(-1, KVH, D)[:T],
                          torch.arange(context_len, T), window, D ** -0.5, softcap)
            got = kernels.paged_prefill_attention(q_dev, kc.to(DEVICE), vc.to(DEVICE), table.to(DEVICE),
                                                  context_len, D ** -0.5, window, softcap=softcap)
            assert got.dtype == dtype and got.shape == q.shape
            ok, err = close(got.cpu(), want, dtype)
            where = (dtype, H, KVH, D, BS, context_len, chunk_len, window, softcap, kernels.PREFILL_BLOCK_M)
            assert ok, (where, err)

f32, bf16 = torch.float32, torch.bfloat16
check(f32, 8, 2, 24, 16, [(0, 20), (37, 5), (64, 70), (100, 1)], [None, 24])
check(f32, 4, 1, 80, 32, [(0, 3), (45, 30)], [None, 10])
kernels.PREFILL_BLOCK_M = 16  # several query tiles; a window skips whole key tiles for the later ones
check(f32, 3, 3, 12, 16, [(0, 50), (150, 40)], [None, 17])
kernels.PREFILL_BLOCK_M = 64
check(bf16, 4, 2, 128, 16, [(20, 33)], [None, 16])
# Soft-capped scores (cap 1.5), with and without a window, one and several query tiles
check(f32, 8, 2, 24, 16, [(0, 20), (37, 5), (64, 70)], [None, 24], softcap=1.5)
kernels.PREFILL_BLOCK_M = 16
check(f32, 3, 3, 12, 16, [(0, 50), (150, 40)], [None, 17], softcap=1.5)
kernels.PREFILL_BLOCK_M = 64
check(bf16, 4, 2, 128, 16, [(20, 33)], [None, 16], softcap=1.5)
print("OK")
"""

ENGINE_VS_HF = """
import json, sys
from tp_runtime import LLM, SamplingParams
prompts = json.loads(sys.argv[2])
engine_args = dict(device="cpu", dtype="float32", attention_backend="triton", cuda_graphs=sys.argv[3],
                   fused_kernels="triton", **json.loads(sys.argv[4]))
with LLM(sys.argv[1], **engine_args) as llm:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    preemptions = llm.engine.scheduler.num_preemptions
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "preemptions": preemptions}))
"""


def _run(script: str, *args: str, interpret: bool = True) -> str:
    if interpret:
        return run_interpreted(script, *args)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


# float32 must match exactly (only the RMSNorm sum's order differs). In bfloat16 Triton's interpreter
# rounds float32 -> bfloat16 toward zero, where CUDA (and PyTorch) round to nearest even, so bfloat16 is
# held to one bfloat16 step here; on CUDA the kernels round like PyTorch.
FUSED_VS_TORCH = """
import torch
from tp_runtime.layers import fused_triton
from tp_runtime.layers.activation import gelu_tanh_and_mul, silu_and_mul
from tp_runtime.layers.norm import GemmaRMSNorm, RMSNorm
from tp_runtime.layers.rotary import apply_rotary
torch.manual_seed(0)
def close(got, want, dtype, exact_tol=1e-6):
    tol = exact_tol if dtype == torch.float32 else 2 ** -6
    return torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
for dtype in (torch.float32, torch.bfloat16):
    norm = RMSNorm(96, 1e-5, dtype, torch.device("cpu"))
    norm.weight.data = torch.randn(96).to(dtype)
    x, res = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
    res_t, res_f = res.clone(), res.clone()
    want = norm(x, res_t)
    got = fused_triton.rms_norm(x, norm.weight, 1e-5, res_f)
    assert close(res_f, res_t, dtype, 0), dtype  # the residual stream: x + residual, in place
    assert close(got, want, dtype), (dtype, (got.float() - want.float()).abs().max())
    assert close(fused_triton.rms_norm(x, norm.weight, 1e-5), norm(x), dtype)
    # rotary on a strided view, as q/k are slices of the fused QKV output; head_dim 24: half not a power of 2
    for heads, head_dim in ((2, 16), (3, 24)):
        qkv = torch.randn(4, 3 * heads * head_dim).to(dtype)
        q = qkv[:, : heads * head_dim].view(4, heads, head_dim)
        cos, sin = torch.randn(4, head_dim), torch.randn(4, head_dim)
        want = apply_rotary(q.clone(), cos, sin)
        got = fused_triton.rotary_(q, cos, sin)
        assert got.data_ptr() == qkv.data_ptr()  # rotated in place
        assert close(got, want, dtype, 0), (dtype, head_dim, (got.float() - want.float()).abs().max())
    gate_up = torch.randn(3, 2 * 40).to(dtype)
    assert close(fused_triton.silu_and_mul(gate_up), silu_and_mul(gate_up), dtype), dtype
# Gemma: (1 + w) in float32, rounded once; GeGLU with the tanh GELU (large gates: both tails)
torch.manual_seed(1)
for dtype in (torch.float32, torch.bfloat16):
    x, res = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
    gemma = GemmaRMSNorm(96, 1e-6, dtype, torch.device("cpu"))
    gemma.weight.data = torch.randn(96).to(dtype)
    res_t, res_f = res.clone(), res.clone()
    want = gemma(x, res_t)
    got = fused_triton.rms_norm(x, gemma.weight, 1e-6, res_f, unit_offset=True)
    assert close(res_f, res_t, dtype, 0), dtype
    assert close(got, want, dtype), (dtype, (got.float() - want.float()).abs().max())
    assert close(fused_triton.rms_norm(x, gemma.weight, 1e-6, unit_offset=True), gemma(x), dtype)
    gate_up = (6 * torch.randn(3, 2 * 1100)).to(dtype)  # two column blocks
    got = fused_triton.gelu_tanh_and_mul(gate_up)
    if dtype == torch.float32:
        # Held to float64: where the gate is very negative PyTorch's 1 + tanh(u) cancels (~1e-3 relative
        # error on outputs near 0); the kernel's x / (1 + exp(-2u)) does not.
        want64 = gelu_tanh_and_mul(gate_up.double())
        assert torch.allclose(got.double(), want64, rtol=2e-6, atol=1e-6), (got.double() - want64).abs().max()
    else:
        want = gelu_tanh_and_mul(gate_up)
        assert close(got, want, dtype), (dtype, (got.float() - want.float()).abs().max())
print("OK")
"""


def test_kernel_matches_brute_force() -> None:
    assert _run(KERNEL_VS_BRUTE_FORCE) == "OK"


def test_split_kv_decode_matches_brute_force() -> None:
    assert _run(BRUTE_FORCE + DECODE_VS_BRUTE_FORCE, "cpu") == "OK"


def test_paged_prefill_matches_brute_force() -> None:
    assert _run(BRUTE_FORCE + PREFILL_VS_BRUTE_FORCE, "cpu") == "OK"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_paged_kernels_match_brute_force_on_cuda() -> None:
    """The same checks compiled for the GPU (CI has none; run it where there is one)."""
    assert _run(BRUTE_FORCE + DECODE_VS_BRUTE_FORCE, "cuda", interpret=False) == "OK"
    assert _run(BRUTE_FORCE + PREFILL_VS_BRUTE_FORCE, "cuda", interpret=False) == "OK"


def test_choose_num_splits() -> None:
    from tp_runtime.layers import paged_decode_triton as kernels
    from tp_runtime.layers.paged_decode_triton import choose_num_splits

    sms = 132
    # Enough (sequence, KV head) programs already: no split.
    assert choose_num_splits(64, 8, 2048, 16, sms) == 1
    assert choose_num_splits(512, 1, 2048, 16, sms) == 1
    # Fewer programs: more splits, never fewer as the batch shrinks.
    by_batch = [choose_num_splits(seqs, 8, 2048, 16, sms) for seqs in (32, 16, 8, 4, 2, 1)]
    assert by_batch == sorted(by_batch) and by_batch[0] >= 1 and by_batch[-1] > 4
    # Never more splits than the longest context has KV tiles.
    for blocks in (1, 2, 3, 5, 9, 40):
        for block_size in (16, 32, 64):
            splits = choose_num_splits(1, 1, blocks, block_size, sms)
            tiles = -(-blocks * block_size // kernels.DECODE_BLOCK_N)
            assert 1 <= splits <= max(1, tiles) and splits <= kernels.DECODE_MAX_SPLITS
    assert choose_num_splits(1, 8, 1, 16, sms) == 1  # one 16-token block: less than one tile
    assert choose_num_splits(1, 1, 10**6, 16, sms) == kernels.DECODE_MAX_SPLITS
    assert choose_num_splits(3, 2, 500, 32, sms) == choose_num_splits(3, 2, 500, 32, sms)  # deterministic
    # Every shape gets a power of two (one compiled kernel each), at least half of what the bounds allow.
    for seqs in range(1, 80):
        for blocks in (1, 3, 4, 7, 40, 129, 512, 4000):
            splits = choose_num_splits(seqs, 8, blocks, 16, sms)
            tiles = -(-blocks * 16 // kernels.DECODE_BLOCK_N)
            bound = max(1, min(-(-2 * sms // (seqs * 8)), tiles, kernels.DECODE_MAX_SPLITS))
            assert splits & (splits - 1) == 0 and bound / 2 < splits <= bound, (seqs, blocks, splits)


def test_fused_kernels_match_pytorch_ops() -> None:
    assert _run(FUSED_VS_TORCH) == "OK"


# Chunked prefill (16-token budget) and preemption (6 blocks of 8 tokens for two 5-block sequences):
# continuation chunks and resumed requests go through the paged prefill kernel.
CHUNKED_PREEMPTED = {
    "max_num_batched_tokens": 16, "num_kv_blocks": 6, "block_size": 8, "max_num_seqs": 2, "max_model_len": 48
}  # fmt: skip


@pytest.mark.parametrize(
    ("graphs", "engine_args"), [("off", {}), ("padded", {}), ("padded", CHUNKED_PREEMPTED)]
)
@pytest.mark.parametrize(
    ("arch", "overrides"), [("LlamaForCausalLM", {}), ("MistralForCausalLM", {"sliding_window": 8})]
)
def test_engine_with_triton_kernels_matches_hf(
    make_checkpoint: Callable[..., Path],
    arch: str,
    overrides: dict[str, int],
    graphs: str,
    engine_args: dict[str, int],
) -> None:
    import json

    model_dir = make_checkpoint(arch, **overrides)
    if engine_args:
        prompts = [list(range(3, 30)), list(range(5, 35)), [5, 9, 200]]
    else:
        prompts = [[5, 9, 200], [7] * 20, list(range(3, 40))]
    got = json.loads(_run(ENGINE_VS_HF, str(model_dir), json.dumps(prompts), graphs, json.dumps(engine_args)))
    assert (got["preemptions"] > 0) == bool(engine_args)
    got = got["tokens"]
    assert got == hf_greedy(model_dir, prompts, 8)



@pytest.mark.parametrize(("graphs", "engine_args"), [("off", {}), ("padded", CHUNKED_PREEMPTED)])
def test_engine_with_triton_kernels_matches_hf_gemma2(
    make_checkpoint: Callable[..., Path], graphs: str, engine_args: dict[str, int]
) -> None:
    """Gemma 2 (windowed and global layers, both soft-caps) through the Triton attention kernels and the
    fused (1 + w) RMSNorm and GeGLU kernels, against HF's eager attention (SDPA drops the soft-cap)."""
    import json

    model_dir = make_checkpoint("Gemma2ForCausalLM", **GEMMA2)
    prompts = [list(range(3, 30)), list(range(5, 35)), [5, 9, 200]]
    got = json.loads(_run(ENGINE_VS_HF, str(model_dir), json.dumps(prompts), graphs, json.dumps(engine_args)))
    assert (got["preemptions"] > 0) == bool(engine_args)
    want = hf_greedy(model_dir, prompts, 8, attn_implementation="eager")
    assert got["tokens"] == want
