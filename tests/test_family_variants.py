"""Config variants of the supported families that real checkpoints use, against HF transformers (fp32, CPU).

Each case is one tiny random checkpoint that combines several variants (so one engine checks them all), run
at TP 2 where its head counts allow: greedy tokens equal HF's and the chosen tokens' logprobs are within
1e-4 of HF's. Covered: MQA with its one KV head replicated over both ranks, GQA ratios 2 and 4, attention
and MLP biases, tied and untied embeddings, vocab sizes TP does not divide, explicit head_dim (Qwen3,
Gemma 2), rope llama3 / yarn (the 4.x `rope_scaling` "type" key) / linear with unusual rope_theta, Qwen3's
q/k norms, Gemma 2's window on alternating layers with chunked prefill across it, experts TP does not
divide and top-1 routing with and without renormalisation; bf16 and fp16 checkpoints loaded as fp32; and
the configs that must be refused with a ConfigError (a prompt past max_position_embeddings is an
InvalidRequestError, max_model_len past it a ConfigError, a partial rotary embedding a ConfigError instead
of a shape error in the first forward).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import assert_same_tokens, hf_greedy, random_prompts
from safetensors.torch import load_file, save_file

from tp_runtime import LLM, SamplingParams
from tp_runtime.config import build_model_config
from tp_runtime.errors import ConfigError, InvalidRequestError

MAX_TOKENS = 8
# Small blocks and token budget: the 30- and 37-token prompts prefill in chunks, across Gemma 2's window.
SCHED = dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=48, max_model_len=64)

LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64, "rope_theta": 500000.0,
}  # fmt: skip

# name -> (architecture, config overrides, vocab size, TP size)
VARIANTS: dict[str, tuple[str, dict[str, Any], int, int]] = {
    # Llama 3.2-style: llama3 rope, tied embeddings; MQA (1 KV head on both ranks), biases, odd vocab.
    "llama-mqa-bias-tied-llama3": (
        "LlamaForCausalLM",
        {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True,
         "rope_parameters": LLAMA3},
        301, 2,
    ),
    # Qwen2.5-style yarn under the 4.x key, theta 1e6, GQA 4 (8 heads, 2 KV heads), sliding window on
    # every layer.
    "qwen2-yarn-gqa4-window": (
        "Qwen2ForCausalLM",
        {"num_attention_heads": 8, "rope_theta": 1e6, "use_sliding_window": True, "sliding_window": 6,
         "max_window_layers": 0,
         "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
        300, 2,
    ),
    # Qwen3: head_dim 48 (q width 192, hidden 64), MQA, tied, linear rope at theta 1e6.
    "qwen3-hd48-mqa-tied-linear": (
        "Qwen3ForCausalLM",
        {"head_dim": 48, "num_key_value_heads": 1, "tie_word_embeddings": True,
         "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
        301, 2,
    ),
    # Gemma 2: windowed/global alternation over 4 layers, MQA, attention bias, untied, both caps, a
    # query_pre_attn_scalar that is neither head_dim nor 1.
    "gemma2-mqa-bias-untied": (
        "Gemma2ForCausalLM",
        {"num_hidden_layers": 4, "head_dim": 24, "query_pre_attn_scalar": 40, "sliding_window": 5,
         "num_key_value_heads": 1, "attention_bias": True, "tie_word_embeddings": False,
         "attn_logit_softcapping": 20.0, "final_logit_softcapping": 10.0},
        301, 2,
    ),
    # Mixtral: 3 experts (TP does not divide them), top-1, explicit head_dim.
    "mixtral-3experts-top1": (
        "MixtralForCausalLM",
        {"num_local_experts": 3, "num_experts_per_tok": 1, "head_dim": 32},
        300, 2,
    ),
    # Qwen3-MoE: 5 experts, top-1 renormalised, dense layers from mlp_only_layers and decoder_sparse_step.
    "qwen3moe-5experts-top1-norm": (
        "Qwen3MoeForCausalLM",
        {"num_hidden_layers": 4, "num_experts": 5, "num_experts_per_tok": 1, "moe_intermediate_size": 32,
         "norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": [1]},
        300, 2,
    ),
    # Qwen3-MoE: top-3 of 6 experts, not renormalised (transformers' default).
    "qwen3moe-6experts-top3": (
        "Qwen3MoeForCausalLM",
        {"num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": False},
        300, 1,
    ),
}  # fmt: skip
PROMPT_LENS = (30, 5, 37, 12)


def _eager(model_dir: Path) -> dict[str, str]:
    """Gemma 2's reference is transformers' eager attention (its SDPA path drops the soft-cap)."""
    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    return {"attn_implementation": "eager"} if arch == "Gemma2ForCausalLM" else {}


def hf_reference(model_dir: Path, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """HF's greedy continuations (EOS never stops them) and the logprob of each chosen token."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, **_eager(model_dir)
    ).eval()
    model.generation_config.eos_token_id = None
    tokens, logprobs = [], []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=0)  # fmt: skip
        out = gen[0, len(p) :].tolist()
        with torch.no_grad():
            lp = model(gen).logits[0, len(p) - 1 : -1].float().log_softmax(-1)
        tokens.append(out)
        logprobs.append([lp[i, t].item() for i, t in enumerate(out)])
    return tokens, logprobs


