"""TP=1 (in-process) outputs equal Hugging Face transformers' token for token on tiny random checkpoints.

Covers the Llama family's config variants (GQA/MHA/MQA, biases, tied embeddings, explicit head_dim,
Mistral sliding window, Qwen2, rope scaling), greedy logprobs, chunked prefill, preemption with
recomputation, and steps that mix prefill chunks with decodes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same_tokens, hf_greedy, hf_logprobs
from conftest import random_prompts as shared_random_prompts

from tp_runtime import LLM, SamplingParams

ARCH = "LlamaForCausalLM"
VOCAB = 300  # conftest's BASE_CONFIG
PROMPT_LENS = (1, 5, 23, 40)
MAX_TOKENS = 12

_hf_cache: dict[tuple[Any, ...], list[list[int]]] = {}


def random_prompts(lengths: tuple[int, ...], vocab: int = VOCAB, seed: int = 1234) -> list[list[int]]:
    return shared_random_prompts(lengths, vocab, seed)


def reference(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, suppress_eos: bool = False):
    """hf_greedy, memoised (several tests compare against the same checkpoint and prompts)."""
    key = (str(model_dir), tuple(map(tuple, prompts)), max_new_tokens, suppress_eos)
    if key not in _hf_cache:
        _hf_cache[key] = hf_greedy(model_dir, prompts, max_new_tokens, suppress_eos=suppress_eos)
    return _hf_cache[key]


def make_llm(model_dir: Path, **kwargs: Any) -> LLM:
    kwargs.setdefault("max_num_seqs", 16)
    return LLM(model=model_dir, tensor_parallel_size=1, dtype="float32", device="cpu", seed=0, **kwargs)


def generate_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    for o in outs:
        assert len(o.outputs) == 1
    return [o.outputs[0].token_ids for o in outs]


def greedy(max_tokens: int = MAX_TOKENS, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


class ScheduleSpy:
    """Records, per step, which scheduled requests were prefilling and which were decoding."""

    def __init__(self, llm: LLM) -> None:
        self.scheduler = llm.engine.scheduler
        self._schedule = self.scheduler.schedule
        self.steps: list[dict[str, list[int]]] = []
        self.scheduler.schedule = self._spy  # type: ignore[method-assign]

    def _spy(self) -> Any:
        so = self._schedule()
        step: dict[str, list[int]] = {"prefill": [], "decode": []}
        for req_id, n in zip(so.scheduled_req_ids, so.num_scheduled_tokens, strict=True):
            req = self.scheduler.requests[req_id]
            # A decode computes exactly one token, and that token was generated (its position is past the
            # prompt); its value may still be in flight under async scheduling.
            decoding = n == 1 and req.num_computed_tokens - 1 >= len(req.prompt_token_ids)
            step["decode" if decoding else "prefill"].append(n)
        self.steps.append(step)
        return so

    @property
    def mixed_steps(self) -> int:
        return sum(1 for s in self.steps if s["prefill"] and s["decode"])


# ----------------------------------------------------------------------------- config variants

ROPE_LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
ROPE_DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
ROPE_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}
# factor = max_position_embeddings / original_max_position_embeddings, so transformers does not warn.
ROPE_YARN = {
    "rope_type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa-4h-2kv": (ARCH, {}),
    "llama-mha-4h-4kv": (ARCH, {"num_key_value_heads": 4}),
    "llama-mqa-4h-1kv": (ARCH, {"num_key_value_heads": 1}),
    "llama-attn-and-mlp-bias": (ARCH, {"attention_bias": True, "mlp_bias": True}),
    "llama-tied-embeddings": (ARCH, {"tie_word_embeddings": True}),
    "llama-head-dim-32": (ARCH, {"head_dim": 32}),
    "mistral-no-window": ("MistralForCausalLM", {"sliding_window": None}),
    "mistral-window-8": ("MistralForCausalLM", {"sliding_window": 8}),
    "qwen2-qkv-bias": ("Qwen2ForCausalLM", {}),
    # use_sliding_window windows the layers from max_window_layers on: here all of them, or none.
    "qwen2-window-every-layer": (
        "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}
    ),
    "qwen2-window-no-layer": (
        "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}
    ),
    # ... or some of them: layer 1 windowed, layer 0 attending to everything (it was a ConfigError).
    "qwen2-window-from-layer-1": (
        "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    ),
    "qwen3-window-from-layer-1": (
        "Qwen3ForCausalLM",
        {"head_dim": 16, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    # Config keys these families' transformers classes ignore: no biases.
    "mistral-ignores-bias-keys": ("MistralForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "qwen2-ignores-mlp-bias": ("Qwen2ForCausalLM", {"mlp_bias": True}),
    "rope-linear": (ARCH, {"rope_parameters": ROPE_LINEAR}),
    # The transformers 4.x key, converted by transformers 5 into rope_parameters on load.
    "rope-linear-legacy-rope_scaling": (ARCH, {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    "rope-dynamic": (ARCH, {"rope_parameters": ROPE_DYNAMIC}),
    "rope-llama3": (ARCH, {"rope_parameters": ROPE_LLAMA3}),
    "rope-yarn": (ARCH, {"rope_parameters": ROPE_YARN}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hf(name: str, make_checkpoint: Callable[..., Path]) -> None:
    arch, overrides = CONFIGS[name]
    model_dir = make_checkpoint(arch, **overrides)
    prompts = random_prompts(PROMPT_LENS)
    with make_llm(model_dir) as llm:
        got = generate_ids(llm, prompts, greedy())
    assert_same_tokens(got, reference(model_dir, prompts, MAX_TOKENS), prompts)


def test_row_parallel_biases_round_as_hf_in_bfloat16(make_checkpoint: Callable[..., Path]) -> None:
    """At one rank the output and down projections add their bias inside the matmul, rounded once with
    the product as nn.Linear does, so bfloat16 greedy tokens equal HF's bfloat16 tokens."""
    model_dir = make_checkpoint(ARCH, attention_bias=True, mlp_bias=True)
    prompts = random_prompts(PROMPT_LENS)
    with LLM(model=model_dir, dtype="bfloat16", device="cpu", seed=0) as llm:
        got = generate_ids(llm, prompts, greedy())
    want = hf_greedy(model_dir, prompts, MAX_TOKENS, dtype=torch.bfloat16)
    assert_same_tokens(got, want, prompts)


