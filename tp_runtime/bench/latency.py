"""`tp-runtime bench latency`: end-to-end latency of one batch, flags named like vLLM's benchmark_latency.

Besides the latency percentiles it reports where each decode step's time goes (driver and rank-0 worker
phases) and the host gap: how long the device sits idle between one step's forward and the next.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from tp_runtime.bench import write_json

PERCENTILES = (10, 25, 50, 75, 90, 99)
# Phases of one decode step, in the order they happen.
BREAKDOWN_FIELDS = (
    "schedule",
    "encode_broadcast",
    "worker_prepare_inputs",
    "worker_forward_dispatch",
    "worker_bookkeeping",
    "worker_sync_wait",
    "worker_forward_device",
    "wait_output",  # the driver waiting for rank 0's output
    "reply_transport",  # round trip minus broadcast minus rank 0's own phases: sockets, decode, skew
    "engine_update",
    "step_total",
    "overhead",
    "worker_host_gap",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tp_runtime.engine.args import add_engine_arguments

    add_engine_arguments(parser)  # every EngineArgs option, --async-scheduling among them
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    parser.add_argument("--num-iters-warmup", type=int, default=2, help="untimed runs first")
    parser.add_argument("--num-iters", type=int, default=5, help="timed runs")
    parser.add_argument(
        "--output-json", type=str, default=None, help="also write every figure here (default: no file)"
    )
    parser.add_argument(
        "--bookkeeping-order",
        choices=("overlap", "sync_first"),
        default="overlap",
        help="overlap: value-free bookkeeping before the device->host sync; sync_first: the order it "
        "replaced",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def check(args: argparse.Namespace) -> None:
    """What the engine would refuse only after loading the model (`args.model_config`: the CLI's checks
    resolved the model)."""
    from tp_runtime.errors import ConfigError

    model_config = args.model_config
    total = args.input_len + args.output_len
    if total > model_config.max_model_len:
        raise ConfigError(
            f"--input-len {args.input_len} + --output-len {args.output_len} = {total} tokens exceed the "
            f"model's max_model_len={model_config.max_model_len}"
        )


def summarize_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each phase over decode-only steps (seconds). With async scheduling the batch's last engine
    step only reads the output sent before (nothing new runs); it is left out."""
    decode = [dict(s) for s in steps if s.get("decode_only") and not s.get("drain")]
    worker_phases = (
        "worker_prepare_inputs",
        "worker_forward_dispatch",
        "worker_bookkeeping",
        "worker_sync_wait",
    )
    for s in decode:
        # With async scheduling the round trip spans two steps, so it does not split into phases.
        if all(k in s for k in worker_phases) and not s.get("async_scheduling"):
            s["reply_transport"] = (
                s["execute_roundtrip"] - s.get("encode_broadcast", 0.0) - sum(s[k] for k in worker_phases)
            )
    out: dict[str, float] = {"num_decode_steps": float(len(decode))}
    for name in BREAKDOWN_FIELDS:
        values = [s[name] for s in decode if name in s]
        if values:
            out[name] = float(np.mean(values))
    return out


def decode_roofline(
    traffic: dict[str, float],
    batch_size: int,
    input_len: int,
    output_len: int,
    sliding_window: int | None,
    step_s: float,
) -> dict[str, float]:
    """How close a decode step runs to the memory roofline on one GPU: the bytes it must read there (the
    rank's weights, plus every sequence's keys and values up to its position, averaged over the decode
    steps) at the copy bandwidth measured on the spot, against the measured step time."""
    # Decode step j (1..output_len-1) attends over input_len + j cached positions (window-capped).
    contexts = np.arange(input_len + 1, input_len + output_len)
    if sliding_window is not None:
        contexts = np.minimum(contexts, sliding_window)
    mean_context = float(contexts.mean()) if len(contexts) else 0.0
    kv_bytes = batch_size * mean_context * traffic["kv_bytes_per_token"]
    step_bytes = traffic["weight_bytes"] + kv_bytes
    roofline_s = step_bytes / traffic["copy_bandwidth"]
    return {
        "weight_bytes": traffic["weight_bytes"],
        "kv_bytes": kv_bytes,
        "step_bytes": step_bytes,
        "copy_bandwidth": traffic["copy_bandwidth"],
        "roofline_step": roofline_s,
        "step": step_s,
        "fraction": roofline_s / step_s if step_s > 0 else float("nan"),
    }


