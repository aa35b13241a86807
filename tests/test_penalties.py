"""repetition / presence / frequency penalties, logit_bias and allowed_token_ids with vLLM's semantics,
greedy, against independent references.

- repetition_penalty: HF transformers' `generate(repetition_penalty=...)` (its
  RepetitionPenaltyLogitsProcessor over prompt + output), token for token.
- presence_penalty / frequency_penalty (and all three together), logit_bias and allowed_token_ids (with and
  without penalties): a brute-force reference, one full HF forward per generated token with the allowed
  tokens, the biases and then the penalties applied by hand in float64 to the last position's logits.

Every engine runs a small token budget and a small KV cache, so prompts prefill in chunks, requests are
preempted and recomputed (their penalty state rebuilt from their tokens), and requests finish out of order
(batch rows move). The engines: TP=1 with async scheduling, TP=1 without it on the padded decode-graph path
(the GPU's device-side code path), and TP=2.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import hf_greedy, hf_logprobs, random_prompts

from tp_runtime import LLM, SamplingParams, StructuredOutputsParams
from tp_runtime.errors import InvalidRequestError

VOCAB = 300
MAX_TOKENS = 20
# 22 blocks of 4 tokens: about two sequences of ~40 tokens at once, so 6 requests force preemptions.
SCHED = dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=22, max_model_len=48)
ENGINES = {
    "tp1": dict(tensor_parallel_size=1),
    "tp1-sync-padded": dict(tensor_parallel_size=1, async_scheduling=False, cuda_graphs="padded"),
    "tp2": dict(tensor_parallel_size=2),
}


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(seed=3)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(hf_model: Any) -> Callable[..., list[int]]:
    """brute_force(hf_model, ...), or hf_repetition when only repetition_penalty is set; computed once per
    module (every engine compares against the same references)."""

    @functools.cache
    def cached(
        prompt: tuple[int, ...], max_new: int, presence: float, frequency: float, rep: float,
        bias: tuple[tuple[int, float], ...], allowed: tuple[int, ...],
    ) -> list[int]:  # fmt: skip
        if presence == frequency == 0.0 and not bias and not allowed:
            return hf_repetition(hf_model, list(prompt), max_new, rep)
        return brute_force(hf_model, list(prompt), max_new, presence, frequency, rep, dict(bias), allowed)

    def get(
        prompt: list[int], max_new: int, presence: float = 0.0, frequency: float = 0.0, rep: float = 1.0,
        bias: dict[int, float] | None = None, allowed: list[int] | None = None,
    ) -> list[int]:  # fmt: skip
        return cached(
            tuple(prompt), max_new, presence, frequency, rep, tuple(sorted((bias or {}).items())),
            tuple(allowed or ()),
        )  # fmt: skip

    return get


@pytest.fixture(scope="module", params=list(ENGINES), ids=list(ENGINES))
def llm(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[LLM]:
    engine = LLM(model_dir, dtype="float32", device="cpu", seed=0, **SCHED, **ENGINES[request.param])
    yield engine
    engine.shutdown()


def greedy(max_tokens: int = MAX_TOKENS, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def hf_repetition(model: Any, prompt: list[int], max_new: int, penalty: float) -> list[int]:
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    gen = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
        repetition_penalty=penalty, pad_token_id=0,
    )  # fmt: skip
    return gen[0, len(prompt) :].tolist()


def brute_force(
    model: Any, prompt: list[int], max_new: int, presence: float, frequency: float, repetition: float,
    bias: dict[int, float] | None = None, allowed: tuple[int, ...] = (),
) -> list[int]:  # fmt: skip
    """Greedy with vLLM's logits processing, applied by hand in float64 to a fresh full forward per token:
    only the allowed tokens, then the biases, then the penalties."""
    out: list[int] = []
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        if allowed:
            keep = torch.full_like(logits, float("-inf"))
            keep[list(allowed)] = logits[list(allowed)]
            logits = keep
        for t, value in (bias or {}).items():
            logits[t] += value
        for t in set(prompt) | set(out):
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t, count in Counter(out).items():
            logits[t] -= frequency * count + presence
        top2 = logits.topk(2).values
        # The engine penalizes float32 logits: a near-tie here would make the comparison meaningless.
        assert float(top2[0] - top2[1]) > 1e-3, "reference near-tie; pick other prompts"
        out.append(int(logits.argmax()))
    return out


# Prompt lengths (chunked: longer than the 16-token budget) and per-request max_tokens (finish out of order).
LENGTHS = (5, 22, 3, 17, 11, 26)
MAX_NEW = (20, 8, 14, 20, 5, 12)


def test_repetition_penalty_matches_hf_generate(llm: LLM, reference: Callable[..., list[int]]) -> None:
    prompts = random_prompts(LENGTHS, VOCAB, seed=21)
    # Below 1 a penalty favours repeats; one request without a penalty rides along.
    penalties = [1.3, 1.8, 0.7, 1.0, 1.3, 2.5]
    params = [greedy(m, repetition_penalty=p) for m, p in zip(MAX_NEW, penalties, strict=True)]
    before = llm.engine.scheduler.num_preemptions
    got = run(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > before, "the test did not force a preemption"
    for i, (prompt, m, p) in enumerate(zip(prompts, MAX_NEW, penalties, strict=True)):
        assert got[i] == reference(prompt, m, rep=p), f"request {i} (repetition_penalty={p})"
    plain = [reference(prompt, m) for prompt, m in zip(prompts, MAX_NEW, strict=True)]
    assert sum(g != w for g, w in zip(got, plain, strict=True)) >= 4, "penalties changed too little"


PRESENCE_FREQUENCY = [  # (presence, frequency, repetition)
    (1.5, 0.0, 1.0),
    (0.0, 1.2, 1.0),
    (-1.0, 0.0, 1.0),  # negative: favours tokens already in the output
    (0.5, 0.8, 1.4),
    (0.0, -0.6, 1.0),
    (2.0, 2.0, 1.0),
]


def test_presence_and_frequency_match_brute_force(llm: LLM, reference: Callable[..., list[int]]) -> None:
    prompts = random_prompts(LENGTHS, VOCAB, seed=22)
    params = [
        greedy(m, presence_penalty=pp, frequency_penalty=fp, repetition_penalty=rp)
        for m, (pp, fp, rp) in zip(MAX_NEW, PRESENCE_FREQUENCY, strict=True)
    ]
    got = run(llm, prompts, params)
    changed = 0
    for i, (prompt, m, (pp, fp, rp)) in enumerate(zip(prompts, MAX_NEW, PRESENCE_FREQUENCY, strict=True)):
        want = reference(prompt, m, pp, fp, rp)
        assert got[i] == want, f"request {i} (presence={pp}, frequency={fp}, repetition={rp})"
        changed += want != reference(prompt, m)
    assert changed >= 3, "penalties changed too few outputs to test them"


def test_penalized_and_plain_requests_share_a_batch(
    llm: LLM, reference: Callable[..., list[int]], model_dir: Path
) -> None:
    """Plain requests next to penalized ones are unaffected, including in rows that penalized requests left
    (their state is never read), and logprobs stay those of the raw model output."""
    prompts = random_prompts((9, 4, 15, 7), VOCAB, seed=23)
    params = [
        greedy(6, frequency_penalty=1.5, logprobs=3),
        greedy(16),
        greedy(10, presence_penalty=1.0),
        greedy(16, logprobs=2),
    ]
    got = run(llm, prompts, params)
    assert got[1::2] == hf_greedy(model_dir, prompts[1::2], 16)
    assert got[0] == reference(prompts[0], 6, frequency=1.5)
    assert got[2] == reference(prompts[2], 10, presence=1.0)
    out = llm.generate({"prompt_token_ids": prompts[0]}, params[0], use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None
    raw = hf_logprobs(model_dir, prompts[0], out.token_ids)
    for pos, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert entry[token].logprob == pytest.approx(float(raw[pos, token]), abs=1e-4)
        assert entry[token].rank == int((raw[pos] > raw[pos, token]).sum()) + 1


SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=77, max_tokens=16, ignore_eos=True)


def test_seeded_sampling_with_penalties_is_the_same_on_every_engine(llm: LLM, model_dir: Path) -> None:
    """Sampling after the penalties: the same tokens alone, in a batch, and at every TP size / mode (the
    engines' common reference is a fresh TP=1 engine without chunking)."""
    prompt = random_prompts((12,), VOCAB, seed=24)[0]
    params = SamplingParams(
        temperature=0.9, top_k=40, seed=77, max_tokens=16, ignore_eos=True, presence_penalty=0.7,
        frequency_penalty=0.4, repetition_penalty=1.2,
    )  # fmt: skip
    with LLM(model_dir, dtype="float32", device="cpu") as plain_engine:
        want = run(plain_engine, [prompt], [params])[0]
        assert want != run(plain_engine, [prompt], [SEEDED])[0], "penalties changed nothing"
    others = random_prompts((6, 19), VOCAB, seed=25)
    got = run(llm, [others[0], prompt, others[1]], [SEEDED, params, greedy(9, repetition_penalty=1.5)])
    assert got[1] == want


def test_penalty_state_only_when_used(model_dir: Path) -> None:
    """No token-count state exists on the worker until a request uses a penalty."""
    with LLM(model_dir, dtype="float32", device="cpu") as engine:
        runner = engine.engine.executor.worker.runner  # type: ignore[attr-defined]
        engine.generate({"prompt_token_ids": [5, 6, 7]}, greedy(4), use_tqdm=False)
        assert runner.batch.penalties is None
        engine.generate({"prompt_token_ids": [5, 6, 7]}, greedy(4, presence_penalty=0.5), use_tqdm=False)
        assert runner.batch.penalties is not None


def bias_of(seed: int, count: int, scale: float) -> dict[int, float]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randperm(VOCAB, generator=g)[:count].tolist()
    values = ((torch.rand(count, generator=g) * 2 - 1) * scale).tolist()
    return {t: round(v, 3) for t, v in zip(tokens, values, strict=True)}


def test_logit_bias_and_allowed_token_ids_match_brute_force(
    llm: LLM, reference: Callable[..., list[int]]
) -> None:
    """Biases on many tokens (some at -100, one at +100 after its min_tokens), allowed token sets alone,
    with biases and with penalties, beside a plain request, through chunking and preemption."""
    prompts = random_prompts(LENGTHS, VOCAB, seed=26)
    allowed = sorted(bias_of(27, 25, 1.0))
    banned = {**bias_of(28, 60, 0.5), **{t: -100.0 for t in range(3, 40)}}
    cases: list[dict[str, Any]] = [
        dict(bias=bias_of(29, 80, 0.6)),
        dict(allowed=allowed),
        dict(bias=banned, allowed=allowed[:12] + list(range(3, 8))),
        dict(bias=bias_of(30, 80, 0.6), presence=0.8, frequency=0.5, rep=1.3),
        dict(),
        dict(allowed=allowed[5:], rep=1.6),
    ]
    params = [
        greedy(
            m, logit_bias=c.get("bias"), allowed_token_ids=c.get("allowed"),
            presence_penalty=c.get("presence", 0.0), frequency_penalty=c.get("frequency", 0.0),
            repetition_penalty=c.get("rep", 1.0),
        )
        for m, c in zip(MAX_NEW, cases, strict=True)
    ]  # fmt: skip
    before = llm.engine.scheduler.num_preemptions
    got = run(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > before, "the test did not force a preemption"
    changed = 0
    for i, (prompt, m, c) in enumerate(zip(prompts, MAX_NEW, cases, strict=True)):
        want = reference(prompt, m, c.get("presence", 0.0), c.get("frequency", 0.0), c.get("rep", 1.0),
                         c.get("bias"), c.get("allowed"))  # fmt: skip
        assert got[i] == want, f"request {i} ({c})"
        if c.get("allowed"):
            assert set(got[i]) <= set(c["allowed"])
        if c.get("bias") and min(c["bias"].values()) == -100.0:
            assert not set(got[i]) & set(range(3, 40))
        changed += want != reference(prompt, m)
    assert changed >= 4, "the biases changed too few outputs to test them"
    # +100 forces a token.
    forced = run(llm, [prompts[0]], [greedy(5, logit_bias={7: 100.0}, logprobs=1)])[0]
    assert forced == [7] * 5


def test_logit_bias_logprobs_are_the_raw_models(llm: LLM, model_dir: Path) -> None:
    prompt = random_prompts((8,), VOCAB, seed=31)[0]
    params = greedy(6, logit_bias=bias_of(32, 100, 1.0), allowed_token_ids=list(range(3, 200)), logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None
    raw = hf_logprobs(model_dir, prompt, out.token_ids)
    for pos, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert entry[token].logprob == pytest.approx(float(raw[pos, token]), abs=1e-4)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(logit_bias={5: 100.5}), r"logit_bias must map token ids .* to numbers in \[-100, 100\]"),
        (dict(logit_bias={5: float("nan")}), "logit_bias must map"),
        (dict(logit_bias={-1: 1.0}), "logit_bias must map"),
        (dict(logit_bias={"5": 1.0}), "logit_bias must map"),
        (dict(logit_bias=[(5, 1.0)]), "logit_bias must map"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
        (dict(allowed_token_ids=[3, -2]), "allowed_token_ids must be a non-empty list"),
        (dict(allowed_token_ids=[3, True]), "allowed_token_ids must be a non-empty list"),
    ],
)
def test_bad_logit_bias_or_allowed_tokens_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**fields)


