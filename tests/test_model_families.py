"""Qwen3, Mixtral, Qwen3-MoE, Qwen2-MoE, the Gemmas (Gemma 3 text and multimodal checkpoints), Phi-3, Granite,
OLMo 2 / 3 and SmolLM3 against HF transformers (fp32, CPU) on tiny random checkpoints.

- Greedy tokens equal HF's and logprobs are within 1e-4 at TP=1, 2 and (Mixtral, Gemma 2, OLMo 2) 4,
  through chunked prefill and preemption by recompute.
- Decode steps where most experts get no token: the CPU loop skips them and the output still equals HF.
- The CUDA expert paths ("grouped": torch._grouped_mm, "dense": every expert on every token) run on CPU
  too and equal the loop, alone and end to end in padded (decode-graph shaped) steps.
- Every rank's shards (q/k norms, router, stacked experts, Qwen2-MoE's shared expert and its gate) equal
  slices cut by hand from the checkpoint, and each rank reads about 1/TP of the file.

Every RMSNorm weight, q_norm and k_norm included, is random here (HF initialises them to ones), so a norm
applied to the wrong heads or not at all would show.

Gemma 2's reference is transformers' eager attention (its SDPA path ignores the attention soft-cap). Its
attention cap, window (shorter than the prompts), which layers are windowed and query_pre_attn_scalar (not
head_dim) each change HF's greedy tokens, and its final cap the logprobs (checked, not assumed).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import (
    BASE_CONFIG,
    GEMMA3,
    assert_same_tokens,
    count_checkpoint_reads,
    hf_greedy,
    random_prompts,
)
from safetensors.torch import load_file, save_file

from tp_runtime import LLM, SamplingParams, loader
from tp_runtime.config import build_model_config
from tp_runtime.distributed import IdentityAllReduce, TPGroup
from tp_runtime.errors import ConfigError, InvalidRequestError
from tp_runtime.layers import attention, moe
from tp_runtime.layers.attention import AttentionMetadata, PrefillChunk, TorchAttention, paged_attention
from tp_runtime.layers.moe import SparseMoE
from tp_runtime.models.registry import architecture, model_class

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # head_dim 32 with 4 heads: the q width (128) is not hidden_size (64).
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),
    # Every layer windowed (max_window_layers 0), with attention biases.
    "qwen3-window": (
        "Qwen3ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0, "attention_bias": True},
    ),
    # 8 experts, top-2, each expert as wide as a dense MLP; a sliding window as in Mistral.
    "mixtral": (
        "MixtralForCausalLM",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 8},
    ),
    # Many small experts, renormalised top-4 (as Qwen3-30B-A3B), layer 0 dense (mlp_only_layers).
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 16,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
    # transformers' defaults: no renormalisation; decoder_sparse_step 2 makes layer 0 dense, layer 1 sparse.
    "qwen3-moe-step2": (
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": False,
            "decoder_sparse_step": 2,
        },
    ),
    # Qwen2-MoE (as Qwen1.5-MoE-A2.7B): q/k/v biases, top-2 of 8 experts without renormalisation beside a
    # gated shared expert of its own width (48: neither the experts' 32 nor the dense 128), layer 0 dense.
    "qwen2-moe": (
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
            "mlp_only_layers": [0],
        },
    ),
    # Gemma: Llama's layers with (1 + w) norms, GeGLU and the sqrt(hidden) embedding scale; head_dim 32
    # with 4 heads (q width 128, not hidden_size 64); tied embeddings.
    "gemma": ("GemmaForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),
    # Gemma 2: layers 0 and 2 windowed (6 tokens), layer 1 global; both soft-caps bind; scale 24 ** -0.5
    # with head_dim 32; tied embeddings.
    "gemma2": (
        "Gemma2ForCausalLM",
        {
            "num_hidden_layers": 3,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 6,
            "attn_logit_softcapping": 20.0,
            "final_logit_softcapping": 10.0,
            "tie_word_embeddings": True,
        },
    ),
    # Every layer global (so fresh prompts get no block table: soft-capped attention over their own keys),
    # untied embeddings.
    "gemma2-global": (
        "Gemma2ForCausalLM",
        {
            "layer_types": ["full_attention", "full_attention"],
            "query_pre_attn_scalar": 20,
            "attn_logit_softcapping": 15.0,
            "final_logit_softcapping": 8.0,
        },
    ),
    # Gemma 3 (conftest.GEMMA3), its q/k norms randomised by with_random_norms.
    "gemma3": ("Gemma3ForCausalLM", GEMMA3),
    # Gemma 3's multimodal checkpoint: conftest.GEMMA3 as the text_config, beside a tiny vision tower and
    # projector (conftest.hf_config); run on text as its language model, against transformers'
    # Gemma3ForConditionalGeneration.
    "gemma3-mm": ("Gemma3ForConditionalGeneration", GEMMA3),
    # Granite: Llama with its four scalings, each away from 1 (attention 1/16 with head_dim 16, not 1/4),
    # and attention biases.
    "granite": (
        "GraniteForCausalLM",
        {
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.3,
            "attention_multiplier": 0.0625,
            "logits_scaling": 4.0,
            "attention_bias": True,
        },
    ),
    # Phi-3: fused qkv_proj and gate_up_proj tensors in the checkpoint; a window on every layer.
    "phi3": ("Phi3ForCausalLM", {"sliding_window": 8}),
    # Phi-4-mini's partial rotary embeddings: half of each head rotates (8 of head_dim 16), half passes.
    "phi3-partial": ("Phi3ForCausalLM", {"partial_rotary_factor": 0.5}),
    # OLMo 2: post-norms only, q/k norms over all heads (whole-projection widths 128 and 64, neither
    # hidden_size), with attention biases.
    "olmo2": ("Olmo2ForCausalLM", {"head_dim": 32, "attention_bias": True}),
    # OLMo 3: layers 0 and 2 windowed (6 tokens) with their own rope (theta 5 * 10^5, unscaled), layer 1
    # global with a YaRN-scaled rope of theta 10^4 (transformers gives rope_scaling to the global layers).
    "olmo3": (
        "Olmo3ForCausalLM",
        {
            "num_hidden_layers": 3,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_theta": 10_000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256},
        },
    ),
    # SmolLM3: layer 1 without rotary embedding (NoPE) and windowed (6 tokens, as transformers windows the
    # NoPE layers with use_sliding_window), layers 0 and 2 rotary and global; tied embeddings.
    "smollm3": (
        "SmolLM3ForCausalLM",
        {
            "num_hidden_layers": 3,
            "no_rope_layers": [1, 0, 1],
            "use_sliding_window": True,
            "sliding_window": 6,
            "layer_types": ["full_attention", "sliding_attention", "full_attention"],
            "tie_word_embeddings": True,
        },
    ),
}
# Expert projection names (gate, up, down) and the feed-forward's checkpoint name, per architecture.
EXPERT_NAMES = {
    "MixtralForCausalLM": (("w1", "w3", "w2"), "block_sparse_moe"),
    "Qwen3MoeForCausalLM": (("gate_proj", "up_proj", "down_proj"), "mlp"),
    "Qwen2MoeForCausalLM": (("gate_proj", "up_proj", "down_proj"), "mlp"),
}

# A small token budget (prompts of 17 and 20 tokens prefill in chunks) and few KV blocks (requests are
# preempted, freed on every rank and recomputed): 22 blocks of 4 tokens hold about two ~40-token requests.
SCHED_KWARGS = dict(
    max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=22, max_model_len=48
)
PROMPTS = random_prompts((13, 7, 20, 3, 17, 10), 300, seed=5)
MAX_TOKENS = 20
TOP_K = 5


def with_random_norms(model_dir: Path) -> Path:
    """A copy of the checkpoint whose norm weights are 1 + N(0, 0.2), seeded (cached next to it)."""
    out = model_dir.with_name(model_dir.name + "-norms")
    if (out / "config.json").is_file():
        return out
    tmp = model_dir.with_name(model_dir.name + "-norms-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_dir, tmp)
    tensors = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.2 * torch.randn(t.shape, generator=g)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(out)
    return out


@pytest.fixture(scope="module")
def family_dir(make_checkpoint: Callable[..., Path]) -> Callable[[str], Path]:
    def make(family: str) -> Path:
        arch, overrides = FAMILIES[family]
        return with_random_norms(make_checkpoint(arch, **overrides))

    return make


def _eager(model_dir: Path) -> bool:
    """Gemma 2's reference runs transformers' eager attention: its SDPA path drops the soft-cap."""
    config = json.loads((model_dir / "config.json").read_text())
    return bool(config["architectures"][0] == "Gemma2ForCausalLM")


@functools.cache
def hf_model(model_dir: Path) -> Any:
    kwargs = {"attn_implementation": "eager"} if _eager(model_dir) else {}
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()


def greedy(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    """A transformers model's greedy continuation of each prompt, MAX_TOKENS long."""
    model.generation_config.eos_token_id = None  # never stops early (paired with ignore_eos)
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
        outs.append(gen[0, len(p) :].tolist())
    return outs


def reference_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    if not _eager(model_dir):
        return hf_greedy(model_dir, prompts, MAX_TOKENS)
    model = hf_model(model_dir)
    assert model.config._attn_implementation == "eager"
    return greedy(model, prompts)


@functools.cache
def hf_reference(model_dir: Path) -> list[list[int]]:
    return reference_greedy(model_dir, PROMPTS)


def hf_logprobs(model_dir: Path, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + continuation])
    with torch.no_grad():
        logits = hf_model(model_dir)(ids).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(-1)


def make_llm(model_dir: Path, tp: int, **kwargs: Any) -> LLM:
    return LLM(model=model_dir, tensor_parallel_size=tp, dtype="float32", device="cpu", seed=0, **kwargs)