def run_config(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """What a benchmark's JSON records of the engine it ran and the lengths it asked for."""
    return {
        "model": str(llm.config.model.path),
        "tensor_parallel_size": llm.config.parallel.tensor_parallel_size,
        "dtype": llm.config.model.dtype,
        "device": llm.config.device,
        "input_len": args.input_len,
        "output_len": args.output_len,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from tp_runtime import SamplingParams
    from tp_runtime.engine.args import build_llm

    llm = build_llm(args)
    try:
        llm.engine.executor.collective_rpc("set_bookkeeping_order", [args.bookkeeping_order])
        vocab = llm.config.model.vocab_size
        rng = np.random.default_rng(0)
        prompts = [
            {"prompt_token_ids": rng.integers(3, vocab, size=args.input_len).tolist()}
            for _ in range(args.batch_size)
        ]
        params = SamplingParams(
            temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len, seed=None
        )

        def one_run() -> float:
            # Each run computes its prompts, as the first did (and as the HF peer does): the same prompts
            # again would otherwise come from the prefix cache.
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start

        for _ in tqdm(range(args.num_iters_warmup), desc="warmup", disable=args.no_progress):
            one_run()
        kv = llm.engine.scheduler.kv
        queried, hit = kv.num_queried_tokens, kv.num_hit_tokens
        latencies = [
            one_run() for _ in tqdm(range(args.num_iters), desc="iterations", disable=args.no_progress)
        ]
        looked_up = kv.num_queried_tokens - queried
        hit_rate = (kv.num_hit_tokens - hit) / looked_up if looked_up else 0.0
        # One more run with step accounting on, so the timed runs above carry no measuring overhead.
        llm.engine.executor.collective_rpc("set_collect_timings", [True])
        llm.engine.step_timings = []
        breakdown_latency = one_run()
        steps = llm.engine.step_timings
        llm.engine.step_timings = None
        llm.engine.executor.collective_rpc("set_collect_timings", [False])
        traffic = llm.engine.executor.collective_rpc("decode_traffic")[0]
    finally:
        llm.shutdown()
    breakdown = summarize_steps(steps)
    result: dict[str, Any] = {
        "avg_latency": float(np.mean(latencies)),
        "latencies": latencies,
        "percentiles": {str(p): float(np.percentile(latencies, p)) for p in PERCENTILES},
        # Prompt tokens of the timed runs found in the prefix cache (the cache is reset before each run).
        "prefix_cache_hit_rate": hit_rate,
        "config": {
            **run_config(llm, args),
            "batch_size": args.batch_size,
            "bookkeeping_order": args.bookkeeping_order,
            "async_scheduling": args.async_scheduling,
            "load_format": llm.config.model.load_format,
        },
        "breakdown_run_latency": breakdown_latency,
        "decode_step_breakdown": breakdown,
        "decode_roofline": decode_roofline(
            traffic, args.batch_size, args.input_len, args.output_len, llm.config.model.sliding_window,
            breakdown.get("step_total", float("nan")),
        ),
        "steps": steps,
    }  # fmt: skip
    return result


def print_report(result: dict[str, Any]) -> None:
    print(f"Avg latency: {result['avg_latency']:.4f} seconds")
    print(f"Prefix cache hit rate: {100 * result['prefix_cache_hit_rate']:.1f} % (reset before each run)")
    for p, v in result["percentiles"].items():
        print(f"{p}% percentile latency: {v:.4f} seconds")
    b = result["decode_step_breakdown"]
    print(f"\nDecode step breakdown (mean over {int(b['num_decode_steps'])} decode steps, microseconds):")
    for name in BREAKDOWN_FIELDS:
        if name in b:
            print(f"  {name:<26}{b[name] * 1e6:12.1f}")
    if "worker_host_gap" in b and b.get("step_total"):
        print(f"  host gap / step time: {100 * b['worker_host_gap'] / b['step_total']:.2f} %")
    if result["config"]["device"] != "cuda":
        return  # a CPU's step is bound by its compute, not by memory bandwidth (the JSON still has it)
    r = result["decode_roofline"]
    print(
        f"\nDecode roofline (per GPU): {r['weight_bytes'] / 1e9:.3f} GB weights + "
        f"{r['kv_bytes'] / 1e9:.3f} GB KV per step at {r['copy_bandwidth'] / 1e12:.2f} TB/s "
        "measured copy bandwidth = "
        f"{r['roofline_step'] * 1e3:.3f} ms; measured step {r['step'] * 1e3:.3f} ms: "
        f"{100 * r['fraction']:.1f} % of roofline"
    )


def main(args: argparse.Namespace) -> None:
    result = run(args)
    if result is None:
        return
    print_report(result)
    if args.output_json:
        write_json(args.output_json, result)