def test_rope_dynamic_scaling_path_matches_hf(make_checkpoint: Callable[..., Path]) -> None:
    """A dynamic-NTK config that also names original_max_position_embeddings (as some checkpoints do).

    transformers' dynamic rope ignores that key (it only scales past max_position_embeddings, which a
    request can never reach here), so HF's output is plain unscaled rope for every position.
    """
    rope = {**ROPE_DYNAMIC, "original_max_position_embeddings": 16}
    model_dir = make_checkpoint(ARCH, rope_parameters=rope)
    prompts = random_prompts((5, 23, 40))
    with make_llm(model_dir) as llm:
        got = generate_ids(llm, prompts, greedy())
    assert_same_tokens(got, reference(model_dir, prompts, MAX_TOKENS), prompts)


def test_min_tokens_suppresses_eos_like_hf(make_checkpoint: Callable[..., Path]) -> None:
    """min_tokens=max_tokens (EOS honoured afterwards) equals HF's greedy with EOS masked out.

    EOS is made the token greedy decoding picks first for prompt 0, so masking it really changes the
    output; the weights do not depend on eos_token_id, so both checkpoints hold the same model.
    """
    prompts = random_prompts(PROMPT_LENS)
    plain_dir = make_checkpoint(ARCH)
    eos = reference(plain_dir, prompts, MAX_TOKENS)[0][0]
    assert eos > 2
    model_dir = make_checkpoint(ARCH, eos_token_id=eos)
    want = reference(model_dir, prompts, MAX_TOKENS, suppress_eos=True)
    assert want[0][0] != eos
    with make_llm(model_dir) as llm:
        got = generate_ids(
            llm, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        )
        assert_same_tokens(got, want, prompts)
        # Without min_tokens, the same request stops at that EOS.
        out = llm.generate(
            [{"prompt_token_ids": prompts[0]}],
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
            use_tqdm=False,
        )[0].outputs[0]
        assert out.token_ids == [eos]
        assert out.finish_reason == "stop"


# ----------------------------------------------------------------------------- logprobs


@pytest.fixture(scope="module")
def base_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(ARCH)


@pytest.fixture(scope="module")
def base_llm(base_dir: Path) -> Iterator[LLM]:
    llm = make_llm(base_dir)
    yield llm
    llm.shutdown()


