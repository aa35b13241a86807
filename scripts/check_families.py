"""Greedy tokens of the non-Llama families (Qwen3, Mixtral, Qwen3-MoE, Qwen2-MoE, Gemma, Gemma 2, Gemma 3,
Phi-3, Phi-4-mini, Granite, OLMo 2, OLMo 3, SmolLM3) at several TP sizes, against each other and against HF
transformers, on small random checkpoints built here.

    python scripts/check_families.py --device cuda --tp-sizes 1 2 --output-json families.json

Each family gets a seeded random float32 checkpoint (transformers' own `from_config` + `save_pretrained`,
safetensors, with the preset BPE tokenizer) in a temporary folder: hidden 256, 4 layers, 8 heads / 4 KV heads
(so TP 2 and 4 work); Mixtral 8 experts, Qwen3-MoE and Qwen2-MoE 8 experts (layer 0 dense; Qwen2-MoE's with
its gated shared expert), top-2; SmolLM3 with every other layer NoPE and windowed (16 tokens); Gemma 2 with a
16-token window on layers 0 and 2 (shorter than most prompts) and both soft-caps on (the attention cap, the
window and query_pre_attn_scalar each change HF's greedy tokens on every prompt; the final cap is monotone, so
it cannot change greedy tokens). Weights are drawn larger than HF's init and every norm weight is perturbed,
so logits are peaked (greedy near-ties are rare) and a norm applied wrongly would show; the table's "HF min
margin" is the smallest top-1/top-2 logit gap along HF's own continuations.

tp_runtime runs each TP size in float32 on --device (temperature 0, ignore_eos) on token-id prompts of
several lengths; the reference is HF's greedy `generate` on the same device in float32 (Gemma 2 with eager
attention: HF's SDPA path drops the attention soft-cap). Exits 1 if any TP size's tokens differ from the
first TP size's (or a family fails to run); a difference from HF is reported with its first position and
HF's logit gap there (a tiny gap is a float near-tie, not a bug) and fails only with --strict-hf.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

COMMON: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=512,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# family -> (architecture, config overrides)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # head_dim 64 with 8 heads: the q width (512) is not hidden_size (256); per-head q/k RMSNorm.
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 64}),
    # 8 experts as wide as half the dense MLP, top-2.
    "mixtral": (
        "MixtralForCausalLM",
        {"intermediate_size": 256, "num_local_experts": 8, "num_experts_per_tok": 2},
    ),
    # 8 small experts, renormalised top-2, layer 0 dense (mlp_only_layers).
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
    # Qwen2-MoE: q/k/v biases, 8 small experts, top-2 without renormalisation, beside a sigmoid-gated shared
    # expert as wide as the dense MLP; layer 0 dense (mlp_only_layers).
    "qwen2-moe": (
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 512,
            "norm_topk_prob": False,
            "mlp_only_layers": [0],
        },
    ),
    # Gemma: Llama's layers with (1 + w) norms, GeGLU and the sqrt(hidden) embedding scale; head_dim 64
    # (q width 512, not hidden_size 256); tied embeddings.
    "gemma": ("GemmaForCausalLM", {"head_dim": 64, "tie_word_embeddings": True}),
    # Layers 0 and 2 windowed (16 tokens), 1 and 3 global; both soft-caps on (the attention cap, the window
    # and the scale each change HF's greedy tokens on every prompt); scale 24 ** -0.5 with head_dim 32; tied
    # embeddings.
    "gemma2": (
        "Gemma2ForCausalLM",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 10.0,
            "tie_word_embeddings": True,
        },
    ),
    # Gemma 3: Gemma 2's layout with per-head q/k norms, three windowed layers (16 tokens, local rope of
    # theta 10^4) to one global (linearly scaled rope of theta 10^6), no soft-caps.
    "gemma3": (
        "Gemma3ForCausalLM",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 16,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            "tie_word_embeddings": True,
        },
    ),
    # Phi-3: fused qkv_proj / gate_up_proj checkpoint tensors, a 32-token window on every layer.
    "phi3": ("Phi3ForCausalLM", {"sliding_window": 32}),
    # Phi-4-mini: Phi-3 rotating only the first 3/4 of each head (q/k rows reordered at load).
    "phi4-mini": ("Phi3ForCausalLM", {"partial_rotary_factor": 0.75}),
    # Granite: Llama with its four scalings (as Granite 3's: embedding x12, residual x0.22, attention
    # scale 1/head_dim, logits / 8).
    "granite": (
        "GraniteForCausalLM",
        {
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 1 / 32,
            "logits_scaling": 8.0,
        },
    ),
    # OLMo 2: post-norms only, q/k norms over the whole projection (all heads; summed over the ranks).
    "olmo2": ("Olmo2ForCausalLM", {}),
    # OLMo 3: three windowed layers (16 tokens, their own unscaled rope) to one global (YaRN-scaled rope).
    "olmo3": (
        "Olmo3ForCausalLM",
        {
            "sliding_window": 16,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256},
        },
    ),
    # SmolLM3: layers 1 and 3 without rotary embedding (no_rope_layer_interval 2) and, as transformers makes
    # layer_types with use_sliding_window, windowed (16 tokens); tied embeddings.
    "smollm3": (
        "SmolLM3ForCausalLM",
        {
            "no_rope_layer_interval": 2,
            "use_sliding_window": True,
            "sliding_window": 16,
            "tie_word_embeddings": True,
        },
    ),
}
# transformers' config class of an architecture, where it is not <Name>Config.
CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}

PROMPT_LENGTHS = (5, 12, 23, 40, 61)  # all but the first two are longer than Gemma 2's window
PROMPT_SEED = 1234
WEIGHT_SEED = 0
WEIGHT_GAIN = 1.5  # weights ~ N(0, (gain / sqrt(fan_in))^2); norm weights + N(0, 0.2^2)
# Gemma 2 with tied embeddings and the init above predicts its own input token everywhere (the residual
# is mostly the sqrt(hidden)-scaled embedding), so greedy decoding repeats one token. A small embedding,
# larger sublayer outputs (post-norms) and a larger final norm (peaked logits) give varied continuations.
# Gemma (1) repeats likewise; it has no post-norms (its post_attention_layernorm is the MLP's input norm),
# and the small embedding and large final norm suffice.
INIT_OVERRIDES: dict[str, dict[str, float]] = {
    "gemma": {"embed_gain": 0.2, "final_norm_offset": 8.0},
    "gemma2": {"embed_gain": 0.2, "post_norm_offset": 3.0, "final_norm_offset": 8.0},
    "gemma3": {"embed_gain": 0.2, "post_norm_offset": 3.0, "final_norm_offset": 8.0},
}


def build_checkpoint(root: Path, family: str) -> Path:
    import transformers

    from tp_runtime.presets import build_preset_tokenizer

    arch, overrides = FAMILIES[family]
    kwargs = {**COMMON, **overrides}
    config_cls = getattr(transformers, CONFIG_CLASSES.get(arch, arch.replace("ForCausalLM", "Config")))
    config = config_cls(architectures=[arch], **kwargs)
    torch.manual_seed(WEIGHT_SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init = INIT_OVERRIDES.get(family, {})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))  # Gemma's (1 + w) norms start at 0, the others at 1
                if name == "model.norm.weight":
                    p.add_(init.get("final_norm_offset", 0.0))
                elif ".post_attention_layernorm." in name or ".post_feedforward_layernorm." in name:
                    p.add_(init.get("post_norm_offset", 0.0))  # Gemma 2's sublayer-output norms
            elif p.dim() > 1:  # [..., out, in]: embeddings, projections, routers, stacked experts
                gain = init.get("embed_gain", WEIGHT_GAIN) if "embed_tokens" in name else WEIGHT_GAIN
                p.normal_(0.0, gain / p.shape[-1] ** 0.5)
            else:
                p.normal_(0.0, 0.05)
    out = root / family
    model.save_pretrained(out, safe_serialization=True)
    build_preset_tokenizer(kwargs["vocab_size"]).save_pretrained(out)
    return out


def make_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def load_hf(model_dir: Path, device: str) -> Any:
    import transformers

    config = json.loads((model_dir / "config.json").read_text())
    kwargs = {"attn_implementation": "eager"} if config["architectures"][0] == "Gemma2ForCausalLM" else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    return model.to(device).eval()


def hf_greedy(model: Any, prompts: list[list[int]], max_tokens: int, device: str) -> list[list[int]]:
    """HF's greedy continuation of each prompt, one at a time (no padding), never stopping early."""
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        outs.append(gen[0, len(p) :].tolist())
    return outs


