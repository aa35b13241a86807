"""Top device kernels of decode steps (torch.profiler), to see where a step's time goes on GPU.

python scripts/profile_decode.py --model llama-3-8b --batch-size 32 --input-len 1000 --steps 8

At TP > 1 run it under torchrun (`python -m torch.distributed.run --standalone --nproc-per-node 2
scripts/profile_decode.py -tp 2 ...`): rank 0 hosts the driver and its own worker in-process, so the
profile shows rank 0's kernels, all-reduces included; the other ranks serve as workers.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--rows", type=int, default=18, help="kernels listed")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (bench: 1)")
    parser.add_argument("--quantization", default=None, choices=[None, "fp8"])
    args = parser.parse_args()

    from tp_runtime import LLM, SamplingParams, run_torchrun_worker
    from tp_runtime.config import torchrun_rank
    from tp_runtime.models_catalog import resolve_model_name as resolve_model

    options = dict(
        load_format="dummy", dtype="bfloat16", enforce_eager=args.enforce_eager,
        max_model_len=args.input_len + args.steps + 64, tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
    )  # fmt: skip
    model = resolve_model(args.model, "dummy")
    if torchrun_rank():
        run_torchrun_worker(model, **options)
        return
    llm = LLM(model, **options)
    prompts = [
        {"prompt_token_ids": np.random.default_rng(i).integers(3, 1000, args.input_len).tolist()}
        for i in range(args.batch_size)
    ]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.steps, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm up (and capture graphs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.device_time for e in kernels)
    per_step = f"{len(kernels) / args.steps:.0f} kernels, {busy_us / args.steps:.0f} us of device time"
    print(f"per step (the prefill included, divided by --steps): {per_step}")
    llm.shutdown()


if __name__ == "__main__":
    main()
