"""Same-run peer for `tp-runtime bench latency`: HF transformers `generate` on a random-weight preset shape.

    python scripts/bench_hf_peer.py --model llama-3-8b --batch-size 32 --input-len 1000 --output-len 128 \
        --cache-implementation static
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import transformers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-3-8b", help="a tp_runtime preset name")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--cache-implementation", choices=("dynamic", "static"), default="static")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    from tp_runtime.presets import preset_hf_config

    config = preset_hf_config(args.model)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.tensor(
        np.random.default_rng(0).integers(3, config.vocab_size, size=(args.batch_size, args.input_len)),
        device="cuda",
    )

    def one_run() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
            min_new_tokens=args.output_len, do_sample=False, cache_implementation=args.cache_implementation,
            pad_token_id=0,
        )  # fmt: skip
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        one_run()
    latencies = [one_run() for _ in range(args.num_iters)]
    result = {"avg_latency": float(np.mean(latencies)), "latencies": latencies, "args": vars(args)}
    print(f"HF {args.cache_implementation} cache, batch {args.batch_size}, in {args.input_len}, "
          f"out {args.output_len}: avg latency {result['avg_latency']:.4f} s")  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
