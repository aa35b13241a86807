"""Stop conditions and multi-sample requests, against the plain greedy continuation as reference."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import hf_greedy, hf_logprobs

from tp_runtime import LLM, SamplingParams
from tp_runtime.errors import InvalidRequestError

PROMPT = [1, 57, 201, 33, 90, 14]
N = 24


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(seed=5)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[int]:
    return hf_greedy(model_dir, [PROMPT], N)[0]


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    with LLM(model_dir, device="cpu", dtype="float32") as engine:
        yield engine


def _greedy(llm: LLM, **kwargs: object) -> object:
    params = SamplingParams(temperature=0, max_tokens=N, **kwargs)  # type: ignore[arg-type]
    return llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]


def test_length_and_text(llm: LLM, model_dir: Path, reference: list[int]) -> None:
    out = _greedy(llm, ignore_eos=True)
    assert out.token_ids == reference and out.finish_reason == "length"  # type: ignore[attr-defined]
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert out.text == tok.decode(reference, skip_special_tokens=True)  # type: ignore[attr-defined]


def test_stop_token_ids(llm: LLM, reference: list[int]) -> None:
    stop = reference[7]
    cut = reference.index(stop)
    out = _greedy(llm, ignore_eos=True, stop_token_ids=[stop])
    assert out.token_ids == reference[: cut + 1]  # type: ignore[attr-defined]
    assert out.finish_reason == "stop" and out.stop_reason == stop  # type: ignore[attr-defined]


def test_stop_token_ids_wait_for_min_tokens(llm: LLM, reference: list[int]) -> None:
    # Masked until min_tokens outputs exist, so the continuation changes; it must not stop early.
    stop = reference[0]
    out = _greedy(llm, ignore_eos=True, stop_token_ids=[stop], min_tokens=5)
    assert len(out.token_ids) >= 5 and stop not in out.token_ids[:5]  # type: ignore[attr-defined]


def test_min_tokens_leaves_the_logprobs_raw(llm: LLM, model_dir: Path, reference: list[int]) -> None:
    """While min_tokens holds back the stop tokens they cannot be sampled, but the logprobs stay the raw
    model's (HF's log-softmax over the whole vocabulary): the masked token keeps its rank and mass."""
    stop = reference[0]  # the greedy first token: rank 1 of the raw distribution
    out = _greedy(llm, ignore_eos=True, stop_token_ids=[stop], min_tokens=3, logprobs=2)
    tokens = out.token_ids  # type: ignore[attr-defined]
    assert tokens[0] != stop
    want = hf_logprobs(model_dir, PROMPT, tokens)  # [len(tokens), vocab]
    for i, position in enumerate(out.logprobs):  # type: ignore[attr-defined]
        top = want[i].topk(2)
        for rank, (value, token) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True)):
            assert position[token].rank == rank + 1
            assert position[token].logprob == pytest.approx(value, abs=1e-4)
        assert position[tokens[i]].logprob == pytest.approx(want[i, tokens[i]].item(), abs=1e-4)
    assert stop in out.logprobs[0] and out.logprobs[0][stop].rank == 1  # type: ignore[attr-defined]


def test_stop_string(llm: LLM, model_dir: Path, reference: list[int]) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    full = tok.decode(reference, skip_special_tokens=True)
    stop = next(
        full[i : i + 2]
        for i in range(len(full) // 3, len(full) - 2)
        if full[i : i + 2].strip() and "\ufffd" not in full[i : i + 2]
    )
    idx = full.find(stop)
    # The first token whose text completes the stop string ends the request.
    end = next(j for j in range(1, N + 1) if stop in tok.decode(reference[:j], skip_special_tokens=True))
    out = _greedy(llm, ignore_eos=True, stop=[stop, "\x00never"])
    assert out.text == full[:idx]  # type: ignore[attr-defined]
    assert out.token_ids == reference[:end]  # type: ignore[attr-defined]
    assert out.finish_reason == "stop" and out.stop_reason == stop  # type: ignore[attr-defined]


def test_stop_strings_wait_for_min_tokens(llm: LLM, model_dir: Path, reference: list[int]) -> None:
    """As vLLM: stop strings are looked for only in the text of the tokens after the first min_tokens, so a
    stop string completed by token min_tokens + 1 ends the request, one completed by token min_tokens
    does not (its text is not searched again)."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    texts = [tok.decode(reference[:j], skip_special_tokens=True) for j in range(N + 1)]
    # A token j (1-based) that adds a character seen nowhere else in the text: the stop string.
    j, stop = next(
        (j, c) for j in range(3, N - 2) for c in texts[j][len(texts[j - 1]) :]
        if texts[j].startswith(texts[j - 1]) and c.strip() and c != "\ufffd" and texts[N].count(c) == 1
    )  # fmt: skip
    out = _greedy(llm, ignore_eos=True, stop=[stop], min_tokens=j - 1)
    assert out.token_ids == reference[:j] and out.finish_reason == "stop"  # type: ignore[attr-defined]
    out = _greedy(llm, ignore_eos=True, stop=[stop], min_tokens=j)
    assert out.token_ids == reference and out.finish_reason == "length"  # type: ignore[attr-defined]
    assert stop in out.text  # type: ignore[attr-defined]


