"""Fresh-prompt attention on CUDA, per candidate: the cost of a prompt length seen for the first time
against a repeat (issue: no per-shape setup). One layer of Llama-3-8B's shape (32 query heads, 8 KV heads,
head_dim 128, bf16), causal over the prompt's own keys.

    python scripts/bench_prefill_attention.py --output-json prefill_attention.json

Candidates: SDPA as the engine calls it today (torch's choice: cuDNN on Hopper), SDPA pinned to
FlashAttention, SDPA pinned to memory-efficient attention, and the engine's Triton paged prefill kernel
reading the keys from cache blocks. Each first call at a new length is timed alone (synchronized), then
the median of repeats; lengths are random in 52..972, fresh for every candidate's cold pass.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tp_runtime.layers.paged_decode_triton import paged_prefill_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _sdpa(backends: list[SDPBackend] | None) -> Attention:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        if backends is None:
            return F.scaled_dot_product_attention(*args, is_causal=True, enable_gqa=True)
        # FlashAttention through SDPA takes no enable_gqa: the KV heads repeated, as part of its cost.
        q_, k_, v_ = args
        k_, v_ = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k_, v_))
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)

    return run


def _triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    n = q.shape[0]
    blocks = (n + BLOCK - 1) // BLOCK
    k_cache = torch.zeros((blocks, BLOCK, KV_HEADS, HEAD_DIM), dtype=q.dtype, device=q.device)
    v_cache = torch.zeros_like(k_cache)
    k_cache.view(-1, KV_HEADS, HEAD_DIM)[:n] = k
    v_cache.view(-1, KV_HEADS, HEAD_DIM)[:n] = v
    table = torch.arange(blocks, dtype=torch.int32, device=q.device)
    return paged_prefill_attention(q, k_cache, v_cache, table, 0, HEAD_DIM**-0.5, None)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    n = q.shape[0]
    cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    return varlen_attn(q, k, v, cu, cu, n, n, scale=HEAD_DIM**-0.5, window_size=(-1, 0), enable_gqa=True)


def _flash_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """aten's varlen FlashAttention forward, which takes fewer KV heads than query heads."""
    n = q.shape[0]
    cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, n, n, 0.0, True, False, scale=HEAD_DIM**-0.5
    )
    return out[0]


def _inputs(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(n)
    def make(heads: int) -> torch.Tensor:
        return torch.randn((n, heads, HEAD_DIM), generator=g, device="cuda", dtype=torch.bfloat16)
    return make(HEADS), make(KV_HEADS), make(KV_HEADS)


def _timed(fn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(q, k, v)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-lengths", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    candidates = {
        "sdpa (torch's choice)": _sdpa(None),
        "sdpa flash": _sdpa([SDPBackend.FLASH_ATTENTION]),
        "sdpa efficient": _sdpa([SDPBackend.EFFICIENT_ATTENTION]),
        "triton paged prefill": _triton,
        "aten flash varlen (GQA)": _flash_op,
    }
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        print("varlen_attn:", inspect.signature(varlen_attn))
        candidates["torch varlen_attn (GQA)"] = _varlen
    except ImportError as exc:
        print("no torch.nn.attention.varlen:", exc)
    # Everything compiled and initialised once, at a length no cold pass uses.
    warm = _inputs(40)
    for name, fn in list(candidates.items()):
        try:
            fn(*warm)
        except Exception as exc:  # a candidate this torch lacks
            print(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")
            del candidates[name]
    reference = {}
    results = {}
    rng = random.Random(0)
    for name, fn in candidates.items():
        lengths = rng.sample(range(52, 973), args.num_lengths)
        cold, repeat, err = [], [], 0.0
        for n in lengths:
            q, k, v = _inputs(n)
            cold.append(_timed(fn, q, k, v))
            repeat.append(statistics.median(_timed(fn, q, k, v) for _ in range(args.repeats)))
        for n in (128, 1000):  # accuracy against the default SDPA at two lengths, and the 1000-token cost
            q, k, v = _inputs(n)
            out = fn(q, k, v)
            out = out[0].transpose(0, 1) if out.dim() == 4 else out
            if n not in reference:
                reference[n] = out
            err = max(err, (out.float() - reference[n].float()).abs().max().item())
        q, k, v = _inputs(1000)
        t1000 = statistics.median(_timed(fn, q, k, v) for _ in range(args.repeats))
        results[name] = {
            "cold_median_ms": 1e3 * statistics.median(cold),
            "repeat_median_ms": 1e3 * statistics.median(repeat),
            "cold_over_repeat": statistics.median(c / r for c, r in zip(cold, repeat, strict=True)),
            "len1000_ms": 1e3 * t1000,
            "max_abs_diff_vs_default": err,
        }
    print(f"{'candidate':<24}{'cold ms':>10}{'repeat ms':>11}{'cold/rep':>10}{'1000 tok ms':>13}"
          f"{'max diff':>10}")  # fmt: skip
    for name, r in results.items():
        print(f"{name:<24}{r['cold_median_ms']:>10.3f}{r['repeat_median_ms']:>11.3f}{r['cold_over_repeat']:>10.2f}"
              f"{r['len1000_ms']:>13.3f}{r['max_abs_diff_vs_default']:>10.4f}")  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            about = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
            json.dump({**about, **results}, f, indent=2)


if __name__ == "__main__":
    main()
