"""Same-run peer for `tp-runtime bench throughput`: HF transformers' continuous batching (`generate_batch`) on
a random-weight preset shape, over the same prompts (bench/serve.py's make_workload, same seed). Every
request generates --output-len tokens (generate_batch takes one length for all), the mean of the lengths
the engine's run draws with --range-ratio; EOS is ignored.

    python scripts/bench_hf_throughput.py --model llama-3-8b --input-len 550 --range-ratio 0.818 \
        --output-len 128 --num-prompts 256
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

from tp_runtime.bench.serve import make_workload
from tp_runtime.presets import preset_hf_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-3-8b", help="a tp_runtime preset name")
    parser.add_argument("--input-len", type=int, default=550)
    parser.add_argument("--range-ratio", type=float, default=0.818)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--num-passes", type=int, default=2)
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    config = preset_hf_config(args.model)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    work = make_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                         config.vocab_size, args.workload_seed, "completions")  # fmt: skip
    prompts = [list(map(int, p)) for p in work.prompts]
    gen = transformers.GenerationConfig(
        max_new_tokens=args.output_len, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    passes = []
    for _ in range(args.num_passes):
        start = time.perf_counter()
        outputs = model.generate_batch(prompts, generation_config=gen)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.generated_tokens) for o in outputs.values())
        passes.append({"elapsed_s": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
                       "requests_per_s": len(outputs) / elapsed})  # fmt: skip
        print(f"HF generate_batch: {len(outputs)} requests, {tokens} output tokens in {elapsed:.2f} s: "
              f"{tokens / elapsed:.0f} output tok/s", flush=True)  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "transformers": transformers.__version__, "passes": passes}, f,
                      indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
