"""`tp-runtime bench throughput`: offline throughput of many requests at once, flags named like vLLM's
benchmark_throughput.py (its random dataset).

Every request is a random token-id prompt of --input-len tokens that generates exactly --output-len tokens
(EOS ignored); with --range-ratio r each length is drawn from [len*(1-r), len*(1+r)] (the output lengths
from their own --output-range-ratio where given). All requests go to
`LLM.generate` together, --num-passes times over the same requests. The first pass is reported apart from
the later ones: it pays for whatever the engine does once per shape (a graph captured, a kernel
compiled, an attention plan built), which later passes over the same shapes do not.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tp_runtime.bench import write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tp_runtime.engine.args import add_engine_arguments

    add_engine_arguments(parser)
    from tp_runtime.bench.serve import add_dataset_argument, add_prefix_arguments

    add_dataset_argument(parser)
    parser.add_argument(
        "--input-len", "--random-input-len", type=int, default=1024, help="prompt tokens per request"
    )
    parser.add_argument(
        "--output-len", "--random-output-len", type=int, default=128, help="generated tokens per request"
    )
    parser.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="draw each length uniformly from [len*(1-r), len*(1+r)]; 0 keeps them fixed",
    )
    parser.add_argument(
        "--output-range-ratio",
        type=float,
        default=None,
        help="the same for the output lengths alone (default: --range-ratio); 0 gives every request "
        "exactly --output-len tokens",
    )
    add_prefix_arguments(parser)
    parser.add_argument("--num-prompts", type=int, default=1000, help="requests per pass")
    parser.add_argument("--num-passes", type=int, default=2, help="passes over the same requests")
    parser.add_argument(
        "--keep-prefix-cache",
        action="store_true",
        help="let a later pass take the earlier passes' prefix cache (a repeat of the same requests); by "
        "default each pass starts from an empty cache",
    )
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the lengths and prompts")
    parser.add_argument(
        "--output-json", type=str, default=None, help="also write every figure here (default: no file)"
    )


def check(args: argparse.Namespace) -> None:
    """What the engine would refuse only after loading the model (the CLI's checks resolved it)."""
    from tp_runtime.bench.serve import check_prefix_arguments, length_bounds
    from tp_runtime.errors import ConfigError

    for flag, ratio in (("--range-ratio", args.range_ratio), ("--output-range-ratio", output_ratio(args))):
        if not 0.0 <= ratio < 1.0:
            raise ConfigError(f"argument {flag}: must be in [0, 1), got {ratio:g}")
    check_prefix_arguments(args)
    longest = (
        args.prefix_len
        + length_bounds(args.input_len, args.range_ratio)[1]
        + length_bounds(args.output_len, output_ratio(args))[1]
    )
    limit = args.model_config.max_model_len
    if longest > limit:
        raise ConfigError(
            f"a request (--prefix-len, --input-len and --output-len with --range-ratio {args.range_ratio:g}"
            f" and --output-range-ratio {output_ratio(args):g}) may take "
            f"{longest} tokens, over the model's max_model_len={limit}; lower them or raise --max-model-len"
        )


def output_ratio(args: argparse.Namespace) -> float:
    """The output lengths' range ratio: --output-range-ratio, else --range-ratio."""
    return args.range_ratio if args.output_range_ratio is None else args.output_range_ratio


def pass_figures(
    elapsed: float, num_requests: int, prompt_tokens: int, output_tokens: int
) -> dict[str, float]:
    return {
        "elapsed_s": elapsed,
        "requests_per_s": num_requests / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tp_runtime import SamplingParams
    from tp_runtime.bench.latency import run_config
    from tp_runtime.bench.serve import make_workload
    from tp_runtime.engine.args import build_llm

    llm = build_llm(args)
    try:
        vocab = llm.config.model.vocab_size
        work = make_workload(
            args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab, args.workload_seed,
            "completions", args.prefix_len, args.num_prefixes, output_range_ratio=args.output_range_ratio,
        )  # fmt: skip
        kv = llm.engine.scheduler.kv
        prompts = [{"prompt_token_ids": ids} for ids in work.prompts]
        params = [SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=n) for n in work.output_lens]
        passes = []
        for _ in range(args.num_passes):
            # By default each pass computes its requests as the first did (what they share among themselves
            # still comes from the cache): a pass's figures are the engine's, not the previous pass's cache.
            if not args.keep_prefix_cache:
                llm.reset_prefix_cache()
            queried, hit = kv.num_queried_tokens, kv.num_hit_tokens
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            figures = pass_figures(elapsed, len(outputs), sum(work.prompt_lens), output_tokens)
            looked_up = kv.num_queried_tokens - queried
            figures["prefix_cache_hit_rate"] = (kv.num_hit_tokens - hit) / looked_up if looked_up else 0.0
            passes.append(figures)
    finally:
        llm.shutdown()
    later = passes[1:]
    later_mean = None
    if later:  # rates of the mean time, not the mean of rates
        mean_elapsed = sum(p["elapsed_s"] for p in later) / len(later)
        later_mean = pass_figures(
            mean_elapsed, args.num_prompts, sum(work.prompt_lens), sum(work.output_lens)
        )
        later_mean["prefix_cache_hit_rate"] = sum(p["prefix_cache_hit_rate"] for p in later) / len(later)
    return {
        "first_pass": passes[0],
        "later_passes": later_mean,
        "passes": passes,
        "num_requests": args.num_prompts,
        "prompt_tokens": sum(work.prompt_lens),
        "output_tokens": sum(work.output_lens),
        "config": {
            **run_config(llm, args),
            "range_ratio": args.range_ratio,
            "output_range_ratio": output_ratio(args),
            "keep_prefix_cache": args.keep_prefix_cache,
            "max_num_seqs": llm.config.scheduler.max_num_seqs,
            "max_num_batched_tokens": llm.config.scheduler.max_num_batched_tokens,
        },
    }


def print_report(result: dict[str, Any]) -> None:
    def line(name: str, p: dict[str, float]) -> str:
        return (
            f"{name:<12} {p['elapsed_s']:8.2f} s  {p['requests_per_s']:8.2f} requests/s  "
            f"{p['total_tokens_per_s']:10.1f} total tokens/s  "
            f"{p['output_tokens_per_s']:10.1f} output tokens/s  "
            f"prefix cache hits {100 * p.get('prefix_cache_hit_rate', 0.0):5.1f} %"
        )

    print(f"{result['num_requests']} requests, {result['prompt_tokens']} prompt and "
          f"{result['output_tokens']} output tokens a pass")  # fmt: skip
    print(line("first pass", result["first_pass"]))
    if result["later_passes"] is not None:
        print(line("later passes", result["later_passes"]))


def main(args: argparse.Namespace) -> None:
    result = run(args)
    print_report(result)
    if args.output_json:
        write_json(args.output_json, result)
