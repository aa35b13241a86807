"""vLLM's `truncate_prompt_tokens`: a request keeps only its prompt's last k tokens (-1: max_model_len of
them). The reference is HF transformers' greedy continuation of those last tokens alone."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import hf_greedy

from tp_runtime import LLM, SamplingParams
from tp_runtime.errors import InvalidRequestError

PROMPT = [1, 57, 201, 33, 90, 14, 77, 3, 150, 42, 8]
MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(seed=5)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    with LLM(model_dir, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN) as engine:
        yield engine


def _greedy(keep: int | None, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, truncate_prompt_tokens=keep)


@pytest.mark.parametrize("keep", [1, 4, len(PROMPT), MAX_MODEL_LEN])
def test_the_last_tokens_are_kept(llm: LLM, model_dir: Path, keep: int) -> None:
    out = llm.generate({"prompt_token_ids": PROMPT}, _greedy(keep), use_tqdm=False)[0]
    kept = PROMPT[-keep:]
    assert out.prompt_token_ids == kept
    assert out.outputs[0].token_ids == hf_greedy(model_dir, [kept], 6)[0]


def test_a_text_prompt_is_truncated_after_encoding(llm: LLM) -> None:
    """The text is encoded (BOS and all), then cut; RequestOutput.prompt keeps the text as given (vLLM's)."""
    text = "Hello there, my friend, how are you"
    whole = llm.get_tokenizer()(text)["input_ids"]
    out = llm.generate(text, _greedy(3), use_tqdm=False)[0]
    same = llm.generate({"prompt_token_ids": whole[-3:]}, _greedy(None), use_tqdm=False)[0]
    assert out.prompt == text and out.prompt_token_ids == whole[-3:]
    assert out.outputs[0].token_ids == same.outputs[0].token_ids


def test_minus_one_keeps_max_model_len_tokens(llm: LLM) -> None:
    """-1 keeps max_model_len tokens: a longer prompt is cut to that, which leaves no room for an output
    (the usual error, not a silent wrong answer); one of max_model_len - 1 tokens is served whole."""
    long = (PROMPT * 4)[: MAX_MODEL_LEN + 5]
    with pytest.raises(InvalidRequestError, match=f"the prompt has {MAX_MODEL_LEN} tokens but max_model_len"):
        llm.generate({"prompt_token_ids": long}, _greedy(-1), use_tqdm=False)
    fits = long[: MAX_MODEL_LEN - 1]
    out = llm.generate({"prompt_token_ids": fits}, _greedy(-1, max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids == fits and len(out.outputs[0].token_ids) == 1


@pytest.mark.parametrize("keep", [0, -2, 1.5, True, "3"], ids=repr)
def test_bad_values_are_named(keep: object) -> None:
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens must be None, -1"):
        SamplingParams(truncate_prompt_tokens=keep)  # type: ignore[arg-type]


def test_more_than_max_model_len_is_refused(llm: LLM) -> None:
    message = r"truncate_prompt_tokens value \(33\) is greater than max_model_len \(32\)"
    with pytest.raises(InvalidRequestError, match=message) as info:
        llm.generate({"prompt_token_ids": PROMPT}, _greedy(MAX_MODEL_LEN + 1), use_tqdm=False)
    assert info.value.field == "truncate_prompt_tokens"
