"""Greedy agreement of the FP8 engine with an fp32 reference on the same (dequantized) weights, on a GPU.

The model is a real-shaped dense preset (default Llama-3-8B; the presets are Llama-shaped) with the
engine's dummy weights (`load_format="dummy"`, which every run gives the same values). The FP8 engine
(`quantization="fp8"`, bfloat16 activations, its CUDA kernels and graphs) quantizes them at load, per
output channel. The
reference is HF transformers in float32 holding what those FP8 weights stand for: each linear weight
rounded to e4m3 with its row's amax / 448 scale and multiplied back (computed here, independently of
the engine's code), the embeddings, norms and LM head as the engine holds them. The unquantized bf16
engine against HF fp32 on the unrounded weights is measured the same way, for scale: how much of the
disagreement bfloat16 alone causes; and so is the bf16 engine with an FP8 KV cache
(`kv_cache_dtype="fp8"`, scale 1: dummy weights come with no KV scales) against the same reference.

Reported per engine: the share of positions where the engine's top-1 token, given the reference's own
greedy prefix (teacher forcing, from prompt_logprobs), is the reference's; the share of prompts whose
whole free-running greedy output equals the reference's; and the mean length of the common prefix.

    python3 scripts/check_fp8_agreement.py --model llama-3-8b --prompts 32 --max-tokens 64
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics

import torch
import transformers

from tp_runtime import LLM, SamplingParams
from tp_runtime.config import FP8_E4M3_MAX, build_model_config
from tp_runtime.distributed import TPGroup
from tp_runtime.loader import dummy_checkpoint
from tp_runtime.models.registry import model_class
from tp_runtime.models_catalog import resolve_model_name
from tp_runtime.presets import preset_hf_config

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """w rounded to e4m3 with one scale per row (amax / 448, 1 for a zero row), back in float32."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    return (w / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def hf_greedy(
    hf: transformers.PreTrainedModel, prompts: list[list[int]], max_tokens: int, device: torch.device
) -> list[list[int]]:
    """Greedy continuations, one batch left-padded."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                          min_new_tokens=max_tokens, pad_token_id=0)  # fmt: skip
    return [row[width:].tolist() for row in out]


def engine_agreement(
    llm: LLM, prompts: list[list[int]], reference: list[list[int]], max_tokens: int
) -> dict[str, float]:
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    free = [list(o.outputs[0].token_ids) for o in outs]
    forced_params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, ignore_eos=True)
    forced = llm.generate(
        [{"prompt_token_ids": p + r[:-1]} for p, r in zip(prompts, reference, strict=True)],
        forced_params,
        use_tqdm=False,
    )
    hits = total = 0
    for p, r, out in zip(prompts, reference, forced, strict=True):
        logprobs = out.prompt_logprobs or []
        # Entry len(p) + j predicts r[j] from the prompt and r[:j]; the sampled token predicts r[-1].
        tops = [max(lp.items(), key=lambda kv: kv[1].logprob)[0] for lp in logprobs[len(p) :] if lp]
        predicted = [*tops, out.outputs[0].token_ids[0]]
        hits += sum(a == b for a, b in zip(predicted, r, strict=True))
        total += len(r)
    prefix = [next((i for i, (a, b) in enumerate(zip(f, r, strict=True)) if a != b), len(r))
              for f, r in zip(free, reference, strict=True)]  # fmt: skip
    return {
        "teacher_forced_top1_agreement": hits / total,
        "whole_output_equal": sum(f == r for f, r in zip(free, reference, strict=True)) / len(prompts),
        "mean_common_prefix_tokens": statistics.mean(prefix),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-3-8b", help="a tp_runtime preset name")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cuda", help="cpu: a check of this script (the CPU engine "
                        "multiplies by the dequantized weights, so float32 agrees everywhere)")  # fmt: skip
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    model_dir = resolve_model_name(args.model, "dummy")
    cfg = build_model_config(model_dir, dtype=args.dtype, device="cpu")
    meta_model = model_class(cfg.architecture)(cfg, TPGroup(), dtype, torch.device("meta"))
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(3, cfg.vocab_size) for _ in range(rng.randrange(16, 65))] for _ in range(args.prompts)
    ]

    config = preset_hf_config(args.model)
    with device:
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    params = dict(hf.named_parameters())
    references = {}
    for rounded in (True, False):
        for name, tensor in dummy_checkpoint(meta_model, args.seed, dtype, device):
            value = tensor.full()
            if rounded and name.removesuffix(".weight").rsplit(".", 1)[-1] in LINEAR:
                value = fp8_round_trip(value)
            params[name].data.copy_(value.float())
        references["fp8" if rounded else "bf16"] = hf_greedy(hf, prompts, args.max_tokens, device)
        print(f"reference for {'fp8' if rounded else 'bf16'} done", flush=True)
    del hf, params
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    results = {}
    engines = (("fp8", "fp8", "auto", "fp8"), ("bf16", None, "auto", "bf16"), ("fp8-kv", None, "fp8", "bf16"))
    for name, quantization, kv_cache_dtype, reference in engines:
        with LLM(model_dir, load_format="dummy", dtype=args.dtype, device=args.device, seed=args.seed,
                 quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                 gpu_memory_utilization=0.5) as llm:  # fmt: skip
            results[name] = engine_agreement(llm, prompts, references[reference], args.max_tokens)
        print(name, results[name], flush=True)
        gc.collect()
    print(f"| engine ({args.dtype}) | reference | teacher-forced top-1 | whole output equal | "
          f"mean common prefix (of {args.max_tokens}) |")  # fmt: skip
    print("|---|---|---|---|---|")
    rows = (("fp8", "HF fp32, FP8-rounded weights"), ("bf16", "HF fp32, same weights"),
            ("fp8-kv", "HF fp32, same weights (bf16 weights, FP8 KV cache)"))  # fmt: skip
    for name, what in rows:
        r = results[name]
        print(f"| {name} | {what} | {r['teacher_forced_top1_agreement']:.4f} | {r['whole_output_equal']:.3f} "
              f"| {r['mean_common_prefix_tokens']:.1f} |")  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": args.model, "prompts": args.prompts, "max_tokens": args.max_tokens,
                       "results": results}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
