"""Whether an engine at its defaults stays inside its GPU memory share under work that fills its KV cache.

Loads MODEL (a preset, dummy weights, bf16; `--quantization fp8` optional) at the defaults, then generates for
320 prompts of 500-7,800 random tokens with 16-200 out each (top-k 50, top-p 0.9, temperature 0.8, 5
logprobs, prompt logprobs on every 40th, ignore_eos), enough to fill the cache and preempt. Prints the KV
cache it sized and PyTorch's peak reserved memory against the card (gpu_memory_utilization is 0.9).

    python3 scripts/check_kv_share.py --model llama-3-8b
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from tp_runtime import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--quantization", default=None)
    args = parser.parse_args()
    start = time.time()
    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", quantization=args.quantization)
    total = torch.cuda.mem_get_info()[1]
    runner = llm.engine.executor.worker.runner  # type: ignore[attr-defined]
    kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in runner.kv_caches)
    gib = 2**30
    reserved = torch.cuda.memory_reserved() / gib
    print(f"ready {time.time() - start:.1f} s; KV {kv / gib:.2f} GiB; reserved after warm-up {reserved:.2f} "
          f"GiB of {total / gib:.2f} (share {0.9 * total / gib:.2f})")  # fmt: skip
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 120000) for _ in range(rng.randrange(500, 7800))]}
               for _ in range(320)]  # fmt: skip
    params = [
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            top_k=50,
            max_tokens=rng.randrange(16, 200),
            logprobs=5,
            prompt_logprobs=5 if i % 40 == 0 else None,
            ignore_eos=True,
        )
        for i in range(320)
    ]
    began = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"generated {made} tokens for {len(outs)} prompts in {time.time() - began:.1f} s")
    peak = torch.cuda.max_memory_reserved()
    in_use = total - torch.cuda.mem_get_info()[0]
    print(f"peak reserved {peak / gib:.2f} GiB = {peak / total:.3f} of the card (share 0.9); peak allocated "
          f"{torch.cuda.max_memory_allocated() / gib:.2f} GiB; the device's memory in use now, CUDA context "
          f"included, {in_use / gib:.2f} GiB = {in_use / total:.3f}")  # fmt: skip
    llm.shutdown()


if __name__ == "__main__":
    main()
