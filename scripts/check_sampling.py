"""Check and time the Triton sampling kernels (tp_runtime/worker/sampling_triton.py) against the PyTorch
form (sampler.race_argmax) on one GPU: the same logits and noise must give the same tokens.

    PYTHONPATH=$PWD python scripts/check_sampling.py --vocab 128256 --rows 1 32

Prints, per row count and logits dtype, the tokens that differ (greedy and sampled rows) and µs per call
of each form, also of the whole Sampler (temperature 1, no filters) with and without the kernels. Exit
status 1 if any token differs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from tp_runtime.worker import sampling_triton
from tp_runtime.worker.sampler import Sampler, SamplingBatch, race_argmax


def time_us(fn: Callable[[], object], iters: int = 200) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def check_case(rows: int, vocab: int, dtype: torch.dtype, g: torch.Generator) -> bool:
    """Compare and time one (rows, dtype); True if every token agrees."""
    dev = torch.device("cuda")
    logits = (torch.randn(rows, vocab, device=dev, generator=g) * 4).to(dtype)
    greedy = torch.arange(rows, device=dev) % 4 == 3
    temperature = torch.full((rows,), 0.8, device=dev)
    noise = torch.rand(rows, vocab, device=dev, generator=g)
    want = race_argmax(logits.float(), greedy, noise.clone(), temperature)
    got = sampling_triton.race_argmax(logits.float(), greedy, noise.clone(), temperature)
    differ = int((want != got).sum())
    greedy_differ = int((sampling_triton.race_argmax(logits) != logits.argmax(-1)).sum())
    fused_race = sampling_triton.race_argmax
    torch_us = time_us(lambda: race_argmax(logits.float(), greedy, noise.clone(), temperature))
    triton_us = time_us(lambda: fused_race(logits.float(), greedy, noise.clone(), temperature))
    batch = SamplingBatch(
        temperature=temperature, greedy=torch.zeros(rows, dtype=torch.bool, device=dev), all_greedy=False,
        top_k=None, top_p=None, min_p=None, row_seeds={}, max_num_logprobs=-1,
    )  # fmt: skip
    plain, fused = Sampler(dev, seed=0), Sampler(dev, seed=0, fused=True)
    plain_us = time_us(lambda: plain(logits, batch))
    fused_us = time_us(lambda: fused(logits, batch))
    print(
        f"rows {rows:3d} {dtype!s:15s}: {differ} sampled / {greedy_differ} greedy tokens differ | "
        f"race torch {torch_us:6.1f} us, triton {triton_us:6.1f} us | Sampler {plain_us:6.1f} -> "
        f"{fused_us:6.1f} us",
        flush=True,
    )
    return not (differ or greedy_differ)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 32])
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    ok = True
    for rows in args.rows:
        for dtype in (torch.bfloat16, torch.float32):
            ok &= check_case(rows, args.vocab, dtype, g)
    print("all tokens equal" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