def test_the_earliest_stop_string_wins(llm: LLM, model_dir: Path, reference: list[int]) -> None:
    """Two stop strings completed by the same token, the later one listed first: the text ends before the
    earlier one, so it holds neither (as OpenAI's `stop` promises)."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    texts = [tok.decode(reference[:j], skip_special_tokens=True) for j in range(N + 1)]
    case = next(
        (j, texts[j - 1], texts[j][len(texts[j - 1]) :])
        for j in range(1, N + 1)
        if texts[j].startswith(texts[j - 1])
        and len(new := texts[j][len(texts[j - 1]) :]) >= 2
        and all(c.strip() and c != "\ufffd" and c not in texts[j - 1] and c not in new[:i]
                for i, c in enumerate(new[:2]))
    )  # fmt: skip
    end, before, new = case
    first, second = new[0], new[1]
    out = _greedy(llm, ignore_eos=True, stop=[second, first])
    assert out.token_ids == reference[:end]  # type: ignore[attr-defined]
    assert out.text == before and out.stop_reason == first  # type: ignore[attr-defined]


def test_the_stop_string_that_ends_first_wins(llm: LLM, model_dir: Path, reference: list[int]) -> None:
    """A token completes two stop strings: one that starts in the text before it and ends after the
    other, which is the token's first character alone. The one that ends first wins, as where the text
    grew a character at a time: the output ends before that character (vLLM's choice with it listed first,
    here listed second)."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    texts = [tok.decode(reference[:j], skip_special_tokens=True) for j in range(N + 1)]
    end, before, new = next(
        (j, texts[j - 1], texts[j][len(texts[j - 1]) :])
        for j in range(2, N + 1)
        if texts[j].startswith(texts[j - 1])
        and len(texts[j - 1]) >= 1
        and len(new := texts[j][len(texts[j - 1]) :]) >= 2
        and new[0].strip() and new[0] != "\ufffd" and new[0] not in texts[j - 1]
        and texts[j - 1][-1] + new[:2] not in texts[j - 1] + new[:1]
    )  # fmt: skip
    longer, shorter = before[-1] + new[:2], new[0]
    out = _greedy(llm, ignore_eos=True, stop=[longer, shorter])
    assert out.token_ids == reference[:end]  # type: ignore[attr-defined]
    assert out.text == before and out.stop_reason == shorter  # type: ignore[attr-defined]
    out = _greedy(llm, ignore_eos=True, stop=[longer, shorter], include_stop_str_in_output=True)
    assert out.text == before + shorter and out.stop_reason == shorter  # type: ignore[attr-defined]


def test_min_tokens_holds_eos_back_also_with_ignore_eos(llm: LLM, reference: list[int]) -> None:
    """As vLLM and HF's min_new_tokens: EOS cannot be sampled before min_tokens outputs, whatever
    ignore_eos says (which only lets it through as an output after them)."""
    eos = llm.get_tokenizer().eos_token_id
    out = _greedy(llm, ignore_eos=True, min_tokens=4, logit_bias={eos: 100.0})
    tokens = out.token_ids  # type: ignore[attr-defined]
    assert eos not in tokens[:4] and tokens[4:] == [eos] * (N - 4), tokens
    assert tokens[0] == reference[0]  # the raw greedy token, EOS held back


