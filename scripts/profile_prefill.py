"""Where a prefill step's device time goes (torch.profiler), against one large bf16 matmul's rate.

python scripts/profile_prefill.py --model llama-3-8b --prompts 16 --input-len 512

Each pass sends prompts never seen before (prefix caching off), one token out each, so the profiled pass is
the prefill step(s) alone. Kernels are grouped as matmuls (cuBLAS), Triton kernels and the rest; the
matmuls' rate counts the linear layers' FLOPs of a Llama-shaped config (the LM head of one row a prompt
left out). The peer is one 8192 x hidden x 2*intermediate bf16 matmul in the same process.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import numpy as np
import torch


def read_config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def linear_flops_per_token(cfg: dict) -> float:
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    per_layer = (
        hidden * (heads + 2 * kv) * head_dim
        + heads * head_dim * hidden
        + 3 * hidden * cfg["intermediate_size"]
    )
    return 2.0 * per_layer * layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--rows", type=int, default=12, help="kernels listed")
    parser.add_argument("--quantization", default=None, choices=[None, "fp8"])
    args = parser.parse_args()

    from tp_runtime import LLM, SamplingParams
    from tp_runtime.models_catalog import resolve_model_name

    folder = resolve_model_name(args.model, "dummy")
    llm = LLM(
        folder,
        load_format="dummy",
        dtype="bfloat16",
        enable_prefix_caching=False,
        quantization=args.quantization,
    )
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prompts(seed: int) -> list[dict[str, list[int]]]:
        rng = np.random.default_rng(seed)
        return [
            {"prompt_token_ids": rng.integers(3, 30000, args.input_len).tolist()} for _ in range(args.prompts)
        ]

    llm.generate(prompts(1), params, use_tqdm=False)  # warm-up
    for seed in (2, 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts(seed), params, use_tqdm=False)
        torch.cuda.synchronize()
        print(f"{args.prompts} x {args.input_len} tokens: {(time.perf_counter() - start) * 1e3:.1f} ms wall")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts(4), params, use_tqdm=False)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels)  # us
    groups: collections.Counter[str] = collections.Counter()
    names: collections.Counter[str] = collections.Counter()
    for e in kernels:
        name = e.name.lower()
        matmul = any(s in name for s in ("gemm", "cutlass", "xmma", "nvjet"))
        groups["matmuls" if matmul else "triton" if name.startswith("_") else "other"] += e.device_time
        names[e.name[:80]] += e.device_time
    print(f"device busy {busy / 1e3:.2f} ms in {len(kernels)} kernels")
    for group, t in groups.most_common():
        print(f"  {group:8s} {t / 1e3:8.2f} ms  {100 * t / busy:5.1f} %")
    for name, t in names.most_common(args.rows):
        print(f"  {t / 1e3:8.2f} ms  {name}")
    cfg = read_config(folder)
    flops = args.prompts * args.input_len * linear_flops_per_token(cfg)
    rate = flops / (groups["matmuls"] / 1e6) / 1e12
    print(
        f"linear layers {flops / 1e12:.1f} TFLOP: {rate:.0f} TFLOP/s in the matmuls, "
        f"{flops / (busy / 1e6) / 1e12:.0f} over the busy time"
    )
    a = torch.randn(8192, cfg["hidden_size"], device="cuda", dtype=torch.bfloat16)
    b = torch.randn(cfg["hidden_size"], 2 * cfg["intermediate_size"], device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    dt = (time.perf_counter() - start) / 20
    print(
        f"peer: one {tuple(a.shape)} x {tuple(b.shape)} matmul {dt * 1e3:.2f} ms, "
        f"{2 * a.shape[0] * a.shape[1] * b.shape[1] / dt / 1e12:.0f} TFLOP/s"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
