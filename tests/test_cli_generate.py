"""`tp-runtime generate --n / --logprobs / --chat`, checked against the Python API run independently:
`LLM.generate` with `SamplingParams(n=..., logprobs=...)` and `LLM.chat`."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import transformers

from tp_runtime import LLM, SamplingParams, cli
from tp_runtime.models_catalog import resolve_model_name

MODEL = "tiny-llama"  # the built-in model the CLI tests use
PROMPTS = ["The capital of France is", "Hello world, this is a test"]
ENGINE = ["--model", MODEL, "--device", "cpu", "--dtype", "float32"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(MODEL, device="cpu", dtype="float32") as engine:
        yield engine


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    """`tp-runtime generate ARGV` in this process; the lines it printed."""
    cli.main(["generate", *argv])
    out = capsys.readouterr().out
    return out.splitlines()


def _logprob_line(i: int, token_id: int, position: dict[int, Any], top: int) -> str:
    """A --logprobs line, formatted from the API's Logprob objects."""
    chosen = position[token_id]
    line = f"    {i:>3} {chosen.decoded_token!r} {chosen.logprob:.4f} (rank {chosen.rank})"
    if top:
        ranked = sorted((lp for lp in position.values() if lp.rank <= top), key=lambda lp: lp.rank)
        line += f"; top {top}: " + ", ".join(f"{lp.decoded_token!r} {lp.logprob:.4f}" for lp in ranked)
    return line


def test_n_and_logprobs_match_the_api(llm: LLM, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    lines = _run(capsys, *ENGINE, "--max-tokens", "6", "--ignore-eos", "--temperature", "0.9",
                 "--sampling-seed", "11", "--n", "3", "--logprobs", "2", "--output-json", str(out),
                 *PROMPTS)  # fmt: skip
    params = SamplingParams(temperature=0.9, seed=11, n=3, logprobs=2, max_tokens=6, ignore_eos=True)
    want = llm.generate(PROMPTS, params, use_tqdm=False)
    records = json.loads(out.read_text())
    assert len(records) == len(PROMPTS)
    expected_lines = []
    for prompt, record, ref in zip(PROMPTS, records, want, strict=True):
        assert record["prompt"] == prompt and record["prompt_token_ids"] == ref.prompt_token_ids
        assert [o["index"] for o in record["outputs"]] == [0, 1, 2]
        assert len({tuple(o["token_ids"]) for o in record["outputs"]}) > 1  # n samples, not n copies
        for got, comp in zip(record["outputs"], ref.outputs, strict=True):
            assert got["token_ids"] == comp.token_ids and got["text"] == comp.text
            assert got["finish_reason"] == comp.finish_reason == "length"
            assert got["cumulative_logprob"] == pytest.approx(comp.cumulative_logprob, abs=1e-5)
            assert comp.logprobs is not None
            for entry, token_id, position in zip(got["logprobs"], comp.token_ids, comp.logprobs, strict=True):
                chosen = position[token_id]
                assert entry["token_id"] == token_id and entry["token"] == chosen.decoded_token
                assert entry["logprob"] == pytest.approx(chosen.logprob, abs=1e-5)
                assert entry["rank"] == chosen.rank
                top = sorted((lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank <= 2)
                assert [(t["rank"], t["token_id"]) for t in entry["top"]] == [(r, t) for r, t, _ in top]
                assert [t["logprob"] for t in entry["top"]] == pytest.approx([lp for *_, lp in top], abs=1e-5)
            about = f"{len(comp.token_ids)} tokens, length, cumulative logprob {comp.cumulative_logprob:.4f}"
            expected_lines.append(f"{prompt!r} -> [{comp.index}] {comp.text!r} ({about})")
            expected_lines += [
                _logprob_line(i, t, p, 2)
                for i, (t, p) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True))
            ]
        # The top-level fields stay the first completion's, as before --n.
        assert record["token_ids"] == record["outputs"][0]["token_ids"]
    assert lines == expected_lines


def test_logprobs_zero_gives_the_sampled_token_alone(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    lines = _run(capsys, *ENGINE, "--max-tokens", "3", "--ignore-eos", "--logprobs", "0", PROMPTS[0])
    [ref] = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0),
                         use_tqdm=False)  # fmt: skip
    comp = ref.outputs[0]
    assert comp.logprobs is not None
    assert lines[0].startswith(f"{PROMPTS[0]!r} -> {comp.text!r} (3 tokens, length, cumulative logprob ")
    assert lines[1:] == [
        _logprob_line(i, t, p, 0) for i, (t, p) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True))
    ]


def test_n_greedy_without_logprobs(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --logprobs the lines keep their form, one per completion."""
    lines = _run(capsys, *ENGINE, "--max-tokens", "4", "--n", "2", *PROMPTS)
    want = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, n=2), use_tqdm=False)
    assert lines == [
        f"{p!r} -> [{c.index}] {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason})"
        for p, ref in zip(PROMPTS, want, strict=True)
        for c in ref.outputs
    ]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model, with a chat template in its tokenizer."""
    out = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(resolve_model_name(MODEL), out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    return out


def test_chat_matches_llm_chat(chat_model: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    lines = _run(capsys, "--model", str(chat_model), "--device", "cpu", "--dtype", "float32", "--chat",
                 "--max-tokens", "5", "--ignore-eos", "--output-json", str(out), *PROMPTS)  # fmt: skip
    with LLM(chat_model, device="cpu", dtype="float32") as engine:
        want = engine.chat(
            [[{"role": "user", "content": p}] for p in PROMPTS],
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
            use_tqdm=False,
        )
    records = json.loads(out.read_text())
    tok = transformers.AutoTokenizer.from_pretrained(chat_model)
    for prompt, record, ref in zip(PROMPTS, records, want, strict=True):
        rendered = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
        assert record["message"] == prompt and record["prompt"] == ref.prompt == rendered
        assert record["prompt_token_ids"] == ref.prompt_token_ids
        assert record["token_ids"] == ref.outputs[0].token_ids and record["text"] == ref.outputs[0].text
    # The line shows the user's message, not the rendered template.
    assert lines == [
        f"{p!r} -> {r.outputs[0].text!r} (5 tokens, length)" for p, r in zip(PROMPTS, want, strict=True)
    ]


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--n", "0"], ["argument --n: must be at least 1, got 0"]),
        (["--logprobs", "-1"], ["argument --logprobs: must be at least 0, got -1"]),
        (["--logprobs", "21"], ["argument --logprobs: must be at most --max-logprobs (20), got 21"]),
        (["--logprobs", "3", "--max-logprobs", "2"], ["--max-logprobs (2)"]),
        (["--chat"], ["argument --chat:", "no chat template", "leave out --chat"]),
    ],
)
def test_bad_flag_is_one_line(
    argv: list[str], fragments: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", *ENGINE, *argv])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.startswith("tp-runtime: error: ") and len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err
