"""`fused_triton.rotary_and_cache_` (rotary on q and k plus the KV-cache write, one launch) against the
PyTorch ops it replaces: `apply_rotary` on q and k, then `write_kv`.

Run by Triton's CPU interpreter in a subprocess (TRITON_INTERPRET must be set before Triton is imported).
The same script runs on CUDA with the device as its argument (`python -c "$SCRIPT" cuda`, see `CHECKS`).

Rounding. float32 and float16 must match PyTorch bit for bit. In bfloat16 Triton's interpreter rounds
float32 -> bfloat16 toward zero where CUDA and PyTorch round to nearest even, so on CPU bfloat16 is held
to exact equality with (a) the PyTorch op sequence with every bfloat16 rounding done toward zero (which
shows the kernel rounds at the same points as PyTorch) and (b) the unfused `rotary_` kernel; against
PyTorch itself it is held to 2^-5 * max|x| (a few roundings of < 2^-7 relative each that may go the other
way). On CUDA every dtype must match PyTorch exactly (the script passed on an H200 with Triton 3.6).
"""

from __future__ import annotations

import importlib.util

import pytest
from conftest import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

CHECKS = """
import sys, torch
from tp_runtime.layers import fused_triton
from tp_runtime.layers.attention import write_kv
from tp_runtime.layers.rotary import apply_rotary
device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
interpreted = device.type == "cpu"
torch.manual_seed(0)

def rtz_bf16(t):  # float32 -> bfloat16 rounded toward zero, as Triton's interpreter rounds
    return (t.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)

def rotary_rtz(x, cos, sin):  # apply_rotary's ops, each rounded to bfloat16 toward zero
    c, s = rtz_bf16(cos).float().unsqueeze(1), rtz_bf16(sin).float().unsqueeze(1)
    a = x.float()
    half = a.shape[-1] // 2
    rotated = torch.cat((-a[..., half:], a[..., :half]), dim=-1)
    return rtz_bf16(rtz_bf16(a * c).float() + rtz_bf16(rotated * s).float())

def same(got, want, what):  # bit for bit (so -0.0 is not 0.0)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    as_int = {2: torch.int16, 4: torch.int32}[got.element_size()]
    bad = got.contiguous().view(as_int) != want.contiguous().view(as_int)
    assert not bad.any(), (what, int(bad.sum()), (got.float() - want.float()).abs().max().item())

T, BS, NB = 7, 4, 6  # 7 tokens over 24 cache slots in 6 blocks
cases = 0
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for head_dim in (8, 12, 24, 64, 80, 128):
        for heads, kv_heads, slot_kind in ((8, 2, "int64"), (8, 1, "int64"), (3, 3, "int32"), (5, 1, "skip")):
            qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
            q = qkv[:, : heads * head_dim].view(T, heads, head_dim)
            k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(T, kv_heads, head_dim)
            v = qkv[:, (heads + kv_heads) * head_dim :].view(T, kv_heads, head_dim)
            # Real rotary tables at random positions, gathered as RotaryEmbedding.cos_sin does.
            inv_freq = 10000.0 ** -(torch.arange(0, head_dim, 2, device=device).float() / head_dim)
            freqs = torch.arange(4096, device=device).float()[:, None] * inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            positions = torch.randint(0, 4096, (T,), device=device)
            cos, sin = emb.cos()[positions], emb.sin()[positions]
            slots = torch.randperm(NB * BS, device=device)[:T]
            if slot_kind == "skip":  # slot < 0: rotated, not cached
                slots[[1, 4]] = -1
            if slot_kind == "int32":
                slots = slots.int()
            k_cache = torch.randn(NB, BS, kv_heads, head_dim, device=device).to(dtype)
            v_cache = torch.randn(NB, BS, kv_heads, head_dim, device=device).to(dtype)
            q0, k0, v0, kc0, vc0 = q.clone(), k.clone(), v.clone(), k_cache.clone(), v_cache.clone()

            want_q, want_k = apply_rotary(q0, cos, sin, fused=False), apply_rotary(k0, cos, sin, fused=False)
            want_kc, want_vc = kc0.clone(), vc0.clone()
            cached = slots >= 0
            write_kv(want_kc, want_vc, want_k[cached], v0[cached], slots[cached].long())

            fused_triton.rotary_and_cache_(q, k, v, cos, sin, k_cache, v_cache, slots)
            what = (dtype, head_dim, heads, kv_heads, slot_kind)
            # q and k rotated in place inside the fused buffer, v untouched
            same(qkv, torch.cat([q.reshape(T, -1), k.reshape(T, -1), v0.reshape(T, -1)], dim=1), what)
            same(v, v0, what)
            # the unfused kernel (shared helpers) gives the same bits
            same(q, fused_triton.rotary_(q0.clone(), cos, sin), ("q vs rotary_", *what))
            same(k, fused_triton.rotary_(k0.clone(), cos, sin), ("k vs rotary_", *what))
            # untouched cache slots keep their contents
            untouched = torch.ones(NB * BS, dtype=torch.bool, device=device)
            untouched[slots[cached].long()] = False
            for cache, before in ((k_cache, kc0), (v_cache, vc0)):
                same(cache.view(NB * BS, -1)[untouched], before.view(NB * BS, -1)[untouched], what)
            same(v_cache, want_vc, ("v_cache", *what))  # a copy: exact in every dtype
            if dtype == torch.bfloat16 and interpreted:
                same(q, rotary_rtz(q0, cos, sin), ("q vs rtz", *what))
                same(k, rotary_rtz(k0, cos, sin), ("k vs rtz", *what))
                kc_rtz, k_rtz = kc0.clone(), rotary_rtz(k0, cos, sin)
                write_kv(kc_rtz, vc0.clone(), k_rtz[cached], v0[cached], slots[cached].long())
                same(k_cache, kc_rtz, ("k_cache vs rtz", *what))
                for got, want, x in ((q, want_q, q0), (k, want_k, k0), (k_cache, want_kc, kc0)):
                    tol = 2**-5 * max(x.float().abs().max().item(), k0.float().abs().max().item())
                    err = (got.float() - want.float()).abs().max().item()
                    assert err <= tol, (what, err, tol)
            else:
                same(q, want_q, ("q", *what))
                same(k, want_k, ("k", *what))
                same(k_cache, want_kc, ("k_cache", *what))
            cases += 1

# no tokens: nothing launched; bad layouts are refused before any launch
empty, no_table = torch.empty(0, 2, 8, device=device), torch.empty(0, 8, device=device)
cache = torch.zeros(1, 4, 2, 8, device=device)
no_slots = torch.empty(0, dtype=torch.long, device=device)
fused_triton.rotary_and_cache_(empty, empty, empty, no_table, no_table, cache, cache.clone(), no_slots)
assert not cache.any()
x = torch.randn(2, 2, 8, device=device)
cs = torch.randn(2, 8, device=device)
cs_t = cs.t().contiguous().t()
slots = torch.tensor([0, 1], device=device)
x_t = x.transpose(1, 2).contiguous().transpose(1, 2)
for args in ((x_t, x, x, cs, cs, cache, cache, slots),  # heads strided
             (x, x, x, cs_t, cs_t, cache, cache, slots),  # cos/sin columns strided
             (x, x, x, cs, cs, cache.transpose(0, 1), cache, slots),  # not addressable by flat slot
             (x, x, x[:, :1], cs, cs, cache, cache, slots),  # v shape
             (x, x, x, cs, cs, cache, cache, slots.float())):
    try:
        fused_triton.rotary_and_cache_(*args)
    except ValueError:
        continue
    raise AssertionError("bad layout accepted")
print("OK", cases)
"""


def test_rotary_and_cache_matches_pytorch_ops() -> None:
    assert run_interpreted(CHECKS, "cpu") == "OK 72"