def test_token_ids_outside_the_vocabulary_are_refused(model_dir: Path) -> None:
    """Also what no token could satisfy, and values changed inside a SamplingParams after it was made (its
    dict and list are the caller's: an in-process rank runs no step check)."""
    mutated_bias, mutated_allowed = greedy(2, logit_bias={5: 1.0}), greedy(2, allowed_token_ids=[5, 6])
    assert mutated_bias.logit_bias is not None and mutated_allowed.allowed_token_ids is not None
    mutated_bias.logit_bias[5] = float("nan")
    mutated_allowed.allowed_token_ids.append(-3)
    with LLM(model_dir, dtype="float32", device="cpu") as engine:
        eos = sorted(engine.engine.eos_token_ids)
        for params, message in (
            (mutated_bias, r"logit_bias values must be in \[-100, 100\], got nan"),
            (mutated_allowed, "allowed token id -3 is outside the vocabulary"),
            (
                SamplingParams(temperature=0, allowed_token_ids=[*eos, 9], stop_token_ids=[9], min_tokens=1),
                "holds only stop tokens",
            ),
            (
                greedy(2, allowed_token_ids=[4, 5], structured_outputs=StructuredOutputsParams(regex="a+")),
                "cannot be combined with structured_outputs",
            ),
        ):
            with pytest.raises(InvalidRequestError, match=message):
                engine.generate({"prompt_token_ids": [5, 6]}, params, use_tqdm=False)
        # With a token that min_tokens does not hold back, it runs.
        ok = SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[*eos, 9], min_tokens=2)
        out = run(engine, [[5, 6]], [ok])[0]
        assert out[:2] == [9, 9] and set(out) <= {*eos, 9}
        for fields, message in (
            (dict(logit_bias={VOCAB: 1.0}), f"logit_bias token id {VOCAB} is outside the vocabulary"),
            (
                dict(allowed_token_ids=[4, VOCAB + 7]),
                f"allowed token id {VOCAB + 7} is outside the vocabulary",
            ),
        ):
            with pytest.raises(InvalidRequestError, match=message):
                engine.generate({"prompt_token_ids": [5, 6]}, greedy(2, **fields), use_tqdm=False)