def test_eos_list_from_generation_config(model_dir: Path, reference: list[int], tmp_path: Path) -> None:
    local = tmp_path / "model"
    shutil.copytree(model_dir, local)
    eos = reference[4]
    (local / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, eos]}))
    with LLM(local, device="cpu", dtype="float32") as engine:
        out = engine.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=N),
                              use_tqdm=False)[0].outputs[0]  # fmt: skip
        ignored = engine.generate(
            {"prompt_token_ids": PROMPT},
            SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
            use_tqdm=False,
        )[0].outputs[0]
    assert out.token_ids == reference[: reference.index(eos) + 1] and out.finish_reason == "stop"
    # As vLLM: the generation config's EOS ids other than the tokenizer's are reported as stop tokens.
    assert out.stop_reason == eos
    assert ignored.token_ids == reference
    # The tokenizer's EOS (2) named only by stop_token_ids still ends an output with no stop_reason.
    (local / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    with LLM(local, device="cpu", dtype="float32") as engine:
        params = SamplingParams(temperature=0, max_tokens=N, allowed_token_ids=[2], stop_token_ids=[2])
        end = engine.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    assert (end.token_ids, end.finish_reason, end.stop_reason) == ([2], "stop", None)


def test_generation_config_eos_replaces_config_eos(
    model_dir: Path, reference: list[int], tmp_path: Path
) -> None:
    """As transformers' generate: generation_config.json's eos ids stand alone. (When it gives none,
    config.json's eos_token_id is used, where transformers' generate would not stop at all.)"""
    local = tmp_path / "model"
    shutil.copytree(model_dir, local)
    config = json.loads((local / "config.json").read_text())
    early, late = reference[2], next(t for t in reference[3:] if t not in reference[:3])
    config["eos_token_id"] = early
    (local / "config.json").write_text(json.dumps(config))
    (local / "generation_config.json").write_text(json.dumps({"eos_token_id": [late]}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                       pad_token_id=0)[0, len(PROMPT) :].tolist()  # fmt: skip
    assert want == reference[: reference.index(late) + 1]
    with LLM(local, device="cpu", dtype="float32") as engine:
        assert engine.engine.eos_token_ids == {late}
        out = engine.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=N),
                              use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.token_ids == want and out.finish_reason == "stop"
    (local / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5}))
    with LLM(local, device="cpu", dtype="float32") as engine:
        assert engine.engine.eos_token_ids == {early}


def test_max_model_len_ends_with_length(model_dir: Path, reference: list[int]) -> None:
    with LLM(model_dir, device="cpu", dtype="float32", max_model_len=len(PROMPT) + 5) as engine:
        out = engine.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=N,
                              ignore_eos=True), use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.token_ids == reference[:5] and out.finish_reason == "length"