def check(llm: LLM, model_dir: Path, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    want, want_lp = hf_reference(model_dir, prompts)
    assert_same_tokens([o.outputs[0].token_ids for o in outs], want, prompts)
    for out, ref in zip(outs, want_lp, strict=True):
        comp = out.outputs[0]
        assert comp.logprobs is not None
        got = [entry[t].logprob for entry, t in zip(comp.logprobs, comp.token_ids, strict=True)]
        assert got == pytest.approx(ref, abs=1e-4)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_hf(name: str, make_checkpoint: Callable[..., Path]) -> None:
    arch, overrides, vocab, tp = VARIANTS[name]
    model_dir = make_checkpoint(arch, vocab_size=vocab, **overrides)
    prompts = random_prompts(PROMPT_LENS, vocab, seed=11)
    with LLM(model=model_dir, tensor_parallel_size=tp, dtype="float32", device="cpu", seed=0, **SCHED) as llm:
        check(llm, model_dir, prompts)


def _recast(model_dir: Path, out: Path, dtype: str) -> Path:
    """A copy of the checkpoint stored in `dtype`, its config saying so (as a bf16 or fp16 release)."""
    shutil.copytree(model_dir, out)
    tensors = load_file(str(model_dir / "model.safetensors"))
    cast = {name: t.to(getattr(torch, dtype)) for name, t in tensors.items()}
    save_file(cast, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps({**config, "dtype": dtype}))
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoint_loads_as_float32(
    dtype: str, make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = _recast(make_checkpoint(num_key_value_heads=1), tmp_path / dtype, dtype)
    assert build_model_config(model_dir, device="cpu").dtype == "float32"  # "auto" on the CPU
    prompts = random_prompts((9, 21), 300, seed=3)
    with LLM(model=model_dir, device="cpu", seed=0) as llm:
        check(llm, model_dir, prompts)


def test_short_max_position_embeddings(make_checkpoint: Callable[..., Path]) -> None:
    model_dir = make_checkpoint(max_position_embeddings=24)
    with pytest.raises(
        ConfigError, match=r"exceeds the model's context of 24 positions \(max_position_embeddings=24"
    ):
        LLM(model=model_dir, device="cpu", dtype="float32", max_model_len=48)
    with LLM(model=model_dir, device="cpu", dtype="float32") as llm:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        with pytest.raises(InvalidRequestError, match="max_model_len is 24"):
            llm.generate([{"prompt_token_ids": [5] * 30}], params, use_tqdm=False)
        out = llm.generate([{"prompt_token_ids": [5] * 20}], params, use_tqdm=False)[0].outputs[0]
        assert (len(out.token_ids), out.finish_reason) == (4, "length")


@pytest.mark.parametrize(
    "rope,context",
    [
        ({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, 48),
        (
            {
                "rope_type": "yarn",
                "factor": 3.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 10000.0,
            },
            48,
        ),
        (
            {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
            24,
        ),  # its frequencies change past 24
    ],
    ids=["linear", "yarn", "dynamic"],
)
def test_scaled_rope_extends_the_context(
    rope: dict[str, Any], context: int, make_checkpoint: Callable[..., Path]
) -> None:
    """As vLLM derives it: a linear or YaRN rope serves max_position_embeddings (YaRN: its original) times
    its factor, past which transformers computes every position with the same frequencies."""
    model_dir = make_checkpoint(max_position_embeddings=24, rope_parameters=rope)
    assert build_model_config(model_dir, device="cpu").max_model_len == context
    with pytest.raises(ConfigError, match=f"exceeds the model's context of {context} positions"):
        LLM(model=model_dir, device="cpu", dtype="float32", max_model_len=context + 1)
    if context > 24:
        prompts = random_prompts((20, 30), 300, seed=5)
        want = hf_greedy(model_dir, prompts, context - 31)
        with LLM(model=model_dir, device="cpu", dtype="float32", seed=0) as llm:
            params = SamplingParams(temperature=0, max_tokens=context - 31, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_same_tokens([o.outputs[0].token_ids for o in outs], want, prompts)


def test_partial_rotary_factor(make_checkpoint: Callable[..., Path]) -> None:
    """transformers 5 keeps partial_rotary_factor in rope_parameters. With a scaled rope type its rope
    functions then give frequencies for part of each head only, which these families cannot apply: a
    ConfigError at load (it was a tensor shape error in the first forward). The families' default rope
    rotates the whole head whatever the factor, so that config loads and equals HF."""
    for rope_type, extra in (("linear", {"factor": 2.0}), ("yarn", {"factor": 2.0})):
        rope = {"rope_type": rope_type, "rope_theta": 10000.0, "partial_rotary_factor": 0.5, **extra}
        model_dir = make_checkpoint(rope_parameters=rope)
        with pytest.raises(ConfigError, match=r"partial_rotary_factor=0\.5 rotates 8 of the 16 head"):
            build_model_config(model_dir, device="cpu")
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    model_dir = make_checkpoint(rope_parameters=rope)
    assert len(build_model_config(model_dir, device="cpu").rope.inv_freq) == 8  # head_dim 16
    prompts = random_prompts((9, 21), 300, seed=4)
    with LLM(model=model_dir, device="cpu", dtype="float32", seed=0) as llm:
        check(llm, model_dir, prompts)
