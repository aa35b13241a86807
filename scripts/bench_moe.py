"""Time one mixture-of-experts layer on the GPU: bf16 experts (torch._grouped_mm) against FP8 experts, in
the same process: per-channel scales through each of the two FP8 paths (the Triton grouped W8A8 GEMM,
torch._scaled_grouped_mm) whatever the engine would pick, and 128x128 block scales (Triton only).

Each (shape, token count) is timed as CUDA graph replays of the layer's forward (routing, both expert
matmuls, activation quantization, the weighted sum), median over repeats, with random router weights
(close to uniform routing). `weights read` is the bytes of the experts the step's tokens chose at the
layer's storage size, and TB/s that over the time: what bounds a decode step's layer.

    python3 scripts/bench_moe.py --shapes mixtral-8x7b qwen3-30b-a3b --tokens 1 8 32 256 2048
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from tp_runtime.config import QuantConfig
from tp_runtime.distributed import TPGroup
from tp_runtime.layers import moe
from tp_runtime.layers.moe import SparseMoE
from tp_runtime.layers.quantization import UNQUANTIZED, LinearMethod
from tp_runtime.layers.quantization.fp8 import Fp8LinearMethod

# hidden, expert width, experts, top-k, Mixtral's routing
SHAPES = {
    "mixtral-8x7b": (4096, 14336, 8, 2, True),
    "qwen3-30b-a3b": (2048, 768, 128, 8, False),
}


def build(shape: str, method: LinearMethod) -> SparseMoE:
    hidden, inter, experts, top_k, mixtral = SHAPES[shape]
    device = torch.device("cuda")
    layer = SparseMoE(
        hidden, inter, experts, top_k, renormalize=mixtral, fp32_weights=mixtral,
        expert_names=("w1", "w3", "w2"), tp=TPGroup(), dtype=torch.bfloat16, device=device, fused=True,
        method=method,
    )  # fmt: skip
    gen = torch.Generator(device).manual_seed(0)
    for name, param in layer.named_parameters():
        if param.dtype == torch.float8_e4m3fn:
            param.data.copy_((torch.randn(param.shape, generator=gen, device=device) * 64).to(param.dtype))
        elif name.endswith("_scale"):
            param.data.fill_(1e-3)
        else:
            param.data.copy_(torch.randn(param.shape, generator=gen, device=device) * 0.02)
    return layer


def time_layer(layer: SparseMoE, tokens: int, repeats: int, cutlass: bool | None = None) -> tuple[float, int]:
    """(median µs per forward, bytes of the chosen experts' weights). `cutlass`: FP8 experts through
    torch._scaled_grouped_mm (True) or the Triton GEMM (False) at any size; None: the engine's choice."""
    x = torch.randn(tokens, layer.hidden_size, device="cuda").to(torch.bfloat16)
    chosen, threshold = layer._scaled_grouped_mm, moe.FP8_CUTLASS_PAIRS_PER_EXPERT
    if cutlass is not None:  # read when the graph is recorded
        layer._scaled_grouped_mm, moe.FP8_CUTLASS_PAIRS_PER_EXPERT = cutlass, 0
    try:
        with torch.no_grad():
            layer(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                layer(x)
            _, ids = layer.route(x)
    finally:
        layer._scaled_grouped_mm, moe.FP8_CUTLASS_PAIRS_PER_EXPERT = chosen, threshold
    hit = ids.unique().numel()
    per_expert = sum(
        t[0].numel() * t.element_size() for t in (layer.w13, layer.w2, layer.w13_scale, layer.w2_scale)
        if t is not None
    )  # fmt: skip
    inner = max(1, 2000 // max(1, tokens))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(inner):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / inner)
    return statistics.median(times), hit * per_expert


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    channel = Fp8LinearMethod.for_device(QuantConfig("compressed-tensors", "channel"), device)
    methods: dict[str, tuple[LinearMethod, bool | None]] = {
        "bf16": (UNQUANTIZED, None),
        "fp8 channel, Triton": (channel, False),
        "fp8 channel, _scaled_grouped_mm": (channel, True),
        "fp8 block": (Fp8LinearMethod.for_device(QuantConfig("fp8", "block", (128, 128)), device), None),
    }
    rows = []
    for shape in args.shapes:
        for name, (method, cutlass) in methods.items():
            layer = build(shape, method)
            for tokens in args.tokens:
                us, read = time_layer(layer, tokens, args.repeats, cutlass)
                row = {
                    "shape": shape, "experts": name, "impl": layer.impl, "tokens": tokens, "us": round(us, 1),
                    "weights_read_mb": round(read / 1e6, 1), "tb_per_s": round(read / us / 1e6, 2),
                }  # fmt: skip
                rows.append(row)
                print(row, flush=True)
            del layer
            torch.cuda.empty_cache()
    print("| shape | tokens | " + " | ".join(f"{m} µs (TB/s)" for m in methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for shape in args.shapes:
        for tokens in args.tokens:
            cells = [
                f"{r['us']} ({r['tb_per_s']})"
                for m in methods
                for r in rows
                if r["shape"] == shape and r["tokens"] == tokens and r["experts"] == m
            ]
            print(f"| {shape} | {tokens} | " + " | ".join(cells) + " |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
