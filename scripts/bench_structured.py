"""What a JSON-schema constraint costs a decode step: a batch of requests decoded under a schema against the
same batch unconstrained, in one engine (the unconstrained batch is the peer).

The schema asks for more items than --output-len tokens can hold, so no constrained request ends early and
both batches decode the same number of steps at the same batch size; the step time is
(time of --output-len tokens - time of 1 token) / (--output-len - 1), the median over --num-iters.

    python scripts/bench_structured.py --model llama-3-8b --batch-size 32 --output-len 128 \
        --output-json s.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tp_runtime import LLM, SamplingParams, StructuredOutputsParams

# An array of records, at least 64 of them: hundreds of tokens before the grammar could end.
SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string", "maxLength": 16},
                    "score": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                },
                "required": ["id", "name", "score", "tags"],
            },
        }
    },
    "required": ["records"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    rng = random.Random(0)
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype)  # type: ignore[arg-type]
    vocab = min(120000, llm.config.model.vocab_size)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.input_len)]}
        for _ in range(args.batch_size)
    ]
    constraint = StructuredOutputsParams(json=SCHEMA)

    def run(max_tokens: int, constrained: bool) -> tuple[float, list[int], list[str | None]]:
        params = SamplingParams(
            temperature=1.0,
            seed=1,
            max_tokens=max_tokens,
            ignore_eos=not constrained,
            structured_outputs=constraint if constrained else None,
        )
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        return elapsed, lengths, [o.outputs[0].finish_reason for o in outs]

    result: dict[str, object] = {"batch_size": args.batch_size, "input_len": args.input_len,
                                 "output_len": args.output_len, "schema": SCHEMA}
    for name, constrained in (("unconstrained", False), ("json_schema", True)):
        run(args.output_len, constrained)  # warm-up: the grammar compiled, the shapes seen
        steps = []
        for _ in range(args.num_iters):
            first, _, _ = run(1, constrained)
            whole, lengths, reasons = run(args.output_len, constrained)
            if min(lengths) != args.output_len:
                raise SystemExit(f"{name}: a request ended early ({min(lengths)} tokens, {set(reasons)})")
            steps.append((whole - first) / (args.output_len - 1))
        result[name] = {"step_ms": 1e3 * statistics.median(steps), "each_step_ms": [1e3 * s for s in steps]}
    base = result["unconstrained"]["step_ms"]  # type: ignore[index]
    constrained_ms = result["json_schema"]["step_ms"]  # type: ignore[index]
    result["overhead_percent"] = 100.0 * (constrained_ms / base - 1.0)
    sample_params = SamplingParams(max_tokens=48, structured_outputs=constraint)
    sample = llm.generate(prompts[:1], sample_params, use_tqdm=False)
    result["sample_text"] = sample[0].outputs[0].text
    print(f"batch {args.batch_size}, {args.output_len} tokens: step {base:.3f} ms unconstrained, "
          f"{constrained_ms:.3f} ms under the JSON schema ({result['overhead_percent']:+.1f} %)")
    print(f"  a constrained sample: {result['sample_text']!r}")
    llm.shutdown()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