def test_greedy_logprobs_match_hf(base_dir: Path, base_llm: LLM) -> None:
    k = 5
    prompts = random_prompts((3, 17, 40), seed=7)
    outs = base_llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=8, logprobs=k, ignore_eos=True),
        use_tqdm=False,
    )
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids) == 8
        ref = hf_logprobs(base_dir, prompt, comp.token_ids)
        for pos, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
            top_lp, top_ids = ref[pos].topk(k)
            assert token == int(top_ids[0]), f"position {pos}: greedy token {token} is not HF's argmax"
            assert token in entry
            assert entry[token].rank == 1
            # Greedy: the sampled token is the top-1, so the entry holds exactly HF's top-k.
            assert set(entry) == set(top_ids.tolist()), f"position {pos}: top-{k} ids differ from HF"
            for r, (tid, lp) in enumerate(zip(top_ids.tolist(), top_lp.tolist(), strict=True), start=1):
                assert entry[tid].logprob == pytest.approx(lp, abs=1e-4), f"position {pos}, token {tid}"
                assert entry[tid].rank == r
                assert entry[tid].decoded_token == base_llm.tokenizer.decode([tid])
        assert comp.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs, strict=True)), abs=1e-4
        )


def test_sampled_logprobs_include_sampled_token_with_hf_rank(base_dir: Path, base_llm: LLM) -> None:
    """With sampling the sampled token may be outside the top-k; it is always returned with its rank."""
    k = 2
    prompt = random_prompts((11,), seed=8)[0]
    comp = base_llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=1.5, max_tokens=12, logprobs=k, seed=3, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert comp.logprobs is not None
    ref = hf_logprobs(base_dir, prompt, comp.token_ids)
    for pos, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        want = float(ref[pos, token])
        assert token in entry
        assert entry[token].logprob == pytest.approx(want, abs=1e-4)
        assert entry[token].rank == 1 + int((ref[pos] > want + 1e-6).sum())
        top_ids = ref[pos].topk(k).indices.tolist()
        assert set(top_ids) <= set(entry)
        assert len(entry) in (k, k + 1)


# ----------------------------------------------------------------------------- scheduling


@pytest.mark.parametrize(
    "arch,overrides",
    [(ARCH, {}), ("MistralForCausalLM", {"sliding_window": 8})],
    ids=["llama", "mistral-window-8"],
)
def test_chunked_prefill_matches_hf(
    arch: str, overrides: dict[str, Any], make_checkpoint: Callable[..., Path]
) -> None:
    model_dir = make_checkpoint(arch, **overrides)
    prompts = random_prompts((23, 40, 5, 9, 1))
    with make_llm(model_dir, max_num_batched_tokens=7, block_size=4) as llm:
        spy = ScheduleSpy(llm)
        got = generate_ids(llm, prompts, greedy())
    assert_same_tokens(got, reference(model_dir, prompts, MAX_TOKENS), prompts)
    assert max(sum(s["prefill"]) + sum(s["decode"]) for s in spy.steps) <= 7


@pytest.mark.parametrize("budget", [8192, 8], ids=["whole-prefill", "chunked-prefill"])
def test_preemption_recompute_matches_hf(budget: int, base_dir: Path) -> None:
    prompts = random_prompts((13, 7, 20, 3, 17, 10), seed=5)
    max_tokens = 20
    # 12 blocks of 4 tokens hold one sequence of max_model_len=48; 22 blocks hold about two of ~40 tokens.
    with make_llm(
        base_dir, block_size=4, num_kv_blocks=22, max_model_len=48, max_num_batched_tokens=budget
    ) as llm:
        got = generate_ids(llm, prompts, greedy(max_tokens))
        assert llm.engine.scheduler.num_preemptions > 0, "the test did not force a preemption"
    assert_same_tokens(got, reference(base_dir, prompts, max_tokens), prompts)


def test_mixed_prefill_and_decode_steps_match_hf(base_dir: Path) -> None:
    prompts = random_prompts((3, 30, 8, 17, 2, 25, 11), seed=6)
    with make_llm(base_dir, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        spy = ScheduleSpy(llm)
        got = generate_ids(llm, prompts, greedy())
    assert spy.mixed_steps > 0, "no step mixed a prefill chunk with decodes"
    assert_same_tokens(got, reference(base_dir, prompts, MAX_TOKENS), prompts)


def test_batch_equals_one_at_a_time(base_dir: Path, base_llm: LLM) -> None:
    """Batch composition does not change greedy output (each prompt alone vs all together)."""
    prompts = random_prompts(PROMPT_LENS, seed=9)
    together = generate_ids(base_llm, prompts, greedy())
    alone = [generate_ids(base_llm, [p], greedy())[0] for p in prompts]
    assert together == alone
    assert_same_tokens(together, reference(base_dir, prompts, MAX_TOKENS), prompts)