# ----------------------------------------------------------------------------------------------- bad_words
def bad_words_reference(model: Any, prompt: list[int], max_new: int, sequences: list[list[int]]) -> list[int]:
    """Greedy with vLLM's bad_words rule applied by hand to a fresh full forward per token: the last token of
    every sequence whose other tokens the output so far ends with is at -inf."""
    out: list[int] = []
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        for seq in sequences:
            if len(seq) - 1 <= len(out) and out[len(out) - len(seq) + 1 :] == seq[:-1]:
                logits[seq[-1]] = float("-inf")
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) > 1e-3, "reference near-tie; pick other prompts"
        out.append(int(logits.argmax()))
    return out


def words_from(tokenizer: Any, output: list[int], seed: int) -> list[str]:
    """Words whose token sequences (as bad_words encodes them) occur in `output`, two and one token long."""
    from tp_runtime.engine.llm_engine import bad_word_ids

    g = torch.Generator().manual_seed(seed)
    words: list[str] = []
    for width in (2, 1):
        for start in torch.randperm(len(output) - width + 1, generator=g).tolist():
            window = output[start : start + width]
            word = tokenizer.decode(window)
            if word.strip() and window in bad_word_ids(tokenizer, [word], VOCAB):
                words.append(word)
                break
    return words


def test_bad_words_match_brute_force(llm: LLM, hf_model: Any) -> None:
    """bad_words taken from each request's own unconstrained output (a two-token word and a one-token
    word), beside a plain request, through chunking and preemption: vLLM's rule applied by hand to HF's
    logits gives the same tokens, no banned sequence is generated, and most outputs change."""
    from tp_runtime.engine.llm_engine import bad_word_ids

    tokenizer = llm.get_tokenizer()
    prompts = random_prompts(LENGTHS, VOCAB, seed=34)
    plain = run(llm, prompts, [greedy(m) for m in MAX_NEW])
    words = [words_from(tokenizer, out, seed=i) if i != 4 else [] for i, out in enumerate(plain)]
    params = [greedy(m, bad_words=w or None) for m, w in zip(MAX_NEW, words, strict=True)]
    before = llm.engine.scheduler.num_preemptions
    got = run(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > before, "the test did not force a preemption"
    changed = 0
    for i, (prompt, m, w) in enumerate(zip(prompts, MAX_NEW, words, strict=True)):
        sequences = bad_word_ids(tokenizer, w, VOCAB) if w else []
        assert got[i] == bad_words_reference(hf_model, prompt, m, sequences), f"request {i} ({w})"
        for seq in sequences:
            assert not any(got[i][k : k + len(seq)] == seq for k in range(len(got[i]))), (i, seq)
        changed += got[i] != plain[i]
    assert changed >= 4, "bad_words changed too few outputs for the test to mean much"


def test_masks_that_leave_no_token_refuse_or_abort(model_dir: Path) -> None:
    """allowed_token_ids that one-token bad_words ban whole, or ban but for stop tokens min_tokens holds
    back, are refused. Where the masks empty only later (a two-token bad word, a grammar's one way on
    banned), the request ends "abort" without the token the empty mask gave, streamed or not, and a
    request beside it runs on as alone."""
    from tp_runtime.engine.llm_engine import bad_word_ids

    with LLM(model_dir, dtype="float32", device="cpu") as llm:
        tokenizer = llm.get_tokenizer()
        eos = tokenizer.eos_token_id
        f, g = (bad_word_ids(tokenizer, [w], VOCAB) for w in ("F", "G"))
        ff = bad_word_ids(tokenizer, ["FF"], VOCAB)
        assert len(f) == len(g) == 1 and len(f[0]) == len(g[0]) == 1 and ff == [f[0] * 2], (f, g, ff)
        f_id, g_id = f[0][0], g[0][0]
        prompt = {"prompt_token_ids": [1, 5, 6, 7]}
        for params, message in (
            (greedy(4, allowed_token_ids=[f_id, g_id], bad_words=["F", "G"]), "bad_words ban every token"),
            (
                SamplingParams(max_tokens=4, allowed_token_ids=[eos, f_id], bad_words=["F"], min_tokens=2),
                "holds only stop tokens .* besides those bad_words ban",
            ),
        ):
            with pytest.raises(InvalidRequestError, match=message):
                llm.generate(prompt, params, use_tqdm=False)
        alone = llm.generate(prompt, greedy(6), use_tqdm=False)[0].outputs[0].token_ids
        # F, then G banned and F banned after F: nothing left. The same with a stop token (0) allowed that
        # min_tokens holds back: the empty mask's token 0 is dropped, not taken as an output.
        cases = [
            greedy(6, allowed_token_ids=[f_id, g_id], bad_words=["G", "FF"], logprobs=1),
            SamplingParams(
                temperature=0, max_tokens=6, allowed_token_ids=[0, f_id], bad_words=["FF"], min_tokens=4,
                stop_token_ids=[0],
            ),
            greedy(6, structured_outputs=StructuredOutputsParams(choice=["F"]), bad_words=["F"]),
        ]  # fmt: skip
        want = [[f_id], [f_id], []]
        engine = llm.engine
        for params, tokens in zip(cases, want, strict=True):
            ids = [engine.add_request([1, 5, 6, 7], params, stream=stream) for stream in (False, True)]
            beside = engine.add_request([1, 5, 6, 7], greedy(6))
            got: dict[str, list[Any]] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    got.setdefault(out.request_id, []).append(out)
            for req_id in ids:
                outs = got[str(req_id)]
                assert [t for o in outs for t in o.outputs[0].token_ids] == tokens, (params, outs)
                assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
                if params.logprobs is not None:
                    assert sum(len(o.outputs[0].logprobs or []) for o in outs) == len(tokens)
            assert got[str(beside)][-1].outputs[0].token_ids == alone


def test_bad_words_encoding_follows_vllm(model_dir: Path) -> None:
    """Each word alone (leading spaces dropped), and with a space before it only where that gives as many
    tokens with another first token; words outside the vocabulary, empty ones, and bad types are refused."""
    from tp_runtime.engine.llm_engine import bad_word_ids

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    seen_both = seen_alone = 0
    for word in ("the", "  the", "Paris", "hello world", "qz", "x", "e", "ing"):
        alone, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
        both = len(spaced) == len(alone) and spaced[0] != alone[0]
        assert bad_word_ids(tok, [word], 10**6) == ([alone, spaced] if both else [alone]), word
        seen_both += both
        seen_alone += not both
    assert seen_both and seen_alone, "the words do not show both cases"
    with pytest.raises(InvalidRequestError, match="outside the model's vocabulary"):
        bad_word_ids(tok, ["the"], 3)
    for bad in ([""], ["  "], "the", [3]):
        with pytest.raises(InvalidRequestError, match="bad_words must be a list of words"):
            SamplingParams(bad_words=bad)  # type: ignore[arg-type]


def test_bad_words_that_cannot_match_cost_nothing(model_dir: Path) -> None:
    """A bad word longer than the output may grow is dropped (its prefix never fits: no per-row history of
    its width is kept), the history goes with the last request that needed it, and a list changed after
    its check is refused, not a crash inside the engine."""
    with LLM(model_dir, dtype="float32", device="cpu", max_model_len=64) as llm:
        batch = llm.engine.executor.worker.runner.batch  # type: ignore[attr-defined]
        prompt = {"prompt_token_ids": [1, 5, 6, 7]}
        plain = llm.generate(prompt, greedy(6), use_tqdm=False)[0].outputs[0].token_ids
        tokenizer = llm.get_tokenizer()
        long_word = tokenizer.decode(plain) * 8  # dozens of tokens: more than max_tokens=6
        out = llm.generate(prompt, greedy(6, bad_words=[long_word]), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == plain and batch.recent is None
        word = tokenizer.decode(plain[2:4])
        llm.generate(prompt, greedy(6, bad_words=[word]), use_tqdm=False)
        assert batch.recent is not None  # made for that request
        llm.generate(prompt, greedy(2), use_tqdm=False)  # whose step frees the finished request's row
        assert batch.recent is None
        params = greedy(6, bad_words=["the"])
        params.bad_words.append(3)  # type: ignore[union-attr]
        with pytest.raises(InvalidRequestError, match="bad_words must be a list of words"):
            llm.generate(prompt, params, use_tqdm=False)