def check_against_hf(llm: LLM, model_dir: Path, prompts: list[list[int]] = PROMPTS) -> None:
    """Greedy tokens equal HF's; at every position the top-k ids equal HF's and their logprobs are within
    1e-4 of HF's."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=TOP_K, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    want = hf_reference(model_dir) if prompts is PROMPTS else reference_greedy(model_dir, prompts)
    assert_same_tokens(got, want, prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
        ref = hf_logprobs(model_dir, prompt, comp.token_ids)
        for pos, entry in enumerate(comp.logprobs):
            top_lp, top_ids = ref[pos].topk(TOP_K)
            assert set(entry) == set(top_ids.tolist()), f"position {pos}: top-{TOP_K} ids differ from HF"
            for tid, lp in zip(top_ids.tolist(), top_lp.tolist(), strict=True):
                assert entry[tid].logprob == pytest.approx(lp, abs=1e-4), f"position {pos}, token {tid}"


# ----------------------------------------------------------------------------- equivalence with HF

CASES = [
    ("qwen3", 1),
    ("qwen3", 2),
    ("qwen3-window", 1),
    ("mixtral", 1),
    ("mixtral", 2),
    ("mixtral", 4),  # 2 KV heads replicated over 4 ranks; each expert's 128 rows cut in 4
    ("qwen3-moe", 1),
    ("qwen3-moe", 2),
    ("qwen3-moe-step2", 1),
    ("qwen2-moe", 1),
    ("qwen2-moe", 2),
    ("gemma", 1),
    ("gemma", 2),
    ("gemma2", 1),
    ("gemma2", 2),
    ("gemma2", 4),  # 2 KV heads replicated over 4 ranks
    ("gemma2-global", 1),
    ("gemma3", 1),
    ("gemma3", 2),
    ("gemma3-mm", 2),  # TP=1: test_gemma3_multimodal_checkpoint_of_transformers_5_names_matches_hf
    ("phi3", 1),
    ("phi3", 2),
    ("phi3-partial", 1),
    ("phi3-partial", 2),
    ("granite", 1),
    ("granite", 2),
    ("olmo2", 1),
    ("olmo2", 2),  # one KV head a rank: the k norm's mean square is summed over the ranks
    ("olmo2", 4),  # 2 KV heads replicated over 4 ranks: each counted once in the k norm
    ("olmo3", 1),
    ("smollm3", 1),
    ("smollm3", 2),
]


@pytest.mark.parametrize(("family", "tp"), CASES, ids=[f"{f}-tp{tp}" for f, tp in CASES])
def test_matches_hf_with_chunked_prefill_and_preemption(
    family: str, tp: int, family_dir: Callable[[str], Path]
) -> None:
    model_dir = family_dir(family)
    with make_llm(model_dir, tp, **SCHED_KWARGS) as llm:
        check_against_hf(llm, model_dir)
        assert llm.engine.scheduler.num_preemptions > 0, "the test did not force a preemption"
    assert max(map(len, PROMPTS)) > SCHED_KWARGS["max_num_batched_tokens"], "no prompt was chunked"


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe"])
def test_decode_steps_with_idle_experts_match_hf(
    family: str, family_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests decode together: 2 tokens choose at most 2·top-k experts, so most get none; the loop
    runs exactly the experts that got tokens."""
    model_dir = family_dir(family)
    steps: list[tuple[int, int, int]] = []  # (tokens, experts that got tokens, experts run)
    route, expert_mlp = SparseMoE.route, SparseMoE._expert_mlp

    def spy_route(self: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = route(self, x)
        steps.append((x.shape[0], ids.unique().numel(), 0))
        return weights, ids

    def spy_expert_mlp(self: SparseMoE, x: torch.Tensor, expert: int) -> torch.Tensor:
        tokens, hit, run = steps[-1]
        steps[-1] = (tokens, hit, run + 1)
        return expert_mlp(self, x, expert)

    monkeypatch.setattr(SparseMoE, "route", spy_route)
    monkeypatch.setattr(SparseMoE, "_expert_mlp", spy_expert_mlp)
    prompts = random_prompts((9, 4), 300, seed=3)
    with make_llm(model_dir, 1, max_num_seqs=2) as llm:
        num_experts = llm.config.model.num_experts
        check_against_hf(llm, model_dir, prompts)
    assert all(hit == run for _, hit, run in steps), "the loop ran an expert no token chose, or missed one"
    idle_steps = [s for s in steps if s[0] <= 2 and s[1] < num_experts]
    assert idle_steps, f"no decode step left an expert idle: {steps[:8]}"


@pytest.mark.parametrize("impl", ["grouped", "dense"])
def test_cuda_expert_paths_in_padded_decode_steps_match_hf(
    impl: str, family_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The experts as the GPU runs them (sync-free, no per-expert host loop), in the decode-graph path's
    padded steps (run eagerly on CPU), through chunked prefill and preemption."""
    monkeypatch.setattr(moe, "pick_moe_impl", lambda *args: impl)
    model_dir = family_dir("mixtral")
    with make_llm(model_dir, 1, cuda_graphs="padded", **SCHED_KWARGS) as llm:
        check_against_hf(llm, model_dir)


@pytest.mark.parametrize("tp", [1, 2])
def test_gemma2_padded_decode_steps_match_hf(tp: int, family_dir: Callable[[str], Path]) -> None:
    """Gemma 2 in the decode-graph path's padded steps (run eagerly on CPU): each layer's window and
    soft-cap reach the padded decode batch, through chunked prefill and preemption."""
    model_dir = family_dir("gemma2")
    with make_llm(model_dir, tp, cuda_graphs="padded", **SCHED_KWARGS) as llm:
        check_against_hf(llm, model_dir)
        assert llm.engine.scheduler.num_preemptions > 0


def test_gemma2_caps_window_and_scale_change_the_output(family_dir: Callable[[str], Path]) -> None:
    """The test model is one where each Gemma 2 feature matters: without the attention soft-cap, with the
    window on every layer or on none, or with the scale from head_dim, HF's own greedy tokens change;
    without the final soft-cap (monotonic: the same tokens) the logprobs move by far more than 1e-4."""
    model_dir = family_dir("gemma2")
    want = hf_reference(model_dir)
    variants: dict[str, dict[str, Any]] = {
        "no attention cap": {"attn_logit_softcapping": None},
        "window everywhere": {"layer_types": ["sliding_attention"] * 3},
        "no window": {"layer_types": ["full_attention"] * 3},
        "scale from head_dim": {"query_pre_attn_scalar": 32},
        "no final cap": {"final_logit_softcapping": None},
    }
    for what, overrides in variants.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager", **overrides
        ).eval()
        if what == "no final cap":
            ids = torch.tensor([PROMPTS[0] + want[0]])
            with torch.no_grad():
                moved = model(ids).logits.log_softmax(-1) - hf_model(model_dir)(ids).logits.log_softmax(-1)
            assert moved.abs().max() > 0.1, f"{what}: the test model does not depend on it"
            continue
        assert greedy(model, PROMPTS) != want, f"{what}: the test model does not depend on it"


def hf_argmax(model: Any, continuations: list[list[int]]) -> list[list[int]]:
    """HF `model`'s next-token argmax along each of PROMPTS' `continuations` (one forward a prompt): what
    its greedy tokens would be, up to where they first differ from `continuations`."""
    with torch.no_grad():
        return [
            model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1].argmax(-1).tolist()
            for p, c in zip(PROMPTS, continuations, strict=True)
        ]


def test_gemma_norms_geglu_and_embedding_scale_change_the_output(family_dir: Callable[[str], Path]) -> None:
    """The Gemma test model is one where each of its own parts matters: with Llama's norm (w, not 1 + w),
    with SwiGLU, or without the sqrt(hidden_size) embedding scale, HF's own greedy tokens change (so the
    tokens equal to HF's above show each is applied). Checked in one forward pass a prompt: the greedy
    tokens change where some next-token argmax along HF's own continuation does."""
    model_dir = family_dir("gemma")
    want = hf_reference(model_dir)

    def llama_norms(model: Any) -> None:
        for name, p in model.named_parameters():
            if "norm" in name:
                p.sub_(1.0)  # (1 + (w - 1)) x: the checkpoint's w read as Llama reads it

    def unscaled(model: Any) -> None:
        model.model.embed_tokens.embed_scale.fill_(1.0)

    variants: dict[str, tuple[dict[str, Any], Callable[[Any], None]]] = {
        "Llama's norm": ({}, llama_norms),
        "SwiGLU": ({"hidden_act": "silu"}, lambda model: None),
        "no embedding scale": ({}, unscaled),
    }
    for what, (overrides, change) in variants.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **overrides)
        with torch.no_grad():
            change(model.eval())
        assert hf_argmax(model, want) != want, f"{what}: the test model does not depend on it"


def test_granite_scalings_change_the_output(family_dir: Callable[[str], Path]) -> None:
    """Each of the Granite test model's multipliers matters: set to 1, HF's own greedy tokens change (so
    the tokens equal to HF's above show each is applied; logits_scaling leaves the argmax as it is and
    shows in the logprobs compared there). Checked as the Gemma test above is."""
    model_dir = family_dir("granite")
    want = hf_reference(model_dir)
    for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier"):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, **{name: 1.0}
        ).eval()
        assert hf_argmax(model, want) != want, f"{name}: the test model does not depend on it"


def test_olmo2_post_norms_and_whole_projection_qk_norms_change_the_output(
    family_dir: Callable[[str], Path],
) -> None:
    """The OLMo 2 test model is one where its own parts matter: with Llama's pre-norms (each norm before
    its block, not after it), without the q/k norms, or with them per head (what a rank computes alone
    without the all-reduce at TP 4), HF's own greedy tokens change (so the tokens equal to HF's above show
    each is applied). Checked as the Gemma test above is. (Its float32 weight product equals Llama's order
    in float32, so no float32 test can show it.)"""
    model_dir = family_dir("olmo2")
    want = hf_reference(model_dir)

    def pre_norms(model: Any) -> None:
        for layer in model.model.layers:

            def forward(hidden_states: torch.Tensor, *, layer: Any = layer, **kwargs: Any) -> torch.Tensor:
                attended, _ = layer.self_attn(layer.post_attention_layernorm(hidden_states), **kwargs)
                hidden_states = hidden_states + attended
                return hidden_states + layer.mlp(layer.post_feedforward_layernorm(hidden_states))

            layer.forward = forward

    class PerHeadNorm(torch.nn.Module):
        def __init__(self, norm: Any, head_dim: int) -> None:
            super().__init__()
            self.norm, self.head_dim = norm, head_dim

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x.unflatten(-1, (-1, self.head_dim))
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm.variance_epsilon)
            return self.norm.weight * h.flatten(-2)

    def qk_norms(replace: Callable[[Any, Any], torch.nn.Module]) -> Callable[[Any], None]:
        def change(model: Any) -> None:
            for layer in model.model.layers:
                attn = layer.self_attn
                attn.q_norm, attn.k_norm = replace(attn.q_norm, attn), replace(attn.k_norm, attn)

        return change

    variants: dict[str, Callable[[Any], None]] = {
        "Llama's pre-norms": pre_norms,
        "no q/k norms": qk_norms(lambda norm, attn: torch.nn.Identity()),
        "per-head q/k norms": qk_norms(lambda norm, attn: PerHeadNorm(norm, attn.head_dim)),
    }
    for what, change in variants.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            change(model.eval())
        assert hf_argmax(model, want) != want, f"{what}: the test model does not depend on it"


