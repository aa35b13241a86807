"""Request values at the edges of what the workers can hold: rejected with an InvalidRequestError that
quotes what the user passed, or served (capped) with the documented meaning; never an overflow inside a
step. After each test the shared LLM must still generate exactly as before.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tp_runtime import LLM, SamplingParams
from tp_runtime.errors import InvalidRequestError

VOCAB = 300
MAX_MODEL_LEN = 32
PROBE = {"prompt_token_ids": [1, 17, 42, 99]}
GREEDY4 = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def shared_llm(make_checkpoint: Callable[..., Path]) -> Iterator[tuple[LLM, list[int]]]:
    llm = LLM(make_checkpoint(), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    baseline = llm.generate(PROBE, GREEDY4, use_tqdm=False)[0].outputs[0].token_ids
    yield llm, baseline
    llm.shutdown()


@pytest.fixture
def llm(shared_llm: tuple[LLM, list[int]]) -> Iterator[LLM]:
    engine, baseline = shared_llm
    yield engine
    assert not engine.engine.has_unfinished_requests(), "a failed request was left in the scheduler"
    assert engine.generate(PROBE, GREEDY4, use_tqdm=False)[0].outputs[0].token_ids == baseline


def ids(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(PROBE, params, use_tqdm=False)[0].outputs]


# ----------------------------------------------------------------------------- top_k
@pytest.mark.parametrize("top_k", [2**63, 2**64 + 5, 10**30])
def test_top_k_beyond_int64_quotes_the_value(top_k: int) -> None:
    with pytest.raises(InvalidRequestError, match=rf"top_k .* got {top_k}$"):
        SamplingParams(top_k=top_k)


@pytest.mark.parametrize("top_k", [VOCAB, VOCAB + 1, 2**31, 2**63 - 1])
def test_top_k_at_or_above_vocab_keeps_every_token(llm: LLM, top_k: int) -> None:
    """Capped at the vocabulary size: the same draws as with top_k disabled."""
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    assert ids(llm, SamplingParams(**{**sampled.__dict__, "top_k": top_k})) == ids(llm, sampled)
    # ...and a top_k below the vocabulary still filters (so the comparison above means something).
    assert ids(llm, SamplingParams(**{**sampled.__dict__, "top_k": 2})) != ids(llm, sampled)


# ----------------------------------------------------------------------------- seeds
def test_largest_seed_with_n_samples(llm: LLM) -> None:
    """seed + j for sample j wraps around within int64 instead of failing on a seed the user never gave."""
    params = SamplingParams(temperature=1.0, seed=2**63 - 1, n=2, max_tokens=8, ignore_eos=True)
    first, second = ids(llm, params)
    assert ids(llm, params) == [first, second] and first != second
    alone = SamplingParams(temperature=1.0, seed=-(2**63), max_tokens=8, ignore_eos=True)
    assert ids(llm, alone) == [second]


def test_seed_minus_one_means_unseeded_as_in_vllm(llm: LLM) -> None:
    """vLLM reads seed=-1 as no seed: two such requests draw differently. Sample j of an n > 1 request is
    still seeded with seed + j, also where that is -1."""
    assert SamplingParams(seed=-1).seed is None
    params = SamplingParams(temperature=1.0, seed=-1, max_tokens=4, ignore_eos=True)
    first, second = llm.generate([PROBE, PROBE], params, use_tqdm=False)
    assert first.outputs[0].token_ids != second.outputs[0].token_ids
    pair = SamplingParams(temperature=1.0, seed=-2, n=2, max_tokens=4, ignore_eos=True)
    assert ids(llm, pair) == ids(llm, pair)


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**100])
def test_seed_out_of_range_quotes_the_value(seed: int) -> None:
    with pytest.raises(InvalidRequestError, match=rf"seed .* got {seed}$"):
        SamplingParams(seed=seed, n=2)


# ----------------------------------------------------------------------------- other integers
def test_huge_min_tokens_runs_to_max_model_len(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=2**70, min_tokens=2**64)
    out = llm.generate(PROBE, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == MAX_MODEL_LEN - 4


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [VOCAB + 1, 2**63, 2**70])
def test_logprobs_beyond_vocab_quote_the_value(llm: LLM, name: str, value: int) -> None:
    with pytest.raises(InvalidRequestError, match=f"{name}={value} exceeds the vocabulary size {VOCAB}"):
        llm.generate(PROBE, SamplingParams(max_tokens=2, **{name: value}), use_tqdm=False)


@pytest.mark.parametrize("token", [VOCAB, 2**63, 2**64 + 1])
def test_stop_token_id_beyond_vocab_quotes_the_value(llm: LLM, token: int) -> None:
    with pytest.raises(InvalidRequestError, match=f"stop token id {token} is outside the vocabulary"):
        llm.generate(PROBE, SamplingParams(max_tokens=2, stop_token_ids=[token]), use_tqdm=False)


# ----------------------------------------------------------------------------- new SamplingParams fields
@pytest.mark.parametrize(
    "field,value",
    [
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("presence_penalty", float("nan")),
        ("presence_penalty", "0.5"),
        ("frequency_penalty", -3),
        ("frequency_penalty", float("inf")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("repetition_penalty", 1e-40),  # zero once the workers hold it as float32
        ("repetition_penalty", 1e39),  # infinite as float32
        ("temperature", 1e39),  # infinite as float32: masked logits / inf would be NaN
        ("repetition_penalty", None),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", 1.5),
        ("include_stop_str_in_output", "yes"),
        ("include_stop_str_in_output", 1),
    ],
    ids=repr,
)
def test_invalid_new_fields_quote_the_value(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert message.startswith("invalid SamplingParams") and field in message
    assert message.endswith(f"got {value!r}"), message


def test_penalty_edges_are_accepted(llm: LLM) -> None:
    for kwargs in ({"presence_penalty": 2}, {"frequency_penalty": -2.0}, {"repetition_penalty": 1e-6}):
        assert len(ids(llm, SamplingParams(max_tokens=3, ignore_eos=True, **kwargs))[0]) == 3


def test_largest_temperature_still_holds_back_stop_tokens(llm: LLM) -> None:
    """The largest float32 temperature samples (near uniformly) and min_tokens still masks EOS."""
    eos = llm.engine.eos_token_ids
    params = SamplingParams(temperature=3.4e38, seed=1, max_tokens=8, min_tokens=8, stop_token_ids=[7, 8])
    (out,) = llm.generate({"prompt_token_ids": [1, 57, 201, 33]}, params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 8 and out.outputs[0].finish_reason == "length"
    assert not set(tokens) & (set(eos) | {7, 8})


# ----------------------------------------------------------------------------- prompts
@pytest.mark.parametrize("prompt", ["a\ud800b", "\udfff", "ok \udc80 then"], ids=ascii)
def test_prompt_the_tokenizer_cannot_encode(llm: LLM, prompt: str) -> None:
    with pytest.raises(InvalidRequestError, match="lone surrogate") as info:
        llm.generate(prompt, GREEDY4, use_tqdm=False)
    assert repr(prompt) in str(info.value), "the message should quote the prompt"
    # One bad prompt in a batch rejects the batch before anything runs.
    with pytest.raises(InvalidRequestError, match="lone surrogate"):
        llm.generate(["fine", prompt], GREEDY4, use_tqdm=False)


def test_a_bad_word_that_is_no_unicode_text_is_refused(llm: LLM) -> None:
    """It reached the tokenizer, whose TypeError came out as it was."""
    params = SamplingParams(max_tokens=2, bad_words=["fine", "ok\udc80"])
    with pytest.raises(InvalidRequestError, match=r"bad word 'ok\\udc80'.*lone surrogate") as info:
        llm.generate(PROBE, params, use_tqdm=False)
    assert info.value.field == "bad_words"


@pytest.mark.parametrize("added", [7, "", None])
def test_a_stop_list_changed_after_construction_is_refused(llm: LLM, added: Any) -> None:
    """SamplingParams checks `stop` when made, but its list is the caller's. A non-string put in it later
    failed inside add_request (a TypeError) after the request was queued: it ran on with no owner, and the
    next generate failed on its output. Refused now, with nothing left behind (the fixture checks)."""
    params = SamplingParams(temperature=0.0, max_tokens=4, stop=["x"])
    assert isinstance(params.stop, list)
    params.stop.append(added)
    for submit in (
        lambda: llm.engine.add_request([1, 17, 42], params),
        lambda: llm.generate(PROBE, params, use_tqdm=False),
    ):
        with pytest.raises(InvalidRequestError, match="stop must be a non-empty string") as info:
            submit()
        assert info.value.field == "stop"


def test_a_request_that_fails_while_being_added_leaves_nothing_behind(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever fails while add_request builds a request (here its detokenizer), the request is not
    queued, nor its grammar or text state kept."""
    import tp_runtime.engine.llm_engine as llm_engine
    from tp_runtime.sampling_params import StructuredOutputsParams

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no detokenizer")

    monkeypatch.setattr(llm_engine, "IncrementalDetokenizer", broken)
    params = SamplingParams(max_tokens=4, stop=["x"], structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(RuntimeError, match="no detokenizer"):
        llm.engine.add_request([1, 17, 42], params)
    assert not llm.engine._constrained and not llm.engine._text_states
    monkeypatch.undo()


def test_chat_message_the_tokenizer_cannot_encode(llm: LLM) -> None:
    conv = [{"role": "user", "content": "a\ud800b"}]
    with pytest.raises(InvalidRequestError, match=re.escape(r"'\ud800'")):
        llm.chat(conv, GREEDY4, chat_template="{{ messages[0]['content'] }}", use_tqdm=False)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_logprobs_beyond_max_logprobs_say_what_to_raise(llm: LLM, name: str) -> None:
    limit = llm.config.max_logprobs
    assert limit < VOCAB
    with pytest.raises(
        InvalidRequestError, match=rf"{name}={limit + 1} exceeds max_logprobs={limit}.*max_logprobs"
    ):
        llm.generate(PROBE, SamplingParams(max_tokens=2, **{name: limit + 1}), use_tqdm=False)
    out = llm.generate(PROBE, SamplingParams(max_tokens=2, **{name: limit}), use_tqdm=False)[0]
    assert out.outputs[0].token_ids


@pytest.mark.parametrize(
    ("prompt", "error"),
    [
        ([1, True], "prompt token ids must be ints, got True"),
        ([1, 2.0], "prompt token ids must be ints, got 2.0"),
        ([1, "7"], "prompt token ids must be ints, got '7'"),
        ([3, -1, 2], r"prompt token id -1 is outside the vocabulary \[0, "),
        ([3, 2, 10**6], "prompt token id 1000000 is outside the vocabulary"),
        ([5, -1, 2.0], r"prompt token id -1 is outside the vocabulary \[0, "),
        ([5, 2.0, -1], "prompt token ids must be ints, got 2.0"),
        ([3, 2, 10**30], "prompt token id 1000000000000000000000000000000 is outside the vocabulary"),
        (["numpy", 10**6], "prompt token id 1000000 is outside the vocabulary"),
        ("3 4", "prompt_token_ids must be a list of ints, got str"),
        ([], "the prompt is empty"),
    ],
)
def test_prompt_token_ids_are_checked_one_by_one(llm: LLM, prompt: Any, error: str) -> None:
    """Every id is an int (numpy ints too, bools not) inside the vocabulary; the error names the first bad
    one, whether the prompt holds plain ints (checked in bulk) or other integer types."""
    import numpy as np

    if prompt and prompt[0] == "numpy":
        prompt = [np.int64(5), np.int32(prompt[1])]
    with pytest.raises(InvalidRequestError, match=error):
        llm.engine.check_request(prompt, SamplingParams())
    assert llm.engine.check_request((np.int16(4), 5, np.uint8(6)), SamplingParams()) == [4, 5, 6]


@pytest.mark.parametrize(
    "field",
    [{"bad_words": ["word"] * 100_000 + [""]}, {"stop": ["end"] * 100_000 + [""]},
     {"stop_token_ids": [1] * 100_000 + [-1]}, {"allowed_token_ids": "1" * 300_000}],
    ids=["bad_words", "stop", "stop_token_ids", "allowed_token_ids"],
)  # fmt: skip
def test_a_huge_invalid_list_is_quoted_short(field: dict[str, Any]) -> None:
    """A list of 100,000 items ending in a bad one (or a long string for a list): the error quotes its
    start, not all of it (the 400 was as large as the request)."""
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**field)
    assert len(str(caught.value)) < 500, str(caught.value)[:600]
