"""Time to first token of a prompt whose length the engine has not seen, against the same length again:
`LLM.generate(max_tokens=1)` one prompt at a time, and HF transformers' forward over the same prompts as
the peer in the same process.

    python scripts/bench_fresh_prompts.py --model llama-3-8b --num-lengths 20 --output-json fresh.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

import torch

from tp_runtime import LLM, SamplingParams


def _median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--num-lengths", type=int, default=20)
    parser.add_argument("--min-len", type=int, default=52)
    parser.add_argument("--max-len", type=int, default=972)
    parser.add_argument("--small-len", type=int, default=145,
                        help="also time a prompt of this length, 10 times (its TTFT against its compute)")
    parser.add_argument("--no-hf", action="store_true", help="leave out the HF transformers peer")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="room for the HF peer after the engine (its memory goes with the process)")
    args = parser.parse_args()
    extra: dict[str, object] = {
        "enforce_eager": args.enforce_eager, "gpu_memory_utilization": args.gpu_memory_utilization
    }
    rng = random.Random(0)
    lengths = rng.sample(range(args.min_len, args.max_len + 1), args.num_lengths)
    vocab = 120000
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", max_model_len=2048, **extra)  # type: ignore[arg-type]
    startup = time.perf_counter() - start
    llm.generate([{"prompt_token_ids": [5] * 17}], params, use_tqdm=False)  # one warm-up length

    def ttft(ids: list[int]) -> float:
        llm.reset_prefix_cache()  # a repeat measures the same length computed again, not a cache hit
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return time.perf_counter() - t

    first = [ttft(p) for p in prompts]
    again = [ttft(p) for p in prompts]
    small = [rng.randrange(3, vocab) for _ in range(args.small_len)]
    small_times = [ttft(small) for _ in range(10)]
    # Its compute: the device time of its step's forward (CUDA events around it), timed apart from the
    # TTFTs above so that the events add nothing to them.
    llm.engine.executor.collective_rpc("set_collect_timings", [True])
    llm.engine.step_timings = []
    for _ in range(10):
        ttft(small)
    small_device = [e["worker_forward_device"] for e in llm.engine.step_timings
                    if e.get("num_scheduled_tokens") == args.small_len and "worker_forward_device" in e]
    llm.engine.step_timings = None
    llm.engine.executor.collective_rpc("set_collect_timings", [False])
    result: dict[str, object] = {
        "lengths": lengths,
        "engine_options": extra,
        "startup_s": startup,
        "engine_first_ms": _median_ms(first),
        "engine_repeat_ms": _median_ms(again),
        "small_len": args.small_len,
        "engine_small_ms": _median_ms(small_times),
        "engine_small_forward_device_ms": _median_ms(small_device) if small_device else None,
        "engine_first_each_ms": [1e3 * x for x in first],
        "engine_repeat_each_ms": [1e3 * x for x in again],
    }
    llm.shutdown()
    gc.collect()
    torch.cuda.empty_cache()
    if not args.no_hf:
        import transformers

        from tp_runtime.presets import preset_hf_config

        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(preset_hf_config(args.model)).to(torch.bfloat16).eval()

        @torch.inference_mode()
        def hf(ids: list[int]) -> float:
            x = torch.tensor([ids], device="cuda")
            torch.cuda.synchronize()
            t = time.perf_counter()
            model(x).logits[:, -1].argmax(-1).tolist()
            return time.perf_counter() - t

        hf([5] * 17)
        hf_first = [hf(p) for p in prompts]
        hf_again = [hf(p) for p in prompts]
        hf_small = [hf(small) for _ in range(10)]
        result.update(hf_first_ms=_median_ms(hf_first), hf_repeat_ms=_median_ms(hf_again),
                      hf_small_ms=_median_ms(hf_small))
    print(f"startup {startup:.1f} s; median TTFT over {len(lengths)} lengths {min(lengths)}-{max(lengths)}:")
    first_ms, repeat_ms = result["engine_first_ms"], result["engine_repeat_ms"]
    small_ms = result["engine_small_ms"]
    device_ms = result["engine_small_forward_device_ms"]
    compute = "" if device_ms is None else f" (its forward on the device: {device_ms:.2f} ms)"
    print(f"  tp_runtime: first {first_ms:.1f} ms, repeat {repeat_ms:.1f} ms; "
          f"{args.small_len} tokens {small_ms:.1f} ms{compute}")
    if "hf_first_ms" in result:
        print(f"  HF forward: first {result['hf_first_ms']:.1f} ms, repeat {result['hf_repeat_ms']:.1f} ms; "
              f"{args.small_len} tokens {result['hf_small_ms']:.1f} ms")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