def test_olmo3_windows_and_rope_per_layer_type(family_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """OLMo 3's windowed layers and their own rope reach ModelConfig, and each matters to HF's own greedy
    tokens (no window, or the global layers' rope everywhere: checked as the Gemma test above is). A
    layer kind other than sliding or full attention is a ConfigError, as is a transformers 4 config with
    rope_scaling (which its OLMo 3 gives to the global layers only, and ModelConfig could not tell)."""
    from types import SimpleNamespace

    from tp_runtime.models.olmo2 import olmo3_config

    model_dir = family_dir("olmo3")
    cfg = build_model_config(model_dir, device="cpu")
    assert cfg.sliding_window == 6 and cfg.sliding_window_layers == (0, 2)
    assert [cfg.layer_window(i) for i in range(3)] == [6, None, 6]
    assert cfg.local_rope is not None and (cfg.local_rope.rope_type, cfg.local_rope.theta) == ("default", 5e5)
    assert (cfg.rope.rope_type, cfg.rope.theta) == ("yarn", 1e4) and cfg.max_model_len == 512
    assert cfg.attention_scale == cfg.head_dim**-0.5 and not cfg.qkv_bias
    olmo2 = build_model_config(family_dir("olmo2"), device="cpu")
    assert olmo2.qkv_bias and olmo2.o_proj_bias and not olmo2.mlp_bias and olmo2.head_dim == 32
    assert olmo2.sliding_window is None and olmo2.local_rope is None

    want = hf_reference(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    full_rope = config["rope_parameters"]["full_attention"]
    variants: dict[str, dict[str, Any]] = {
        "no window": {"layer_types": ["full_attention"] * 3},
        "one rope": {"rope_parameters": {"full_attention": full_rope, "sliding_attention": full_rope}},
    }
    for what, overrides in variants.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, **overrides
        ).eval()
        assert hf_argmax(model, want) != want, f"{what}: the test model does not depend on it"

    chunked = ["sliding_attention", "chunked_attention", "full_attention"]  # a kind transformers accepts
    (tmp_path / "config.json").write_text(json.dumps({**config, "layer_types": chunked}))
    with pytest.raises(ConfigError, match=r"OLMo 3 layer_types .* must name sliding_attention or full"):
        build_model_config(tmp_path, device="cpu")
    v4 = SimpleNamespace(
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=4096,
        rope_theta=5e5, rope_scaling={"rope_type": "yarn", "factor": 8.0},
    )  # fmt: skip
    with pytest.raises(ConfigError, match="OLMo 3 with rope_scaling needs transformers >= 5"):
        olmo3_config(v4)
    unscaled = SimpleNamespace(**{**vars(v4), "rope_scaling": None})
    assert olmo3_config(unscaled)["sliding_window_layers"] == (0,)


def test_smollm3_nope_layers_and_window_change_the_output(
    family_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """SmolLM3's layers without rotary embedding and its windowed layer reach ModelConfig (from
    no_rope_layer_interval too, where the config leaves no_rope_layers out), and each matters to HF's own
    greedy tokens (rotary on every layer, or no window: checked as the Gemma test above is). A no_rope_layers
    that does not give 0 or 1 for each layer, or a sliding layer without a window, is a ConfigError."""
    model_dir = family_dir("smollm3")
    cfg = build_model_config(model_dir, device="cpu")
    assert cfg.nope_layers == (1,) and cfg.sliding_window_layers == (1,) and cfg.local_rope is None
    assert [cfg.layer_window(i) for i in range(3)] == [None, 6, None]
    assert cfg.tie_word_embeddings and not cfg.qkv_bias and not cfg.mlp_bias

    want = hf_reference(model_dir)
    variants: dict[str, dict[str, Any]] = {
        "rotary on every layer": {"no_rope_layers": [1, 1, 1]},
        "no window": {"layer_types": ["full_attention"] * 3},
    }
    for what, overrides in variants.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, **overrides
        ).eval()
        assert hf_argmax(model, want) != want, f"{what}: the test model does not depend on it"

    config = json.loads((model_dir / "config.json").read_text())
    by_interval = {k: v for k, v in config.items() if k not in ("no_rope_layers", "layer_types")}
    cases: dict[str, tuple[dict[str, Any], str | None]] = {
        # transformers: every 2nd layer NoPE, and (use_sliding_window) windowed.
        "interval": ({**by_interval, "num_hidden_layers": 4, "no_rope_layer_interval": 2}, None),
        "short": ({**config, "no_rope_layers": [1, 0]}, r"no_rope_layers \[1, 0\] must give 1 .* 3 layers"),
        "not a flag": ({**config, "no_rope_layers": [1, 2, 1]}, r"no_rope_layers \[1, 2, 1\] must give 1"),
        "no window": (
            {**config, "sliding_window": None},
            r"SmolLM3 layer_types marks layers \[1\] sliding_attention but sliding_window is None",
        ),
    }
    for what, (changed, error) in cases.items():
        folder = tmp_path / what.replace(" ", "-")
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(changed))
        if error is not None:
            with pytest.raises(ConfigError, match=error):
                build_model_config(folder, device="cpu")
            continue
        interval = build_model_config(folder, device="cpu")
        assert interval.nope_layers == (1, 3) and interval.sliding_window_layers == (1, 3), what


def test_qwen2_moe_shared_expert_gate_and_biases_change_the_output(family_dir: Callable[[str], Path]) -> None:
    """The Qwen2-MoE test model is one where its own parts matter: without the shared expert, with it
    ungated (a gate of 1), or without the q/k/v biases, HF's own greedy tokens change (so the tokens equal
    to HF's above show each is applied). Checked as the Gemma test above is."""
    model_dir = family_dir("qwen2-moe")
    want = hf_reference(model_dir)

    class Saturated(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.full((*x.shape[:-1], 1), 50.0)  # sigmoid(50) is 1 in float32

    def sparse_blocks(model: Any) -> list[Any]:
        blocks = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "shared_expert")]
        assert len(blocks) == 1
        return blocks

    def no_shared_expert(model: Any) -> None:
        for block in sparse_blocks(model):
            block.shared_expert.down_proj.weight.zero_()

    def ungated(model: Any) -> None:
        for block in sparse_blocks(model):
            block.shared_expert_gate = Saturated()

    def no_bias(model: Any) -> None:
        for layer in model.model.layers:
            for proj in ("q_proj", "k_proj", "v_proj"):
                getattr(layer.self_attn, proj).bias.zero_()

    variants: dict[str, Callable[[Any], None]] = {
        "no shared expert": no_shared_expert,
        "ungated shared expert": ungated,
        "no q/k/v bias": no_bias,
    }
    for what, change in variants.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            change(model.eval())
        assert hf_argmax(model, want) != want, f"{what}: the test model does not depend on it"