def hf_margins(model: Any, prompt: list[int], continuation: list[int], device: str) -> list[float]:
    """HF's top-1 minus top-2 logit at each generated position (teacher-forced on `continuation`)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation], device=device)).logits[0, len(prompt) - 1 : -1]
    top2 = logits.float().topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def hf_gap(model: Any, prefix: list[int], hf_token: int, other_token: int, device: str) -> float:
    """HF's logit of its own greedy token minus that of the other token, after `prefix`."""
    with torch.no_grad():
        logits = model(torch.tensor([prefix], device=device)).logits[0, -1].float()
    return float(logits[hf_token] - logits[other_token])


def runtime_greedy(
    model_dir: Path, tp: int, prompts: list[list[int]], args: argparse.Namespace
) -> list[list[int]]:
    from tp_runtime import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with LLM(
        str(model_dir), tensor_parallel_size=tp, dtype="float32", device=args.device, seed=0,
        max_model_len=max(map(len, prompts)) + args.max_tokens + 16, max_num_seqs=len(prompts),
        gpu_memory_utilization=args.gpu_memory_utilization,
    ) as llm:  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens = [[int(t) for t in o.outputs[0].token_ids] for o in outs]
    gc.collect()
    return tokens


def first_mismatch(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(prompt index, position) of the first differing token, prompt by prompt."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for j in range(max(len(x), len(y))):
            if j >= len(x) or j >= len(y) or x[j] != y[j]:
                return i, j
    return None


def check_family(family: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    arch = FAMILIES[family][0]
    result: dict[str, Any] = {"family": family, "architecture": arch}
    t0 = time.perf_counter()
    model_dir = build_checkpoint(root, family)
    prompts = make_prompts(COMMON["vocab_size"])
    result["prompt_lengths"] = [len(p) for p in prompts]

    hf_model = load_hf(model_dir, args.device)
    hf = hf_greedy(hf_model, prompts, args.max_tokens, args.device)
    result["hf"] = hf
    # The smallest top-1/top-2 logit margin along HF's own continuations: how close greedy came to a tie.
    result["hf_min_margin"] = min(
        min(hf_margins(hf_model, p, c, args.device)) for p, c in zip(prompts, hf, strict=True)
    )
    result["distinct_tokens"] = [len(set(c)) for c in hf]
    result["tp"] = {}
    for tp in args.tp_sizes:
        result["tp"][str(tp)] = runtime_greedy(model_dir, tp, prompts, args)

    base_tp = args.tp_sizes[0]
    base = result["tp"][str(base_tp)]
    result["tp_vs_base"] = {}
    for tp in args.tp_sizes[1:]:
        mm = first_mismatch(base, result["tp"][str(tp)])
        result["tp_vs_base"][str(tp)] = None if mm is None else {"prompt": mm[0], "position": mm[1]}
    result["tp_agree"] = all(v is None for v in result["tp_vs_base"].values())

    result["hf_vs_tp"] = {}
    for tp in args.tp_sizes:
        got = result["tp"][str(tp)]
        same = sum(g == w for g, w in zip(got, hf, strict=True))
        entry: dict[str, Any] = {"sequences_identical": same, "sequences": len(hf), "first_mismatch": None}
        mm = first_mismatch(got, hf)
        if mm is not None:
            i, j = mm
            both = j < len(hf[i]) and j < len(got[i])  # else one output is shorter (it should not be)
            entry["first_mismatch"] = {
                "prompt": i,
                "prompt_length": len(prompts[i]),
                "position": j,
                "hf_token": hf[i][j] if j < len(hf[i]) else None,
                "tp_runtime_token": got[i][j] if j < len(got[i]) else None,
                "hf_logit_gap": (
                    hf_gap(hf_model, prompts[i] + hf[i][:j], hf[i][j], got[i][j], args.device)
                    if both
                    else None
                ),
            }
        result["hf_vs_tp"][str(tp)] = entry
    result["hf_identical"] = all(e["first_mismatch"] is None for e in result["hf_vs_tp"].values())
    del hf_model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def hf_cell(result: dict[str, Any]) -> str:
    if "error" in result:
        return "-"
    parts = []
    for tp, e in result["hf_vs_tp"].items():
        cell = f"TP{tp} {e['sequences_identical']}/{e['sequences']}"
        mm = e["first_mismatch"]
        if mm is not None:
            gap = "length differs" if mm["hf_logit_gap"] is None else f"gap {mm['hf_logit_gap']:.2g}"
            cell += f" (p{mm['prompt']}@{mm['position']}, {gap})"
        parts.append(cell)
    return ", ".join(parts)


def tp_cell(result: dict[str, Any], base_tp: int) -> str:
    if "error" in result:
        return "ERROR"
    if not result["tp_vs_base"]:
        return f"TP{base_tp} only"
    if result["tp_agree"]:
        return "yes"
    bad = [
        f"TP{tp} p{mm['prompt']}@{mm['position']}"
        for tp, mm in result["tp_vs_base"].items()
        if mm is not None
    ]
    return "NO: " + ", ".join(bad)


def print_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    base_tp = args.tp_sizes[0]
    header = (
        "family", "architecture", f"TP sizes = TP{base_tp}", "HF (identical seqs; first mismatch)",
        "HF min margin", "s",
    )  # fmt: skip
    rows = [header] + [
        (
            r["family"],
            r["architecture"],
            tp_cell(r, base_tp),
            hf_cell(r),
            f"{r['hf_min_margin']:.3g}" if "hf_min_margin" in r else "-",
            str(r.get("seconds", "-")),
        )
        for r in results
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    print()
    print(
        f"device={args.device} dtype=float32 tp_sizes={args.tp_sizes} max_tokens={args.max_tokens} "
        f"prompt_lengths={list(PROMPT_LENGTHS)}"
    )
    for k, row in enumerate(rows):
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if k == 0:
            print("-+-".join("-" * w for w in widths))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--families",
        nargs="+",
        choices=list(FAMILIES) + [arch for arch, _ in FAMILIES.values()],
        default=list(FAMILIES),
        help="short names or architecture names",
    )
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--strict-hf", action="store_true", help="also exit 1 if any tokens differ from HF's")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    by_arch = {arch: family for family, (arch, _) in FAMILIES.items()}
    args.families = list(dict.fromkeys(by_arch.get(f, f) for f in args.families))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda":
        # fp32 means fp32 for the reference too (these are PyTorch's defaults; made explicit).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    import transformers

    transformers.utils.logging.disable_progress_bar()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tp-runtime-families-") as tmp:
        for family in args.families:
            print(f"== {family} ({FAMILIES[family][0]})", flush=True)
            try:
                result = check_family(family, Path(tmp), args)
            except Exception as e:  # report it and go on with the other families
                traceback.print_exc()
                result = {"family": family, "architecture": FAMILIES[family][0], "error": repr(e)}
            results.append(result)
            if "error" not in result:
                print(
                    f"   TP agree: {tp_cell(result, args.tp_sizes[0])}; HF: {hf_cell(result)}; distinct "
                    f"tokens per HF continuation: {result['distinct_tokens']}",
                    flush=True,
                )

    print_table(results, args)
    failed = [r["family"] for r in results if "error" in r or not r["tp_agree"]]
    hf_diff = [r["family"] for r in results if "error" not in r and not r["hf_identical"]]
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {"args": vars(args), "prompt_lengths": list(PROMPT_LENGTHS), "results": results}, f, indent=1
            )
    if failed:
        print(f"FAIL: TP sizes disagree or errored: {', '.join(failed)}")
    if hf_diff:
        print(f"{'FAIL' if args.strict_hf else 'NOTE'}: tokens differ from HF: {', '.join(hf_diff)}")
    if not failed and not hf_diff:
        print("OK: every TP size equals TP" + str(args.tp_sizes[0]) + " and HF")
    sys.exit(1 if failed or (args.strict_hf and hf_diff) else 0)


if __name__ == "__main__":
    main()