def test_n_samples_are_seeded_children(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=11, n=3)
    first = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    again = llm.generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:3]}], params, use_tqdm=False
    )
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in first.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3  # independent samples
    single = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=12)
    alone = llm.generate({"prompt_token_ids": PROMPT}, single, use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == first.outputs[1].token_ids  # child j uses seed + j


def test_detokenize_false_leaves_the_text_out(llm: LLM, reference: list[int]) -> None:
    """vLLM's detokenize=False: the same tokens and logprobs, streamed or not, with empty text and no
    decoded tokens; stop strings, which need the text, are refused."""
    with pytest.raises(InvalidRequestError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    for name in ("detokenize", "spaces_between_special_tokens"):
        with pytest.raises(InvalidRequestError, match=f"{name} must be True or False, got 1"):
            SamplingParams(**{name: 1})  # type: ignore[arg-type]
    fields = dict(temperature=0, max_tokens=N, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    with_text = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(**fields), use_tqdm=False)[0]
    params = SamplingParams(**fields, detokenize=False)  # type: ignore[arg-type]
    without = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    out = without.outputs[0]
    assert out.token_ids == with_text.outputs[0].token_ids == reference and with_text.outputs[0].text
    assert out.text == ""
    assert [{t: lp.logprob for t, lp in p.items()} for p in out.logprobs] == [
        {t: lp.logprob for t, lp in p.items()} for p in with_text.outputs[0].logprobs
    ]
    assert all(lp.decoded_token is None for p in out.logprobs for lp in p.values())
    assert all(lp.decoded_token is None for p in without.prompt_logprobs[1:] for lp in p.values())
    engine = llm.engine
    streamed = engine.add_request(PROMPT, replace(params, prompt_logprobs=None), stream=True)
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [o.outputs[0] for o in engine.step() if o.request_id == str(streamed)]
    assert [t for p in pieces for t in p.token_ids] == reference and {p.text for p in pieces} == {""}


def test_spaces_between_special_tokens_reach_a_slow_tokenizers_decode() -> None:
    """Given to the decode of a tokenizer without a Rust backend (a slow one: transformers 4's decode reads
    it, 5's does not); a fast one's decode does the same either way (as vLLM's), through its backend."""
    from tp_runtime.engine.llm_engine import _make_decode

    class Slow:
        def decode(self, ids: list[int], skip_special_tokens: bool, **options: Any) -> str:
            return f"{ids} {skip_special_tokens} {options}"

    assert _make_decode(Slow(), False, False)([3]) == "[3] False {'spaces_between_special_tokens': False}"
    assert _make_decode(Slow(), True, True)([3]) == "[3] True {}"


def test_skip_special_tokens(llm: LLM, model_dir: Path) -> None:
    """Special tokens in the output (forced by allowed_token_ids) are left out of the text by default and
    kept with skip_special_tokens=False: the tokenizer's own decode of the same ids, also through the
    incremental detokenizer (a stop string that never matches), where the text of a special token is a
    stop string only when it is kept; the EOS that ends an output stays out of either text unless
    include_stop_str_in_output, as in vLLM."""
    with pytest.raises(InvalidRequestError, match="skip_special_tokens must be True or False, got 'no'"):
        SamplingParams(skip_special_tokens="no")  # type: ignore[arg-type]
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    allowed = [bos, 57, 201, 33]
    outs = {}
    for skip in (True, False):
        for stop in (None, ["never appears"]):
            out = _greedy(
                llm, ignore_eos=True, allowed_token_ids=allowed, skip_special_tokens=skip, stop=stop
            )
            ids = out.token_ids  # type: ignore[attr-defined]
            assert out.text == tok.decode(ids, skip_special_tokens=skip), (skip, stop)  # type: ignore[attr-defined]
            outs[skip] = ids
    ids = outs[True]
    assert outs[False] == ids and bos in ids and set(ids) - {bos}, ids  # both kinds: else it proves nothing
    bos_text = tok.decode([bos], skip_special_tokens=False)
    kept = _greedy(
        llm, ignore_eos=True, allowed_token_ids=allowed, skip_special_tokens=False, stop=[bos_text]
    )
    cut = ids.index(bos)
    assert kept.token_ids == ids[: cut + 1] and kept.stop_reason == bos_text  # type: ignore[attr-defined]
    assert kept.text == tok.decode(ids[:cut], skip_special_tokens=False)  # type: ignore[attr-defined]
    skipped = _greedy(llm, ignore_eos=True, allowed_token_ids=allowed, stop=[bos_text])
    assert skipped.token_ids == ids and skipped.finish_reason == "length"  # type: ignore[attr-defined]
    # An output that ends on EOS has no stop_reason, as in vLLM, though stop_token_ids name it too; where
    # EOS is ignored and stop_token_ids name it, it stops as a stop token.
    for include, stop_ids, ignore in ((False, None, False), (True, [eos], False), (False, [eos], True)):
        out = _greedy(
            llm, allowed_token_ids=[eos, *allowed], skip_special_tokens=False,
            include_stop_str_in_output=include, stop_token_ids=stop_ids, ignore_eos=ignore,
        )  # fmt: skip
        ids = out.token_ids  # type: ignore[attr-defined]
        assert out.finish_reason == "stop" and ids[-1] == eos, ids  # type: ignore[attr-defined]
        assert out.stop_reason == (eos if ignore else None)  # type: ignore[attr-defined]
        want = tok.decode(ids if include else ids[:-1], skip_special_tokens=False)
        assert out.text == want, (include, out.text, want)  # type: ignore[attr-defined]
