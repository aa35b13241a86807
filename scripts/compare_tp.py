"""Greedy outputs at several TP sizes (and with async scheduling on and off) on the same model must be
identical; prints a table and exits 1 if not.

python scripts/compare_tp.py --model llama-3-8b --load-format dummy --dtype float32 --tp-sizes 1 2 \
    --async-scheduling both
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny-llama-tp")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--async-scheduling", choices=("on", "off", "both"), default="on")
    parser.add_argument("--attention-backends", nargs="+", default=["auto"], help="each one is compared")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.async_scheduling]

    from tp_runtime import LLM, SamplingParams
    from tp_runtime.models_catalog import resolve_model_name as resolve_model

    model = resolve_model(args.model, args.load_format)
    outputs: dict[str, list[list[int]]] = {}
    runs = [
        (tp, mode, backend) for backend in args.attention_backends for tp in args.tp_sizes for mode in modes
    ]
    for tp, mode, backend in runs:
        with LLM(
            model, tensor_parallel_size=tp, dtype=args.dtype, device=args.device,
            load_format=args.load_format, gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.input_len + args.max_tokens + 16, async_scheduling=mode,
            attention_backend=backend,
        ) as llm:  # fmt: skip
            rng = np.random.default_rng(0)
            vocab = llm.config.model.vocab_size
            prompts = [
                {"prompt_token_ids": rng.integers(3, vocab, size=args.input_len).tolist()}
                for _ in range(args.num_prompts)
            ]
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
            outs = llm.generate(prompts, params, use_tqdm=False)
            outputs[_name(tp, mode, backend)] = [o.outputs[0].token_ids for o in outs]
        gc.collect()
    base = _name(*runs[0])
    ok = True
    print(f"model={args.model} dtype={args.dtype} prompts={args.num_prompts} tokens={args.max_tokens}")
    for tp, mode, backend in runs[1:]:
        name = _name(tp, mode, backend)
        pairs = list(zip(outputs[base], outputs[name], strict=True))
        same = sum(a == b for a, b in pairs)
        tokens_same = sum(x == y for a, b in pairs for x, y in zip(a, b, strict=False))
        total = sum(len(a) for a in outputs[base])
        print(f"{name} vs {base}: {same}/{len(pairs)} sequences identical, {tokens_same}/{total} tokens")
        ok &= same == len(outputs[base])
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "outputs": outputs}, f)
    sys.exit(0 if ok else 1)


def _name(tp: int, async_scheduling: bool, backend: str) -> str:
    return f"TP={tp} async={'on' if async_scheduling else 'off'} attention={backend}"


if __name__ == "__main__":
    main()