def test_qwen2_moe_config_fields_and_bad_settings(family_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """Qwen2-MoE's fields reach ModelConfig: sparse layers from mlp_only_layers and decoder_sparse_step, the
    shared expert's width, q/k/v (not o) biases, the windows transformers gives layer_types from
    use_sliding_window and max_window_layers. A TP size that does not divide the shared expert's width
    (read from config.json too), a shared expert of no width, and sliding layers without a window are
    ConfigErrors."""
    from tp_runtime.config import TPShape, read_config_json

    model_dir = family_dir("qwen2-moe")
    cfg = build_model_config(model_dir, device="cpu")
    assert cfg.moe_layers == (1,) and cfg.shared_expert_intermediate_size == 48 and not cfg.norm_topk_prob
    assert cfg.qkv_bias and not cfg.o_proj_bias and cfg.sliding_window is None
    config = json.loads((model_dir / "config.json").read_text())
    del config["layer_types"]  # transformers makes them from use_sliding_window and max_window_layers
    cases: dict[str, tuple[dict[str, Any], str | None]] = {
        "step and windows": (
            {
                "num_hidden_layers": 4,
                "mlp_only_layers": [],
                "decoder_sparse_step": 2,
                "use_sliding_window": True,
                "sliding_window": 8,
                "max_window_layers": 3,
            },
            None,
        ),
        "narrow shared expert": ({"shared_expert_intermediate_size": 30}, "tensor_parallel_size=4"),
        "no shared expert": (
            {"shared_expert_intermediate_size": 0},
            "Qwen2-MoE shared_expert_intermediate_size must be a positive int",
        ),
        "sliding without a window": (
            {"layer_types": ["sliding_attention", "full_attention"]},
            r"Qwen2-MoE layer_types marks layers \[0\] sliding_attention but sliding_window is 0",
        ),
    }
    for what, (change, error) in cases.items():
        folder = tmp_path / what.replace(" ", "-")
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        if error is not None and not error.startswith("tensor_parallel_size"):
            with pytest.raises(ConfigError, match=error):
                build_model_config(folder, device="cpu")
            continue
        changed = build_model_config(folder, device="cpu")
        shape = TPShape.of_config_json(read_config_json(folder))
        assert shape == TPShape.of_model(changed), what
        if error is not None:  # 30 rows split in 2, not in 4
            assert shape.sizes() == [1, 2]
            with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 does not divide the shared"):
                shape.check(4)
            continue
        assert changed.moe_layers == (1, 3) and changed.sliding_window == 8
        assert [changed.layer_window(i) for i in range(4)] == [8, None, 8, None]


@pytest.mark.parametrize("family", ["qwen2-moe", "smollm3"])
def test_online_fp8_with_prefix_caching_matches_hf(
    family: str, family_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """Online FP8 (every linear layer per output channel, Qwen2-MoE's shared expert too; its router and
    shared expert gate stay in the model dtype) with prefix caching: HF's greedy tokens on the weights FP8
    makes of them, and the second pass finds the prompts' blocks cached."""
    from test_fp8 import online_fp8_reference

    model_dir = family_dir(family)
    ref = online_fp8_reference(model_dir, tmp_path / "ref")
    stem = PROMPTS[2]
    prompts = [stem[:12] + PROMPTS[1], stem, stem[:16]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with make_llm(model_dir, 1, quantization="fp8", block_size=4, max_num_seqs=2) as llm:
        passes = [llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        passes.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
        layers = llm.engine.executor.worker.runner.model.model.layers
    if family == "qwen2-moe":
        moe_block = layers[1].mlp
        assert moe_block.shared_expert.gate_up_proj.weight.dtype == torch.float8_e4m3fn
        assert moe_block.w13.dtype == torch.float8_e4m3fn
        assert moe_block.shared_expert_gate.dtype == moe_block.router.dtype == torch.float32
    want = hf_greedy(ref, prompts, 6)
    for outs in passes:
        assert_same_tokens([o.outputs[0].token_ids for o in outs], want, prompts)
    assert all(o.num_cached_tokens >= 12 for o in passes[1])


def test_granite_config_fields_and_bad_scalings(family_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """Granite's scalings reach ModelConfig (its attention scale is attention_multiplier itself); one
    that is not a positive number is a ConfigError naming it."""
    model_dir = family_dir("granite")
    granite = build_model_config(model_dir, device="cpu")
    assert granite.attention_scale == 0.0625 and granite.embedding_multiplier == 6.0
    assert granite.residual_multiplier == 0.3 and granite.logits_scaling == 4.0
    assert granite.qkv_bias and granite.o_proj_bias and not granite.mlp_bias
    config = json.loads((model_dir / "config.json").read_text())
    for name, value in (("logits_scaling", 0), ("residual_multiplier", -1.0)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, name: value}))
        with pytest.raises(ConfigError, match=f"Granite {name} must be a positive number"):
            build_model_config(folder, device="cpu")
    # A value of the wrong type: transformers' own check, as a ConfigError that names the field.
    (tmp_path / "typed").mkdir()
    (tmp_path / "typed" / "config.json").write_text(json.dumps({**config, "attention_multiplier": "x"}))
    with pytest.raises(ConfigError, match=r"could not read .*attention_multiplier"):
        build_model_config(tmp_path / "typed", device="cpu")


# ----------------------------------------------------------------------------- attention alone


def _brute_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor, window: int | None,
    scale: float, softcap: float | None,
) -> torch.Tensor:  # fmt: skip
    """q [n, H, D] at positions q_pos; keys/values [T, KVH, D] at 0..T-1 -> [n, H, D], in float64."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    k_pos = torch.arange(keys.shape[0])
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(heads):
        kv = h // (heads // kv_heads)
        s = q[:, h].double() @ keys[:, kv].double().T * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        out[:, h] = torch.softmax(s.masked_fill(~allowed, -math.inf), 1) @ values[:, kv].double()
    return out


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("window", [None, 5])
def test_torch_attention_per_layer_window_and_softcap(
    window: int | None, softcap: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """paged_attention with the layer's window and soft-cap, TorchAttention: a decode row, a continuation
    chunk, a fresh prompt with its block table and one without (its own keys: the runner gives none when
    the model has no window, nor in the memory-profiling run), against a float64 brute force; the
    soft-capped path's query-row slicing (for long prompts) changes nothing."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, bs = 4, 2, 16, 4
    lens = {"decode": 11, "continuation": 14, "fresh": 9, "fresh-no-table": 7}
    new_tokens = {"decode": 1, "continuation": 6, "fresh": 9, "fresh-no-table": 7}
    k_cache = 100 * torch.randn(40, bs, kv_heads, d, generator=g)  # stale slots must not leak in
    v_cache = 100 * torch.randn(40, bs, kv_heads, d, generator=g)
    keys = {name: torch.randn(n, kv_heads, d, generator=g) for name, n in lens.items()}
    values = {name: torch.randn(n, kv_heads, d, generator=g) for name, n in lens.items()}
    tables, free = {}, iter(torch.randperm(40, generator=g).tolist())
    for name, n in lens.items():
        tables[name] = torch.tensor([next(free) for _ in range(-(-n // bs))])
        for pos in range(n):
            k_cache[tables[name][pos // bs], pos % bs] = keys[name][pos]
            v_cache[tables[name][pos // bs], pos % bs] = values[name][pos]
    q = {name: torch.randn(new_tokens[name], heads, d, generator=g) for name in lens}
    order = list(lens)  # decode first, as the runner lays out a step
    starts = {name: sum(new_tokens[n] for n in order[: order.index(name)]) for name in order}
    prefills = []
    for name in order[1:]:
        n, start = new_tokens[name], starts[name]
        table = torch.zeros(0, dtype=torch.int64) if name == "fresh-no-table" else tables[name]
        prefills.append(PrefillChunk(start, start + n, lens[name] - n, table))
    decode = dict(
        backend=TorchAttention(), slot_mapping=torch.zeros(0, dtype=torch.int64), num_decode_tokens=1,
        decode_block_tables=tables["decode"][None], decode_seq_lens=torch.tensor([lens["decode"]]),
    )  # fmt: skip
    meta = AttentionMetadata(**decode, prefills=prefills)  # type: ignore[arg-type]
    step_k = torch.cat([keys[name][lens[name] - new_tokens[name] :] for name in order])
    step_v = torch.cat([values[name][lens[name] - new_tokens[name] :] for name in order])
    scale = 0.3
    out = paged_attention(
        torch.cat([q[n] for n in order]), step_k, step_v, k_cache, v_cache, meta, scale, window, softcap
    )
    for name in order:
        n, start = new_tokens[name], starts[name]
        q_pos = torch.arange(lens[name] - n, lens[name])
        want = _brute_attention(q[name], keys[name], values[name], q_pos, window, scale, softcap)
        torch.testing.assert_close(out[start : start + n].double(), want, rtol=1e-5, atol=1e-5, msg=name)
    if softcap is not None:
        monkeypatch.setattr(attention, "_SOFTCAP_SCORES", 192)  # a few query rows per slice
        sliced = paged_attention(
            torch.cat([q[n] for n in order]), step_k, step_v, k_cache, v_cache, meta, scale, window, softcap
        )
        torch.testing.assert_close(sliced, out, rtol=0, atol=1e-6)
    # Decode alone (the decode-only fast path).
    alone_meta = AttentionMetadata(**decode)  # type: ignore[arg-type]
    alone = paged_attention(
        q["decode"], step_k[:1], step_v[:1], k_cache, v_cache, alone_meta, scale, window, softcap
    )
    torch.testing.assert_close(alone, out[:1], rtol=0, atol=0)


def test_fresh_prompts_attend_in_batches() -> None:
    """Fresh prompts of a step are attended in batches (longest first, each prompt at least 7/8 of its
    batch's longest, padded on the right): each prompt's output against a float64 brute force over its own
    keys, with a decode row first; equal back-to-back prompts form a view batch, others a gathered one."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, bs = 6, 2, 12, 4
    lengths = [5, 5, 5, 12, 11, 3, 12, 1, 7, 6]
    starts = [1 + sum(lengths[:i]) for i in range(len(lengths))]  # after the decode row
    total = 1 + sum(lengths)
    q = torch.randn(total, heads, d, generator=g)
    k = torch.randn(total, kv_heads, d, generator=g)
    v = torch.randn(total, kv_heads, d, generator=g)
    k_cache = 100 * torch.randn(8, bs, kv_heads, d, generator=g)  # stale slots must not leak in
    v_cache = 100 * torch.randn(8, bs, kv_heads, d, generator=g)
    no_table = torch.zeros(0, dtype=torch.int64)
    meta = AttentionMetadata(
        backend=TorchAttention(), slot_mapping=torch.zeros(0, dtype=torch.int64), num_decode_tokens=1,
        decode_block_tables=torch.tensor([[3, 5]]), decode_seq_lens=torch.tensor([6]),
        prefills=[PrefillChunk(s, s + n, 0, no_table) for s, n in zip(starts, lengths, strict=True)],
    )  # fmt: skip
    plan = [(b.lengths, b.gather is None) for b in meta.fresh_batches]
    views = [([7], True), ([6], True), ([5, 5, 5], True), ([3], True), ([1], True)]
    assert plan == [([12, 12, 11], False), *views]
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.3, None, None)
    for s, n in zip(starts, lengths, strict=True):
        want = _brute_attention(q[s : s + n], k[s : s + n], v[s : s + n], torch.arange(n), None, 0.3, None)
        torch.testing.assert_close(out[s : s + n].double(), want, rtol=1e-5, atol=1e-5)
    keys, values = k_cache[[3, 5]].flatten(0, 1), v_cache[[3, 5]].flatten(0, 1)
    want = _brute_attention(q[:1], keys[:6], values[:6], torch.tensor([5]), None, 0.3, None)
    torch.testing.assert_close(out[:1].double(), want, rtol=1e-5, atol=1e-5)
    # A windowed layer attends each fresh prompt alone: a step whose layers all window never batches them.
    windowed_meta = dataclasses.replace(meta)
    out = paged_attention(q, k, v, k_cache, v_cache, windowed_meta, 0.3, 4, None)
    assert "fresh_batches" not in vars(windowed_meta)
    for s, n in zip(starts, lengths, strict=True):
        want = _brute_attention(q[s : s + n], k[s : s + n], v[s : s + n], torch.arange(n), 4, 0.3, None)
        torch.testing.assert_close(out[s : s + n].double(), want, rtol=1e-5, atol=1e-5)


def _reference_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    """A varlen kernel's contract, spelled out: each packed sequence causal over its own keys."""
    bounds = cu.tolist()
    assert max_len == max(b - a for a, b in itertools.pairwise(bounds))
    out = torch.empty_like(q)
    for a, b in itertools.pairwise(bounds):
        attended = _brute_attention(q[a:b], k[a:b], v[a:b], torch.arange(b - a), None, scale, None)
        out[a:b] = attended.to(q.dtype)
    return out


@pytest.mark.parametrize("back_to_back", [True, False])
def test_fresh_prompts_packed_for_one_varlen_call(back_to_back: bool) -> None:
    """PackedVarlen (FlashAttention's varlen kernel on CUDA) with a reference kernel: every fresh prompt of
    the step in one call over the packed tokens, each output against the brute force, around a decode row
    and (when not back to back) a continuation chunk between them, which the packing must leave out."""
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, d, bs = 6, 2, 12, 4
    lengths = [5, 12, 1, 7]
    chunks, starts, row = [], [], 1  # row 0: a decode row
    for i, n in enumerate(lengths):
        if not back_to_back and i == 2:
            chunks.append(PrefillChunk(row, row + 3, 4, torch.tensor([1, 2])))  # a continuation chunk
            row += 3
        chunks.append(PrefillChunk(row, row + n, 0, torch.zeros(0, dtype=torch.int64)))
        starts.append(row)
        row += n
    q = torch.randn(row, heads, d, generator=g)
    k = torch.randn(row, kv_heads, d, generator=g)
    v = torch.randn(row, kv_heads, d, generator=g)
    k_cache = torch.randn(8, bs, kv_heads, d, generator=g)
    v_cache = torch.randn(8, bs, kv_heads, d, generator=g)
    meta = AttentionMetadata(
        backend=TorchAttention(attention.PackedVarlen(_reference_varlen)),
        slot_mapping=torch.zeros(0, dtype=torch.int64), num_decode_tokens=1,
        decode_block_tables=torch.tensor([[3, 5]]), decode_seq_lens=torch.tensor([6]), prefills=chunks,
    )  # fmt: skip
    packed = meta.fresh_packed
    assert packed.cu_seqlens.tolist() == [0, 5, 17, 18, 25] and packed.max_len == 12
    assert (packed.rows is None) == back_to_back
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.3, None, None)
    for s, n in zip(starts, lengths, strict=True):
        want = _brute_attention(q[s : s + n], k[s : s + n], v[s : s + n], torch.arange(n), None, 0.3, None)
        torch.testing.assert_close(out[s : s + n].double(), want, rtol=1e-5, atol=1e-5)
    # The same step through today's padded SDPA batches gives the same rows.
    padded = dataclasses.replace(meta, backend=TorchAttention())
    torch.testing.assert_close(paged_attention(q, k, v, k_cache, v_cache, padded, 0.3, None, None), out)


def test_large_fresh_steps_run_padded_sdpa() -> None:
    """PackedVarlen: a step of padded_from_tokens fresh tokens or more whose prompts share one length runs
    padded SDPA (cuDNN's plan pays for a shape that comes back); a smaller step, one prompt, or prompts of
    several lengths (a new padded shape nearly every step) take the varlen call; all give the brute
    force's rows."""
    calls: list[int] = []

    def kernel(*args: Any) -> torch.Tensor:
        calls.append(1)
        return _reference_varlen(*args)

    fresh = attention.PackedVarlen(kernel, padded_from_tokens=20)
    g = torch.Generator().manual_seed(3)

    def step(lengths: list[int]) -> int:
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        total = sum(lengths)
        q, k, v = (torch.randn(total, h, 8, generator=g) for h in (4, 2, 2))
        no_table = torch.zeros(0, dtype=torch.int64)
        chunks = [PrefillChunk(s, s + n, 0, no_table) for s, n in zip(starts, lengths, strict=True)]
        meta = AttentionMetadata(backend=TorchAttention(fresh), slot_mapping=no_table, num_decode_tokens=0,
                                 prefills=chunks)  # fmt: skip
        before = len(calls)
        for _layer in range(3):
            out = paged_attention(q, k, v, torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), meta, 0.5)
        for s, n in zip(starts, lengths, strict=True):
            rows = slice(s, s + n)
            want = _brute_attention(q[rows], k[rows], v[rows], torch.arange(n), None, 0.5, None)
            torch.testing.assert_close(out[rows].double(), want, rtol=1e-5, atol=1e-5)
        return len(calls) - before  # varlen calls of the step's three layers

    assert step([12, 7]) == 3  # 19 tokens: one varlen call a layer
    assert step([10, 10]) == 0  # 20 tokens of one length: padded SDPA
    assert step([7, 7, 7]) == 0
    assert step([12, 8]) == 3  # 20 tokens of two lengths: varlen
    assert step([16, 9, 3]) == 3
    assert step([25]) == 3  # one prompt


def test_fresh_prompts_use_sdpa_where_flash_varlen_cannot_run() -> None:
    """On the CPU (and for float32, or a head_dim the kernel refuses) no varlen kernel is chosen."""
    assert attention.flash_varlen_kernel(torch.device("cpu"), torch.bfloat16, 128, 4) is None
    backend = attention.make_attention_backend(
        "torch", torch.device("cpu"), 2, 16, num_heads=8, head_dim=64, dtype=torch.float32
    )
    assert isinstance(backend.fresh_prompts, attention.PaddedSDPA)


# ----------------------------------------------------------------------------- the MoE layer alone


def _moe(tp: TPGroup, impl: str, **kwargs: Any) -> SparseMoE:
    """A SparseMoE filled with dummy weights, which give every rank its slice of the same full tensors."""
    layer = SparseMoE(
        hidden_size=64, intermediate_size=64, num_experts=8, top_k=2, expert_names=("w1", "w3", "w2"),
        tp=tp, dtype=torch.float32, device=torch.device("cpu"), fused=False, impl=impl, **kwargs,
    )  # fmt: skip
    for index, (_, shape, param, shard) in enumerate(layer.checkpoint_entries("")):
        source = loader.DummyTensor(
            shape, 11 + index, shape[-1] ** -0.5, 0.0, torch.float32, torch.device("cpu")
        )
        param.weight_loader(param, source, shard)  # type: ignore[attr-defined]
    return layer


@pytest.mark.parametrize(
    "routing",
    [dict(renormalize=True, fp32_weights=True), dict(renormalize=False, fp32_weights=False)],
    ids=["mixtral-routing", "qwen3-moe-routing"],
)
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_expert_paths_and_tp_shards_agree(tokens: int, routing: dict[str, bool]) -> None:
    """loop == grouped == dense at TP=1, and at TP=2 and 4 the ranks' partial outputs (each rank's experts
    summed before the one all-reduce, done here by hand) add up to the TP=1 output."""
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        want = _moe(TPGroup(0, 1), "loop", **routing)(x)
        for impl in ("grouped", "dense"):
            torch.testing.assert_close(_moe(TPGroup(0, 1), impl, **routing)(x), want, rtol=0, atol=1e-5)
        for tp in (2, 4):
            for impl in ("loop", "grouped", "dense"):
                parts = [_moe(TPGroup(r, tp, IdentityAllReduce()), impl, **routing)(x) for r in range(tp)]
                torch.testing.assert_close(torch.stack(parts).sum(0), want, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- sharding


def _expected(
    hf: dict[str, torch.Tensor], name: str, arch: str, cfg: Any, tp: int, rank: int
) -> torch.Tensor:
    """The slice of HF tensors rank `rank` must hold for our parameter `name` (written independently)."""

    def rows(t: torch.Tensor, parts: int, index: int) -> torch.Tensor:
        size = t.shape[0] // parts
        return t[index * size : (index + 1) * size]

    def cols(t: torch.Tensor) -> torch.Tensor:
        return rows(t.T, tp, rank).T

    layer, _, leaf = name.rpartition(".")
    kv_heads = cfg.num_kv_heads
    kv_index, kv_parts = (rank, tp) if kv_heads >= tp else (rank * kv_heads // tp, kv_heads)
    if layer.endswith("qkv_proj"):  # weight and bias alike
        base = layer.removesuffix("qkv_proj")
        q = rows(hf[f"{base}q_proj.{leaf}"], tp, rank)
        k = rows(hf[f"{base}k_proj.{leaf}"], kv_parts, kv_index)
        v = rows(hf[f"{base}v_proj.{leaf}"], kv_parts, kv_index)
        return torch.cat([q, k, v])
    if leaf == "bias" and layer.endswith("o_proj"):
        return hf[name]  # added once, after the sum
    if layer.endswith("gate_up_proj"):
        base = layer.removesuffix("gate_up_proj")
        return torch.cat(
            [rows(hf[f"{base}gate_proj.weight"], tp, rank), rows(hf[f"{base}up_proj.weight"], tp, rank)]
        )
    if layer.endswith(("o_proj", "down_proj")):
        return cols(hf[name])
    if leaf == "shared_expert_gate":
        return hf[f"{layer}.shared_expert_gate.weight"]  # replicated, as the router
    if leaf in ("router", "w13", "w2"):
        (gate, up, down), ffn = EXPERT_NAMES[arch]
        ffn = layer.removesuffix("mlp") + ffn
        if leaf == "router":
            return hf[f"{ffn}.gate.weight"]
        experts = range(cfg.num_experts)
        if leaf == "w2":
            return torch.stack([cols(hf[f"{ffn}.experts.{e}.{down}.weight"]) for e in experts])
        return torch.stack(
            [
                torch.cat([rows(hf[f"{ffn}.experts.{e}.{p}.weight"], tp, rank) for p in (gate, up)])
                for e in experts
            ]
        )
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        full = hf.get(name, hf["model.embed_tokens.weight"])
        per = -(-cfg.vocab_size // tp)
        shard = torch.zeros(per, full.shape[1])
        part = full[rank * per : min((rank + 1) * per, cfg.vocab_size)]
        shard[: part.shape[0]] = part
        return shard
    if arch in ("Olmo2ForCausalLM", "Olmo3ForCausalLM") and layer.endswith(("q_norm", "k_norm")):
        # OLMo's q/k norms span the whole projection: each rank holds its (query or key) heads' part.
        return rows(hf[name], tp, rank) if layer.endswith("q_norm") else rows(hf[name], kv_parts, kv_index)
    return hf[name]  # layer norms (Gemma 2's four per layer too) and other q_norm / k_norm are replicated


SHARD_CASES = [
    ("qwen3", 2), ("qwen3", 4), ("mixtral", 2), ("mixtral", 4), ("qwen3-moe", 2),
    ("gemma", 2), ("gemma2", 2), ("gemma2", 4), ("gemma2-global", 2), ("olmo2", 2), ("olmo2", 4),
    ("qwen2-moe", 2), ("qwen2-moe", 4),
]  # fmt: skip


@pytest.mark.parametrize(("family", "tp"), SHARD_CASES, ids=[f"{f}-tp{tp}" for f, tp in SHARD_CASES])
def test_each_rank_holds_its_slice(
    family: str, tp: int, family_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = family_dir(family)
    arch = FAMILIES[family][0]
    cfg = build_model_config(model_dir, dtype="float32", device="cpu")
    hf = load_file(str(model_dir / "model.safetensors"))
    full_elements = sum(t.numel() for t in hf.values())
    read = count_checkpoint_reads(monkeypatch)
    for rank in range(tp):
        read.clear()
        model = model_class(arch)(cfg, TPGroup(rank, tp), torch.float32, torch.device("cpu"))
        loader.load_weights(model, str(model_dir), torch.float32)
        for name, param in model.named_parameters():  # type: ignore[attr-defined]
            assert torch.equal(param.data, _expected(hf, name, arch, cfg, tp, rank)), f"rank {rank}: {name}"
        # Norms, routers and replicated KV heads are read in full; everything else only this rank's part.
        assert sum(read) < full_elements / tp * 1.35, (rank, sum(read), full_elements)


# ----------------------------------------------------------------------------- Gemma 3 multimodal checkpoints

# The names of a Gemma3ForConditionalGeneration checkpoint's tensors as the releases and transformers'
# save_pretrained write them -> as transformers 5 names its parameters (what a state dict saved as it is
# holds).
GEMMA3_MM_MODULE_NAMES = {
    "language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
    "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector.",
}  # fmt: skip
GEMMA3_MM_VISION = (
    "vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."
)  # fmt: skip


def gemma3_mm_layouts(family_dir: Callable[[str], Path]) -> dict[str, Path]:
    """The gemma3-mm checkpoint as save_pretrained wrote it (the releases' names: language_model.model.*,
    vision_tower.*, multi_modal_projector.*, the tied LM head left out) and two copies (cached next to it):
    with the LM head a checkpoint may hold as well, under the releases' name (language_model.lm_head), and
    with every tensor under transformers 5's parameter names, the head (lm_head) included."""
    saved = family_dir("gemma3-mm")
    tensors = load_file(str(saved / "model.safetensors"))
    parts = {name.split(".")[0] for name in tensors}
    assert parts == {"language_model", "vision_tower", "multi_modal_projector"}
    head = tensors["language_model.model.embed_tokens.weight"].clone()
    module_names = {}
    for name, tensor in tensors.items():
        [prefix] = [p for p in GEMMA3_MM_MODULE_NAMES if name.startswith(p)]
        module_names[GEMMA3_MM_MODULE_NAMES[prefix] + name[len(prefix) :]] = tensor
    copies = {
        "with-head": {**tensors, "language_model.lm_head.weight": head},
        "module-names": {**module_names, "lm_head.weight": head},
    }
    layouts = {"saved": saved}
    for what, renamed in copies.items():
        out = saved.with_name(f"{saved.name}-{what}")
        if not (out / "config.json").is_file():
            tmp = saved.with_name(f"{saved.name}-{what}-tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(saved, tmp)
            save_file(renamed, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            tmp.rename(out)
        layouts[what] = out
    return layouts


def test_gemma3_multimodal_checkpoint_loads_its_language_model_only(
    family_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under each naming, every rank of TP=2 holds its slice of the language model's tensors (cut by hand
    from the checkpoint as saved), reads about 1/TP of them and never a tensor of the vision tower or the
    projector; transformers reads each copy as the same model."""
    layouts = gemma3_mm_layouts(family_dir)
    saved = load_file(str(layouts["saved"] / "model.safetensors"))
    language = {
        "model." + name.removeprefix("language_model.model."): t
        for name, t in saved.items()
        if name.startswith("language_model.model.")
    }
    language_elements = sum(t.numel() for t in language.values())
    reference = hf_model(layouts["saved"])
    assert type(reference).__name__ == "Gemma3ForConditionalGeneration"
    want_hf = reference.state_dict()
    read: list[tuple[str, int]] = []
    original_read = loader.SafetensorsFile.read

    def recording_read(self: loader.SafetensorsFile, name: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        out: torch.Tensor = original_read(self, name, *args, **kwargs)
        read.append((name, out.numel()))
        return out

    monkeypatch.setattr(loader.SafetensorsFile, "read", recording_read)
    cfg = build_model_config(layouts["saved"], dtype="float32", device="cpu")
    arch = architecture(cfg.architecture)
    for what, folder in layouts.items():
        for rank in range(2):
            read.clear()
            model = arch.model(cfg, TPGroup(rank, 2), torch.float32, torch.device("cpu"))
            loader.load_weights(model, str(folder), torch.float32, None, arch.checkpoint_names)
            for name, param in model.named_parameters():  # type: ignore[attr-defined]
                want = _expected(language, name, "Gemma3ForCausalLM", cfg, 2, rank)
                assert torch.equal(param.data, want), f"{what}, rank {rank}: {name}"
            vision = [name for name, _ in read if name.startswith(GEMMA3_MM_VISION)]
            assert not vision, f"{what}, rank {rank}: read {vision}"
            elements = sum(n for _, n in read)
            assert elements < language_elements / 2 * 1.35, (what, rank, elements, language_elements)
        if what != "saved":
            got_hf = hf_model(folder).state_dict()
            assert got_hf.keys() == want_hf.keys(), what
            assert all(torch.equal(got_hf[k], want_hf[k]) for k in want_hf), what


def test_gemma3_multimodal_checkpoint_of_transformers_5_names_matches_hf(
    family_dir: Callable[[str], Path],
) -> None:
    """At TP=1, through chunked prefill and preemption, the checkpoint with transformers 5's names gives
    HF's greedy tokens (transformers' Gemma3ForConditionalGeneration on the checkpoint as saved, text only);
    a chat of text content parts gives HF's continuation of its prompt, and one with an image is refused."""
    layouts = gemma3_mm_layouts(family_dir)
    with make_llm(layouts["module-names"], 1, **SCHED_KWARGS) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert_same_tokens([o.outputs[0].token_ids for o in outs], hf_reference(layouts["saved"]), PROMPTS)
        assert llm.engine.scheduler.num_preemptions > 0
        # Short (the test tokenizer spells most words out, and max_model_len is 48).
        template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        text = [{"type": "text", "text": "Hi."}, {"type": "text", "text": "Go."}]
        [out] = llm.chat([{"role": "user", "content": text}], params, chat_template=template, use_tqdm=False)
        want = greedy(hf_model(layouts["saved"]), [out.prompt_token_ids])
        assert out.outputs[0].token_ids == want[0]
        refused = r"only text content parts .* are supported, got 'image"
        for image in (
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
            {"type": "image", "url": "https://example.com/cat.png"},
        ):
            with pytest.raises(InvalidRequestError, match=refused):
                llm.chat([{"role": "user", "content": [*text, image]}], params, chat_template=template)


def test_gemma3_multimodal_config_is_its_text_config(
    family_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """The model's fields are those of a Gemma3ForCausalLM with the same settings as the text_config; the
    outer config's EOS ids and LM-head tying win over the text_config's, as in transformers; a final
    soft-cap, which transformers' Gemma3ForConditionalGeneration does not apply, is a ConfigError."""
    model_dir = family_dir("gemma3-mm")
    multimodal = build_model_config(model_dir, device="cpu")
    text_only = tmp_path / "text-only"
    settings = {**BASE_CONFIG, **GEMMA3}
    transformers.Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], **settings).save_pretrained(text_only)
    text = build_model_config(text_only, device="cpu")
    differ = {"path", "architecture", "generation_defaults"}
    fields = [f.name for f in dataclasses.fields(text) if f.name not in differ]
    assert {f: getattr(multimodal, f) for f in fields} == {f: getattr(text, f) for f in fields}
    assert multimodal.architecture == "Gemma3ForConditionalGeneration" and multimodal.tie_word_embeddings
    config = json.loads((model_dir / "config.json").read_text())
    cases: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # name -> (outer change, text_config change)
        "outer eos": ({"eos_token_id": [2, 7]}, {}),
        "untied": ({"tie_word_embeddings": False}, {}),
        "final cap": ({}, {"final_logit_softcapping": 30.0}),
    }
    for what, (outer, text_change) in cases.items():
        folder = tmp_path / what.replace(" ", "-")
        folder.mkdir()
        changed = {**config, **outer, "text_config": {**config["text_config"], **text_change}}
        (folder / "config.json").write_text(json.dumps(changed))
        if what == "final cap":
            with pytest.raises(ConfigError, match=r"final_logit_softcapping=30\.0 is not supported"):
                build_model_config(folder, device="cpu")
            continue
        cfg = build_model_config(folder, device="cpu")
        if what == "outer eos":
            assert cfg.eos_token_ids == (2, 7) and multimodal.eos_token_ids == (2,)
        else:
            assert not cfg.tie_word_embeddings and config["text_config"]["tie_word_embeddings"]


def test_phi3_fused_tensors_give_each_rank_its_rows(
    family_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Phi-3's fused qkv_proj and gate_up_proj: each rank holds its heads' rows of each part (q, k, v;
    gate, up) and reads little more than its share. A fused tensor whose rows do not add up to the
    config's parts is a ConfigError."""
    model_dir = family_dir("phi3")
    cfg = build_model_config(model_dir, dtype="float32", device="cpu")
    hf = load_file(str(model_dir / "model.safetensors"))
    full_elements = sum(t.numel() for t in hf.values())
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    read = count_checkpoint_reads(monkeypatch)
    for rank in range(2):
        read.clear()
        model = model_class("Phi3ForCausalLM")(cfg, TPGroup(rank, 2), torch.float32, torch.device("cpu"))
        loader.load_weights(model, str(model_dir), torch.float32)
        for i, layer in enumerate(model.model.layers):  # type: ignore[attr-defined]
            qkv = hf[f"model.layers.{i}.self_attn.qkv_proj.weight"]
            parts = qkv.split([q, kv, kv])
            want = torch.cat([part.chunk(2)[rank] for part in parts])
            assert torch.equal(layer.self_attn.qkv_proj.weight, want), (rank, i)
            gate, up = hf[f"model.layers.{i}.mlp.gate_up_proj.weight"].split([inter, inter])
            want = torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
            assert torch.equal(layer.mlp.gate_up_proj.weight, want), (rank, i)
        assert sum(read) < full_elements / 2 * 1.35, (rank, sum(read), full_elements)
    cut = tmp_path / "cut"
    shutil.copytree(model_dir, cut)
    hf["model.layers.0.self_attn.qkv_proj.weight"] = hf["model.layers.0.self_attn.qkv_proj.weight"][:-4]
    save_file(hf, str(cut / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"qkv_proj\.weight' has shape .* gives \d+ rows"):
        make_llm(cut, 1)


def _longrope_dir(make_checkpoint: Callable[..., Path], out: Path, partial: float) -> Path:
    """Phi-3 with LongRoPE as the 128k releases' config.json writes it (Phi-3.5-mini's layout: the original
    length at the top level, rope_scaling with "type"), scaled down: 16 original positions of 64, and the
    two sets of factors far apart; with `partial` < 1 only that part of each head rotates (Phi-4-mini)."""
    half = int(BASE_CONFIG["hidden_size"] // BASE_CONFIG["num_attention_heads"] * partial) // 2
    short, long = [1.0 + 0.1 * i for i in range(half)], [1.0 + 3.0 * i for i in range(half)]
    source = make_checkpoint(
        "Phi3ForCausalLM", max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0, "short_factor": short,
                         "long_factor": long, "original_max_position_embeddings": 16,
                         "partial_rotary_factor": partial},
    )  # fmt: skip
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    del config["rope_parameters"]
    config.update(rope_theta=10_000.0, original_max_position_embeddings=16, partial_rotary_factor=partial,
                  rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long})  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(("tp", "partial"), [(1, 1.0), (2, 1.0), (2, 0.75)])
def test_phi3_longrope_takes_the_set_its_context_needs_as_hf(
    make_checkpoint: Callable[..., Path], tmp_path: Path, tp: int, partial: float
) -> None:
    """LongRoPE's factors are chosen once from max_model_len (as vLLM does): within the original 16
    positions the short set, which transformers uses for every sequence that short; past them the long
    one, which transformers uses for every sequence that long. Tokens and logprobs equal HF's in both,
    through chunked prefill; the two sets give different tokens, so the test tells them apart. Also with
    3/4 of each head rotating (Phi-4-mini's partial_rotary_factor)."""
    longrope_dir = _longrope_dir(make_checkpoint, tmp_path / "phi3-longrope", partial)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=TOP_K, ignore_eos=True)
    short_prompts = random_prompts((3, 8, 5), 300, seed=11)  # 8 out: at most 16 positions
    long_prompts = random_prompts((17, 30, 24), 300, seed=12)  # past the 16 from the first forward
    for max_len, prompts in ((16, short_prompts), (64, long_prompts)):
        with make_llm(longrope_dir, tp, max_model_len=max_len, max_num_batched_tokens=8) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        assert_same_tokens(got, hf_greedy(longrope_dir, prompts, 8), prompts)
        for prompt, out in zip(prompts, outs, strict=True):
            ref = hf_logprobs(longrope_dir, prompt, out.outputs[0].token_ids)
            for pos, entry in enumerate(out.outputs[0].logprobs or []):
                top_lp, top_ids = ref[pos].topk(TOP_K)
                assert set(entry) == set(top_ids.tolist()), (max_len, pos)
                for tid, lp in zip(top_ids.tolist(), top_lp.tolist(), strict=True):
                    assert entry[tid].logprob == pytest.approx(lp, abs=1e-4), (max_len, pos, tid)
    # Past the original length short prompts differ from transformers', and the engine says so (as vLLM).
    warned = pytest.warns(UserWarning, match="max_model_len <= 16")
    with warned, make_llm(longrope_dir, 1, max_model_len=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in short_prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] != hf_greedy(longrope_dir, short_prompts, 8)


def test_checkpoint_missing_an_expert_is_config_error(
    family_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """Experts share one stacked parameter, so completeness is checked by checkpoint name."""
    model_dir = family_dir("mixtral")
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    cfg = build_model_config(broken, dtype="float32", device="cpu")
    model = model_class(cfg.architecture)(cfg, TPGroup(0, 1), torch.float32, torch.device("cpu"))
    with pytest.raises(
        ConfigError, match=r"lacks tensors for: model\.layers\.1\.block_sparse_moe\.experts\.5\.w3"
    ):
        loader.load_weights(model, str(broken), torch.float32)


@pytest.mark.parametrize("tp", [1, 2])
def test_weights_that_do_not_fit_the_config_are_config_errors(
    make_checkpoint: Callable[..., Path], tmp_path: Path, tp: int
) -> None:
    """A rank reads only its slice, so a tensor of another size than the config gives could load part of
    itself; transformers refuses such a checkpoint, and so must the loader, on every rank."""
    model_dir = make_checkpoint(seed=4, num_key_value_heads=4)
    cases = {  # what goes wrong -> (config.json change, tensor change)
        "fewer KV heads in the config": ({"num_key_value_heads": 2}, {}),
        "a narrower MLP in the config": ({"intermediate_size": 96}, {}),
        "a one-element norm": ({}, {"model.norm.weight": torch.ones(1)}),
    }
    for i, (config_change, tensor_change) in enumerate(cases.values()):
        broken = tmp_path / f"broken{i}"
        shutil.copytree(model_dir, broken)
        config = json.loads((broken / "config.json").read_text())
        (broken / "config.json").write_text(json.dumps({**config, **config_change}))
        tensors = {**load_file(str(model_dir / "model.safetensors")), **tensor_change}
        save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
        cfg = build_model_config(broken, dtype="float32", device="cpu")
        for rank in range(tp):
            model = model_class(cfg.architecture)(cfg, TPGroup(rank, tp), torch.float32, torch.device("cpu"))
            wrong_shape = r"has shape \[\d+(, \d+)?\] but the model's config.json gives"
            with pytest.raises(ConfigError, match=wrong_shape):
                loader.load_weights(model, str(broken), torch.float32)


def test_which_safetensors_files_are_read(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """As transformers: model.safetensors alone (a stray consolidated copy beside it is not read, nor an
    index); the index's files otherwise, all of which must be there."""
    model_dir = tmp_path / "model"
    shutil.copytree(make_checkpoint(seed=4), model_dir)
    stray = {"layers.0.attention.wq.weight": torch.zeros(2, 2)}
    save_file(stray, str(model_dir / "consolidated.safetensors"))
    assert loader.safetensors_files(str(model_dir)) == [str(model_dir / "model.safetensors")]
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    assert loader.safetensors_files(str(model_dir)) == [str(model_dir / "model.safetensors")]
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"names weight files that are not in .*model-00001-of-00002"):
        loader.safetensors_files(str(model_dir))
    # A cut or malformed index: a ConfigError that names it, not a JSON or KeyError traceback.
    for broken in ('{"weight_map": {"a": "b.safe', '{"metadata": {}}', '{"weight_map": ["x"]}', "[]"):
        (model_dir / "model.safetensors.index.json").write_text(broken)
        with pytest.raises(ConfigError, match=r"model.safetensors.index.json is not a safetensors index"):
            loader.safetensors_files(str(model_dir))


# ----------------------------------------------------------------------------- config


def test_dummy_weights_load_for_every_family(family_dir: Callable[[str], Path]) -> None:
    families = ("qwen3", "mixtral", "qwen3-moe", "qwen2-moe", "gemma", "gemma2", "olmo2", "olmo3", "smollm3")
    for family in families:
        cfg = build_model_config(family_dir(family), dtype="float32", device="cpu", load_format="dummy")
        model = model_class(cfg.architecture)(cfg, TPGroup(0, 1), torch.float32, torch.device("cpu"))
        loader.init_dummy_weights(model, 0, torch.float32, torch.device("cpu"))
        assert all(torch.isfinite(p).all() for p in model.parameters())  # type: ignore[attr-defined]


def test_gemma3_rope_per_layer_type_and_head_norms_change_the_output(
    family_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """The Gemma 3 test model is one where its features matter: with the global rope on every layer, or
    without the q/k norms, HF's own greedy tokens change (so the tokens equal to HF's above show both are
    applied); and the config gives each layer type its rope."""
    model_dir = family_dir("gemma3")
    cfg = build_model_config(model_dir, device="cpu")
    assert cfg.local_rope is not None and cfg.local_rope.rope_type == "default"
    assert cfg.rope.rope_type == "linear"
    assert (cfg.rope.theta, cfg.local_rope.theta) == (1_000_000.0, 10_000.0)
    assert cfg.sliding_window_layers == (0, 1) and cfg.attn_logit_softcapping is None
    # Gemma 3's max_position_embeddings is the scaled context already (vLLM reads it so): not times 2.
    assert cfg.max_model_len == 512
    want = reference_greedy(model_dir, PROMPTS[:3])
    one_rope = tmp_path / "one-rope"
    shutil.copytree(model_dir, one_rope)
    config = json.loads((one_rope / "config.json").read_text())
    config["rope_parameters"]["sliding_attention"] = config["rope_parameters"]["full_attention"]
    (one_rope / "config.json").write_text(json.dumps(config))
    assert reference_greedy(one_rope, PROMPTS[:3]) != want
    no_head_norms = tmp_path / "no-head-norms"
    shutil.copytree(model_dir, no_head_norms)
    tensors = load_file(str(no_head_norms / "model.safetensors"))
    for name in tensors:
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            tensors[name] = torch.zeros_like(tensors[name])  # Gemma's (1 + w): the identity
    save_file(tensors, str(no_head_norms / "model.safetensors"), metadata={"format": "pt"})
    assert reference_greedy(no_head_norms, PROMPTS[:3]) != want


def test_gemma3_attention_soft_cap_in_the_config_is_not_applied(
    family_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """transformers' Gemma3Attention reads attn_logit_softcapping but never applies it (Gemma 2's does), so
    a Gemma 3 config that sets one gives HF's tokens and logprobs here too; the cap is small enough that
    applying it would change them (Gemma 2's tests hold the cap to HF's where HF applies it)."""
    capped = tmp_path / "gemma3-capped"
    shutil.copytree(family_dir("gemma3"), capped)
    config = json.loads((capped / "config.json").read_text())
    config["attn_logit_softcapping"] = 0.5
    (capped / "config.json").write_text(json.dumps(config))
    assert build_model_config(capped, device="cpu").attn_logit_softcapping is None
    assert reference_greedy(capped, PROMPTS[:3]) == reference_greedy(family_dir("gemma3"), PROMPTS[:3])
    with make_llm(capped, 1) as llm:
        check_against_hf(llm, capped, PROMPTS[:3])


def test_gemma3_rope_of_transformers_4_configs() -> None:
    """transformers 4.x's Gemma 3 config keeps the windowed layers' base apart (rope_local_base_freq; 5.x
    folds it into rope_parameters per layer type): the windowed layers get their own rope from it too."""
    from types import SimpleNamespace

    from tp_runtime import config as config_module

    hf = SimpleNamespace(
        model_type="gemma3_text", rope_theta=1_000_000.0, rope_scaling=None, rope_local_base_freq=10_000.0,
        max_position_embeddings=32768,
    )  # fmt: skip
    local = config_module._rope_config(hf, 32, "sliding_attention")
    assert (local.rope_type, local.theta) == ("default", 10_000.0)
    assert local.inv_freq[1] == pytest.approx(10_000.0 ** (-2 / 32))
    full = config_module._rope_config(hf, 32, None)
    assert (full.rope_type, full.theta) == ("default", 1_000_000.0)
    assert full.inv_freq[1] == pytest.approx(1_000_000.0 ** (-2 / 32))


def test_config_fields(family_dir: Callable[[str], Path]) -> None:
    mixtral = build_model_config(family_dir("mixtral"), device="cpu")
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 128)
    assert mixtral.moe_layers == (0, 1) and mixtral.norm_topk_prob and mixtral.sliding_window == 8
    window = build_model_config(family_dir("qwen3-window"), device="cpu")
    assert window.sliding_window == 8 and window.qkv_bias and window.o_proj_bias and window.moe_layers == ()
    qwen = build_model_config(family_dir("qwen3-moe"), device="cpu")
    assert qwen.moe_layers == (1,) and qwen.norm_topk_prob and qwen.head_dim == 16
    step2 = build_model_config(family_dir("qwen3-moe-step2"), device="cpu")
    assert step2.moe_layers == (1,) and not step2.norm_topk_prob
    for llama_like in (mixtral, window, qwen, step2):
        assert llama_like.hidden_act == "silu" and llama_like.attn_logit_softcapping is None
        assert llama_like.final_logit_softcapping is None and llama_like.sliding_window_layers is None
        assert llama_like.attention_scale == llama_like.head_dim**-0.5
    assert [mixtral.layer_window(i) for i in range(2)] == [8, 8]
    gemma = build_model_config(family_dir("gemma2"), device="cpu")
    # transformers' Gemma2Config windows even layers; the window size stands whenever any layer uses it
    assert gemma.sliding_window == 6 and gemma.sliding_window_layers == (0, 2)
    assert [gemma.layer_window(i) for i in range(3)] == [6, None, 6]
    assert gemma.hidden_act == "gelu_pytorch_tanh" and gemma.tie_word_embeddings and gemma.head_dim == 32
    assert gemma.attention_scale == 24**-0.5
    assert (gemma.attn_logit_softcapping, gemma.final_logit_softcapping) == (20.0, 10.0)
    global_only = build_model_config(family_dir("gemma2-global"), device="cpu")
    assert global_only.sliding_window is None and global_only.sliding_window_layers == ()
    assert [global_only.layer_window(i) for i in range(2)] == [None, None]


def test_gemma_config_fields_and_unsupported_settings(
    family_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """Gemma: GeGLU, head_dim from the config (not hidden_size / heads) and scaled by its own ** -0.5, tied
    embeddings, no window or soft-caps. The first releases' hidden_act "gelu" is the tanh approximation
    (as transformers' GemmaConfig reads it); another activation, or bidirectional attention, is a
    ConfigError."""
    model_dir = family_dir("gemma")
    gemma = build_model_config(model_dir, device="cpu")
    assert gemma.hidden_act == "gelu_pytorch_tanh" and gemma.tie_word_embeddings and gemma.head_dim == 32
    assert gemma.attention_scale == 32**-0.5 and not gemma.qkv_bias and not gemma.o_proj_bias
    assert gemma.sliding_window is None and gemma.layer_window(0) is None
    assert gemma.attn_logit_softcapping is None and gemma.final_logit_softcapping is None
    config = json.loads((model_dir / "config.json").read_text())
    cases: dict[str, tuple[dict[str, Any], str | None]] = {
        "legacy gelu": ({"hidden_act": "gelu"}, None),
        "silu": ({"hidden_act": "silu"}, "Gemma hidden_act 'silu' is not supported"),
        "bidirectional": (
            {"use_bidirectional_attention": True},
            "use_bidirectional_attention is not supported",
        ),
    }
    for what, (change, error) in cases.items():
        folder = tmp_path / what.replace(" ", "-")
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        if error is None:
            assert build_model_config(folder, device="cpu").hidden_act == "gelu_pytorch_tanh", what
        else:
            with pytest.raises(ConfigError, match=error):
                build_model_config(folder, device="cpu")


def test_tp_size_that_does_not_divide_the_experts_is_config_error(
    make_checkpoint: Callable[..., Path],
) -> None:
    model_dir = make_checkpoint(
        "Qwen3MoeForCausalLM",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=30,
        num_hidden_layers=1,
    )
    with pytest.raises(
        ConfigError, match=r"tensor_parallel_size=4 does not divide the experts' intermediate size 30"
    ):
        make_llm(model_dir, 4)


def test_sliding_layer_types_without_a_window_attend_to_everything() -> None:
    """layer_types that say "sliding" with no sliding_window (use_sliding_window=false, or a null window)
    give no window: Qwen2 and Qwen3 attend to the whole context (as vLLM reads such a config; transformers
    fails in its forward), not a TypeError at start-up."""
    from tp_runtime.models.llama import qwen2_config
    from tp_runtime.models.qwen3 import qwen3_config

    sliding = ["sliding_attention"] * 2
    qwen2 = transformers.Qwen2Config(num_hidden_layers=2, use_sliding_window=False, layer_types=sliding)
    qwen3 = transformers.Qwen3Config(num_hidden_layers=2, sliding_window=None, layer_types=sliding)
    configs = [(qwen2_config, qwen2), (qwen3_config, qwen3)]
    for adapter, hf in configs:
        assert adapter(hf)["sliding_window"] is None, type(hf).__name__
    windowed = transformers.Qwen3Config(
        num_hidden_layers=2, use_sliding_window=True, sliding_window=8, layer_types=sliding
    )
    assert qwen3_config(windowed)["sliding_window"] == 8


def test_config_without_architectures_or_with_swish_loads(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """transformers loads a config.json with no `architectures` by its model_type, and takes hidden_act
    "swish" as SiLU: so does the runtime, with HF's tokens."""
    local = tmp_path / "model"
    shutil.copytree(make_checkpoint(), local)
    config = json.loads((local / "config.json").read_text())
    del config["architectures"]
    config["hidden_act"] = "swish"
    (local / "config.json").write_text(json.dumps(config))
    assert build_model_config(local).architecture == "LlamaForCausalLM"
    prompts = random_prompts((7, 12), vocab=config["vocab_size"])
    with LLM(local, device="cpu", dtype="float32") as llm:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_same_tokens([o.outputs[0].token_ids for o in outs], hf_greedy(local, prompts, 8), prompts)


def test_a_text_only_config_with_stray_nested_keys(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """A text-only config.json that carries a plain dict under a key where multimodal configs nest their
    language model's (text_config, decoder) is still the model's own config; two such keys at once, which
    transformers cannot choose between, are a ConfigError."""
    source = make_checkpoint()
    base = build_model_config(source)
    config = json.loads((source / "config.json").read_text())
    for name, extra in (("one", {"text_config": {"note": 1}}), ("two", {"text_config": {}, "decoder": {}})):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
        if name == "one":
            stray = build_model_config(folder)
            same = dataclasses.replace(stray, path=base.path, generation_defaults=base.generation_defaults)
            assert same == base
        else:
            with pytest.raises(ConfigError, match=r"config\.json"):
                build_model_config(folder)


def test_gemma2_unsupported_settings_are_config_errors(make_checkpoint: Callable[..., Path]) -> None:
    model_dir = make_checkpoint("Gemma2ForCausalLM", num_hidden_layers=1, hidden_activation="gelu")
    with pytest.raises(ConfigError, match="hidden_activation 'gelu' is not supported"):
        make_llm(model_dir, 1)
    model_dir = make_checkpoint("Gemma2ForCausalLM", num_hidden_layers=1, use_bidirectional_attention=True)
    with pytest.raises(ConfigError, match="use_bidirectional_attention is not supported"):
        make_llm(model_dir, 1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tp_shape_from_config_json_matches_the_model_config(
    family: str, family_dir: Callable[[str], Path]
) -> None:
    """The command line checks the TP size from config.json before torch is imported: its reading gives
    the sizes the full model config gives, for every family (dense, MoE on all or some layers)."""
    from tp_runtime.config import TPShape, read_config_json

    folder = family_dir(family)
    early = TPShape.of_config_json(read_config_json(folder))
    assert early == TPShape.of_model(build_model_config(folder, device="cpu"))
    assert early.sizes() == [tp for tp in range(1, early.num_heads + 1) if early.problem(tp) is None]
