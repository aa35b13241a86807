"""`tp-runtime serve` end to end: the server runs in a subprocess (`python -m tp_runtime.server.cli`) on a
free loopback port and the official `openai` client talks to it.

Outputs are checked against `LLM.generate` / `LLM.chat` on the same checkpoint at the same TP size: a tiny
random Llama whose tokenizer carries a chat template. Two servers (TP=1, and TP=2 with an API key) serve
most tests; the drains (SIGTERM, Ctrl-C, a signal during the load) and the dead engine get servers of
their own. Every wait is for an event (the ready line, a chunk, a metric reaching a value, a process
exiting), under a generous deadline.

The last tests run the app in this process (`build_app` over an AsyncLLMEngine whose executor is the
scripted one of test_streaming_engine), to choose the tokens (multi-byte characters, stop strings), the
failures (a worker's traceback) and the moments (a client gone before its stream's first event).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import transformers
from test_detokenizer import FAMILIES, first_stop
from test_detokenizer import reference as detok_reference
from test_streaming_engine import (
    PROMPT,
    TEXT,
    VOCAB,
    ScriptedExecutor,
    _sentencepiece_style_tokenizer,
    closed_form,
    make_engine,
    text_script,
)

from tp_runtime import LLM, SamplingParams
from tp_runtime.config import build_model_config
from tp_runtime.engine.async_engine import AsyncLLMEngine
from tp_runtime.errors import InvalidRequestError, WorkerError
from tp_runtime.presets import build_preset_tokenizer
from tp_runtime.server.api_server import build_app
from tp_runtime.server.openai_format import CompletionFormat, TextOffsets, TokenBytes

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = (
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"  # a variable for chat_template_kwargs
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NAME = "tiny-chat"
MAX_MODEL_LEN = 512
API_KEY = "test-key-123"
START_DEADLINE_S = 180.0
PROMPTS = ["Hello, my name is", "The capital of France is", "In the beginning", "1, 2, 3, 4,"]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose tokenizer carries TEMPLATE as its chat template."""
    out = tmp_path_factory.mktemp("served") / "model"
    shutil.copytree(make_checkpoint(seed=6), out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    return out


# ----------------------------------------------------------------------------------------- servers
@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    log: Path
    url: str = ""
    api_key: str | None = None
    worker_pids: list[int] = field(default_factory=list)

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, **kwargs
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        for line in text.splitlines():
            match = re.match(rf"tp_runtime:{re.escape(name)}\{{(.*)\}} (\S+)$", line)
            if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
                return float(match.group(2))
        assert name.endswith("_total"), f"no metric {name} in /metrics"
        return 0.0  # a labelled counter not incremented yet

    def wait_for_metric(self, name: str, ok: Callable[[float], bool], **labels: str) -> float:
        deadline = time.monotonic() + 60
        while True:
            value = self.metric(name, **labels)
            if ok(value):
                return value
            assert time.monotonic() < deadline, f"{name} stayed at {value}"
            time.sleep(0.02)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def _children(pid: int) -> list[int]:
    """Pids of the live processes whose parent is `pid` (the engine's spawned workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def start_server(model: Path | str, tp: int, tmp: Path, *extra: str, api_key: str | None = None) -> Server:
    log = tmp / f"server-tp{tp}-{time.monotonic_ns()}.log"
    cmd = [
        sys.executable, "-m", "tp_runtime.server.cli", "--model", str(model), "-tp", str(tp),
        "--device", "cpu", "--port", "0", "--served-model-name", NAME, "--max-num-seqs", "32",
        "--log-level", "warning", "--no-access-log", *extra,
    ]  # fmt: skip
    if "--max-model-len" not in extra:
        cmd += ["--max-model-len", str(MAX_MODEL_LEN)]
    if api_key:
        cmd += ["--api-key", api_key]
    with open(log, "wb") as sink:  # a file, not a pipe: a pipe nobody reads would block the server
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    server = Server(proc, log, api_key=api_key)
    deadline = time.monotonic() + START_DEADLINE_S
    while not (match := re.search(r"ready on (http://\S+)", server.output())):
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop() if proc.poll() is None else None
            pytest.fail(f"the server did not start:\n{server.output()[-4000:]}")
        time.sleep(0.05)
    server.url = match.group(1)
    server.worker_pids = _children(proc.pid)
    assert len(server.worker_pids) == (tp if tp > 1 else 0), server.worker_pids
    return server


@pytest.fixture(scope="module")
def server1(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(model_dir, 1, tmp_path_factory.mktemp("server1"))
    yield server
    assert server.stop() == 0, server.output()[-4000:]
    assert "Traceback" not in server.output(), server.output()[-4000:]


@pytest.fixture(scope="module")
def server2(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(model_dir, 2, tmp_path_factory.mktemp("server2"), api_key=API_KEY)
    yield server
    assert server.stop() == 0, server.output()[-4000:]
    assert "Traceback" not in server.output(), server.output()[-4000:]


@pytest.fixture(scope="module")
def llm1(model_dir: Path) -> Iterator[LLM]:
    with LLM(model_dir, device="cpu", max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


@pytest.fixture(scope="module")
def llm2(model_dir: Path) -> Iterator[LLM]:
    with LLM(model_dir, tensor_parallel_size=2, device="cpu", max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


@pytest.fixture(params=[1, 2], ids=["tp1", "tp2"])
def served(request: pytest.FixtureRequest) -> tuple[Server, LLM]:
    """(server, reference LLM) at one TP size."""
    tp = request.param
    return request.getfixturevalue(f"server{tp}"), request.getfixturevalue(f"llm{tp}")


def greedy(max_tokens: int = 16, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


# ----------------------------------------------------------------------------------------- outputs
def test_completions_match_generate(served: tuple[Server, LLM]) -> None:
    server, llm = served
    client = server.client()
    refs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    tok = llm.get_tokenizer()
    for prompt, ref in zip(PROMPTS, refs, strict=True):
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
        [choice] = out.choices
        assert choice.text == ref.outputs[0].text and choice.finish_reason == ref.outputs[0].finish_reason
        assert out.usage is not None and out.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert out.usage.prompt_tokens == len(tok(prompt)["input_ids"]) and out.model == NAME
        assert out.object == "text_completion" and out.id.startswith("cmpl-")
        chunks = list(client.completions.create(
            model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True},
        ))  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
        assert chunks[-2].choices[0].finish_reason == ref.outputs[0].finish_reason
        assert not chunks[-1].choices and chunks[-1].usage is not None
        streamed_usage = chunks[-1].usage
        for field_name in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert getattr(streamed_usage, field_name) == getattr(out.usage, field_name)
        assert all(c.usage is None for c in chunks[:-1])


def test_completions_batch_n_seed_and_stop(served: tuple[Server, LLM]) -> None:
    """Several prompts with n samples each (choice i * n + j), seeded sampling, a stop string."""
    server, llm = served
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, n=2, max_tokens=12, stop=["e "])
    refs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    want = [(c.text, c.finish_reason) for r in refs for c in r.outputs]
    kwargs: dict[str, Any] = dict(model=NAME, prompt=PROMPTS[:2], max_tokens=12, temperature=0.9, top_p=0.9,
                                  seed=1234, n=2, stop=["e "])  # fmt: skip
    out = server.client().completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [(c.text, c.finish_reason) for c in out.choices] == want
    texts = [""] * 4
    reasons: list[str | None] = [None] * 4
    for chunk in server.client().completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert list(zip(texts, reasons, strict=True)) == want


def test_logit_bias_and_allowed_token_ids(served: tuple[Server, LLM]) -> None:
    """OpenAI's logit_bias (token ids as JSON keys), vLLM's allowed_token_ids and bad_words give what
    LLM.generate gives with the same SamplingParams fields, in completions and chat; bad ones are 400s naming
    the field."""
    server, llm = served
    client = server.client()
    bias = {5: 4.0, 17: -100.0, 40: 2.5, 41: 2.5, 99: 1.0}
    allowed = [*range(30, 60), 5, 99]
    want = llm.generate(PROMPTS[0], greedy(12, logit_bias=bias, allowed_token_ids=allowed), use_tqdm=False)
    plain = llm.generate(PROMPTS[0], greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    assert want[0].outputs[0].token_ids != plain, "the biases changed nothing"
    extra = {"allowed_token_ids": allowed}
    # Past [-100, 100] a bias is clamped, as vLLM's server does: -1e9 is -100 (a client's way to ban a token).
    openai_bias = {str(t): -1e9 if v == -100.0 else v for t, v in bias.items()}
    out = client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, logit_bias=openai_bias, extra_body=extra
    )  # fmt: skip
    assert out.choices[0].text == want[0].outputs[0].text
    ref = llm.chat(MESSAGES, greedy(8, logit_bias=bias), use_tqdm=False)[0].outputs[0]
    chat = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=8, temperature=0, logit_bias=openai_bias
    )  # fmt: skip
    assert chat.choices[0].message.content == ref.text
    # Clamped, not just taken: with two tokens at +100 the model's own logits pick between them, so a bias
    # of 1e9 on the one it does not pick must not win.
    tied = llm.generate(PROMPTS[0], greedy(1, logit_bias={40: 100.0, 41: 100.0}), use_tqdm=False)
    winner = tied[0].outputs[0].token_ids[0]
    loser = 81 - winner
    assert winner in (40, 41)
    clamped = client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=1, temperature=0,
        logit_bias={str(loser): 1e9, str(winner): 100},
    )  # fmt: skip
    assert clamped.choices[0].text == tied[0].outputs[0].text
    # vLLM's bad_words: the words of the plain output, banned.
    words = [w for w in llm.get_tokenizer().decode(plain).split() if w.strip()][:3]
    want_banned = llm.generate(PROMPTS[0], greedy(12, bad_words=words), use_tqdm=False)[0].outputs[0]
    assert words and want_banned.token_ids != plain, "the bad words changed nothing"
    banned = client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, extra_body={"bad_words": words}
    )  # fmt: skip
    assert banned.choices[0].text == want_banned.text
    url = f"{server.url}/v1/completions"
    for body, fragment in (
        ({"bad_words": [""]}, "bad_words must be a list of words"),
        ({"bad_words": "word"}, "bad_words"),
        ({"logit_bias": {"five": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"+5": 1.0}}, "logit_bias keys must be token ids, got '+5'"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias keys must be token ids, got '-1'"),
        ({"logit_bias": {"9" * 5000: 1.0}}, "logit_bias keys must be token ids, got '999"),  # int() refuses
        ({"logit_bias": {"99999": 1.0}}, "logit_bias token id 99999 is outside the vocabulary"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
        ({"allowed_token_ids": [5, 99999]}, "allowed token id 99999 is outside the vocabulary"),
    ):
        error = _error(
            httpx.post(url, json={"prompt": "hi", "max_tokens": 2, **body}, headers=server.headers()), 400
        )
        assert fragment in error["message"], (body, error)
    nan = b'{"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": NaN}}'  # pydantic's parser reads NaN
    headers = {**server.headers(), "Content-Type": "application/json"}
    error = _error(httpx.post(url, content=nan, headers=headers), 400)
    assert "logit_bias must map token ids" in error["message"], error


def test_skip_special_tokens_false_keeps_their_text(server1: Server, llm1: LLM) -> None:
    """vLLM's skip_special_tokens=false: the special tokens of the output (forced by allowed_token_ids) stay
    in its text, as LLM.generate gives it, streamed or not; logprobs' text offsets count their text."""
    client = server1.client()
    tok = llm1.get_tokenizer()
    bos = tok.bos_token_id
    allowed = [bos, 57, 201, 33]
    for bias in (0.0, 1.0, 2.0, 3.0, 4.0, 6.0):  # the first that mixes special tokens with others
        params = greedy(16, allowed_token_ids=allowed, logit_bias={bos: bias}, skip_special_tokens=False,
                        ignore_eos=True)  # fmt: skip
        ref = llm1.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
        if bos in ref.token_ids and set(ref.token_ids) - {bos}:
            break
    assert bos in ref.token_ids and set(ref.token_ids) - {bos}, ref.token_ids
    assert ref.text == tok.decode(ref.token_ids, skip_special_tokens=False)
    bos_text = tok.decode([bos], skip_special_tokens=False)
    extra = {"allowed_token_ids": allowed, "skip_special_tokens": False, "ignore_eos": True}
    biases = {str(bos): bias}
    kwargs: dict[str, Any] = dict(
        model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0, extra_body=extra, logit_bias=biases
    )
    out = client.completions.create(logprobs=1, **kwargs)
    assert out.choices[0].text == ref.text
    offsets = out.choices[0].logprobs.text_offset  # type: ignore[union-attr]
    starts = [o - offsets[0] for o, t in zip(offsets, ref.token_ids, strict=True) if t == bos]
    assert starts and all(ref.text[i : i + len(bos_text)] == bos_text for i in starts), (starts, ref.text)
    chunks = client.completions.create(stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    plain = client.completions.create(**{**kwargs, "extra_body": {**extra, "skip_special_tokens": True}})
    assert plain.choices[0].text == tok.decode(ref.token_ids, skip_special_tokens=True) != ref.text


def test_chat_matches_llm_chat(served: tuple[Server, LLM]) -> None:
    server, llm = served
    client = server.client()
    [ref] = llm.chat(MESSAGES, greedy(20), use_tqdm=False)
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20, temperature=0)  # type: ignore[arg-type]
    [choice] = out.choices
    assert choice.message.role == "assistant" and choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason and out.object == "chat.completion"
    assert out.usage is not None and out.usage.prompt_tokens == len(ref.prompt_token_ids)
    chunks = list(client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_completion_tokens=20, temperature=0, stream=True,  # type: ignore[arg-type]
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == ref.outputs[0].finish_reason
    # chat_template_kwargs (vLLM's extension) as LLM.chat takes them.
    variables = {"greeting": "Bonjour"}
    [ref] = llm.chat(MESSAGES, greedy(20), chat_template_kwargs=variables, use_tqdm=False)
    out = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=20, temperature=0,  # type: ignore[arg-type]
        extra_body={"chat_template_kwargs": variables},
    )  # fmt: skip
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage is not None and out.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_template_and_tokenizer_flags_serve_a_model_without_them(
    make_checkpoint: Callable[..., Path], llm1: LLM, tmp_path: Path
) -> None:
    """--tokenizer gives a checkpoint folder without a tokenizer one, and --chat-template gives that
    tokenizer, which has no template, one: the same weights serve chat as llm1 (whose tokenizer carries
    TEMPLATE) chats."""
    from test_chat_and_api import without_tokenizer

    tokenizer = make_checkpoint(seed=6)
    assert not getattr(transformers.AutoTokenizer.from_pretrained(tokenizer), "chat_template", None)
    model = without_tokenizer(tokenizer, tmp_path / "weights")
    server = start_server(model, 1, tmp_path, "--tokenizer", str(tokenizer), "--chat-template", TEMPLATE)
    try:
        [ref] = llm1.chat(MESSAGES, greedy(12), use_tqdm=False)
        out = server.client().chat.completions.create(
            model=NAME,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,  # type: ignore[arg-type]
        )
        assert out.choices[0].message.content == ref.outputs[0].text
        assert out.usage is not None and out.usage.prompt_tokens == len(ref.prompt_token_ids)
    finally:
        assert server.stop() == 0, server.output()[-4000:]


def test_logprobs_in_openai_shapes(server1: Server, llm1: LLM) -> None:
    [ref] = llm1.generate(PROMPTS[0], greedy(8, logprobs=2), use_tqdm=False)
    want = [
        position[t].logprob
        for t, position in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs or [], strict=True)
    ]
    client = server1.client()
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs == pytest.approx(want)
    assert lp.tokens is not None and lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)  # the sampled token and the top 2
    streamed = []
    for chunk in client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2, stream=True
    ):
        streamed += chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else []  # type: ignore[operator]
    assert streamed == pytest.approx(want)

    [ref] = llm1.chat(MESSAGES, greedy(6, logprobs=3), use_tqdm=False)
    want = [
        position[t].logprob
        for t, position in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs or [], strict=True)
    ]
    out = client.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,  # type: ignore[arg-type]
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [e.logprob for e in content] == pytest.approx(want)
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.bytes
        if "\ufffd" in entry.token:  # part of a character: its own bytes (test_chat_logprob_bytes_...)
            assert entry.bytes != list(entry.token.encode()) and all(0 <= b < 256 for b in entry.bytes)
        else:
            assert entry.bytes == list(entry.token.encode())
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6


def test_echo_gives_the_prompt_and_its_logprobs(server1: Server, llm1: LLM) -> None:
    """echo (what lm-evaluation-harness asks for log-likelihoods): each choice's text begins with its
    prompt (a string as given, token ids decoded with their special tokens), and its logprobs with the
    prompt tokens' (None for the first), equal to LLM.generate's prompt_logprobs; plain, streamed, and
    for every sample of n."""
    [ref] = llm1.generate(PROMPTS[0], greedy(2, logprobs=1, prompt_logprobs=1), use_tqdm=False)
    ids, gen = ref.prompt_token_ids, ref.outputs[0]
    assert ref.prompt_logprobs is not None and gen.logprobs is not None
    want = [None, *(ref.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i)]
    want += [position[t].logprob for t, position in zip(gen.token_ids, gen.logprobs, strict=True)]
    client = server1.client()
    options: dict[str, Any] = dict(model=NAME, max_tokens=2, temperature=0, echo=True)
    out = client.completions.create(prompt=PROMPTS[0], logprobs=1, **options)
    [choice] = out.choices
    assert choice.text == PROMPTS[0] + gen.text
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want[1:]) and len(lp.token_logprobs) == len(ids) + 2
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(choice.text)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])  # the token itself and the top one
    assert out.usage is not None and out.usage.completion_tokens == 2

    text, streamed = "", []
    for chunk in client.completions.create(prompt=PROMPTS[0], logprobs=1, stream=True, **options):
        text += chunk.choices[0].text
        streamed += chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else []  # type: ignore[operator]
    assert text == choice.text and streamed[0] is None and streamed[1:] == pytest.approx(want[1:])

    # A prompt that spells a special token: each prompt token's offset is where its text is in the echo
    # (the BOS the tokenizer added is not in it: offset 0).
    for special in ("</s>", "<s>"):  # the second: the BOS both spelled and added by the tokenizer
        spelled = special + PROMPTS[0]
        lp = client.completions.create(prompt=spelled, logprobs=0, **options).choices[0].logprobs
        assert lp is not None and lp.tokens is not None and lp.text_offset is not None
        assert lp.tokens[:2] == ["<s>", special] and lp.text_offset[:2] == [0, 0]
        spans = zip(lp.tokens[1:-2], lp.text_offset[1:-2], strict=True)
        assert all(spelled[offset:].startswith(token) for token, offset in spans)

    # max_tokens 0: the prompt alone.
    prompt_only = {**options, "max_tokens": 0}
    for stream in (False, True):
        chunks = client.completions.create(prompt=PROMPTS[0], logprobs=1, stream=stream, **prompt_only)
        for chunk in chunks if stream else [chunks]:  # type: ignore[union-attr]
            [only] = chunk.choices  # type: ignore[union-attr]
            assert only.text == PROMPTS[0] and only.finish_reason == "length" and only.logprobs is not None
            assert only.logprobs.token_logprobs == pytest.approx(want[: len(ids)])
        assert stream or chunks.usage.completion_tokens == 0  # type: ignore[union-attr]

    # n samples: every choice shows its prompt's logprobs (plain: computed once, by the first sample).
    for stream in (False, True):
        chunks = client.completions.create(
            prompt=[PROMPTS[0], PROMPTS[1]], logprobs=1, n=2, seed=5, stream=stream,
            **{**options, "temperature": 0.8},
        )  # fmt: skip
        token_logprobs: dict[int, list[Any]] = {}
        for chunk in chunks if stream else [chunks]:  # type: ignore[union-attr]
            for c in chunk.choices:  # type: ignore[union-attr]
                token_logprobs.setdefault(c.index, []).extend(c.logprobs.token_logprobs or [])
        assert sorted(token_logprobs) == [0, 1, 2, 3]
        assert all(token_logprobs[i][: len(ids)] == pytest.approx(want[: len(ids)]) for i in (0, 1))
        assert token_logprobs[2][:2] == token_logprobs[3][:2] and token_logprobs[2][0] is None

    # Token ids echo as their text, special tokens included (as vLLM echoes them); without logprobs there
    # are none; every sample of n echoes.
    out = client.completions.create(prompt=ids, n=2, seed=3, **{**options, "temperature": 0.8})
    decoded = llm1.get_tokenizer().decode(ids, skip_special_tokens=False)
    assert decoded.startswith("<s>")
    assert [c.text[: len(decoded)] for c in out.choices] == [decoded, decoded]
    assert all(c.logprobs is None for c in out.choices)


def test_prompt_logprobs_extension(server1: Server, llm1: LLM) -> None:
    """vLLM's prompt_logprobs: per prompt position (the first null) the prompt token's logprob and the top
    ones, token ids as keys, equal to LLM.generate's; on every choice of completions (each its prompt's),
    at the top of a chat response; with echo and more logprobs, only as many as prompt_logprobs asks."""

    def expected(ref: Any, top: int) -> list[Any]:
        out: list[Any] = [None]
        for i, position in enumerate(ref.prompt_logprobs[1:], 1):
            token = ref.prompt_token_ids[i]
            kept = {t: lp for t, lp in position.items() if t == token or (lp.rank or 0) <= top}
            out.append({str(t): pytest.approx(lp.logprob) for t, lp in kept.items()})
        return out

    refs = llm1.generate(PROMPTS[:2], greedy(2, prompt_logprobs=2), use_tqdm=False)
    url = f"{server1.url}/v1/completions"
    body: dict[str, Any] = {"model": NAME, "prompt": PROMPTS[:2], "max_tokens": 2, "temperature": 0, "n": 2}
    body["prompt_logprobs"] = 2
    got = httpx.post(url, json=body, timeout=60).json()
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    for choice in got["choices"]:
        ref = refs[choice["index"] // 2]
        prompt_lps = choice["prompt_logprobs"]
        assert [p and {t: e["logprob"] for t, e in p.items()} for p in prompt_lps] == expected(ref, 2)
        assert all(e["decoded_token"] is not None for p in prompt_lps[1:] for e in p.values())
    body = {**body, "n": 1, "prompt_logprobs": 0, "echo": True, "logprobs": 3}
    first = httpx.post(url, json=body, timeout=60).json()["choices"][0]
    prompt_lps = first["prompt_logprobs"]
    assert [p and {t: e["logprob"] for t, e in p.items()} for p in prompt_lps] == expected(refs[0], 0)
    assert max(len(top) for top in first["logprobs"]["top_logprobs"][1:]) >= 3  # echo's own 3
    plain = httpx.post(url, json={**body, "prompt_logprobs": None}, timeout=60).json()
    assert "prompt_logprobs" not in plain["choices"][0]

    [ref] = llm1.chat(MESSAGES, greedy(2, prompt_logprobs=1), use_tqdm=False)
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    got = httpx.post(f"{server1.url}/v1/chat/completions", json=body, timeout=60).json()
    assert [p and {t: e["logprob"] for t, e in p.items()} for p in got["prompt_logprobs"]] == expected(ref, 1)

    # A stream takes prompt_logprobs 0 (vLLM's check refuses only a positive count) and sends none.
    prompts = {"completions": {"prompt": PROMPTS[0]}, "chat/completions": {"messages": MESSAGES}}
    for path, extra in prompts.items():
        texts = []
        for top in (None, 0):
            body = {"model": NAME, "max_tokens": 3, "temperature": 0, "stream": True, "prompt_logprobs": top}
            with httpx.stream("POST", f"{server1.url}/v1/{path}", json={**body, **extra}, timeout=60) as r:
                assert r.status_code == 200
                lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "[DONE]" and all("prompt_logprobs" not in line for line in lines)
            choices = [c for line in lines[:-1] for c in json.loads(line)["choices"]]
            texts.append("".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices))
        assert texts[0] == texts[1] and texts[0]


def test_32_concurrent_streaming_clients(server2: Server, llm2: LLM) -> None:
    prompts = [f"Client {i} asks about item {i * 7 % 13}" for i in range(32)]
    refs = llm2.generate(prompts, greedy(16), use_tqdm=False)

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
        text, reason = "", None
        stream = await client.completions.create(
            model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main() -> list[tuple[str, str | None]]:
        async with server2.async_client() as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    assert results == [(r.outputs[0].text, r.outputs[0].finish_reason) for r in refs]
    server2.wait_for_metric("num_requests_running", lambda v: v == 0)
    assert server2.metric("kv_cache_blocks_used") == 0


# ------------------------------------------------------------------------------------ disconnects
def test_client_disconnect_mid_stream_frees_blocks(server2: Server) -> None:
    """At TP=2 a step takes milliseconds, so 480 tokens take seconds: the client leaves long before."""
    server = server2
    aborted = server.metric("request_success_total", finished_reason="abort")
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 480, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    url = f"{server.url}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=server.headers(), timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # held: an iterator dropped early would close the connection
        for line in lines:
            if line.startswith("data: {"):
                break  # the first chunk: the request is running
        assert server.metric("num_requests_running") == 1 and server.metric("kv_cache_blocks_used") > 0
    # The connection is closed with hundreds of tokens to go: the server aborts the request.
    server.wait_for_metric("kv_cache_blocks_used", lambda v: v == 0)
    assert server.metric("num_requests_running") == 0
    assert server.metric("request_success_total", finished_reason="abort") == aborted + 1


def test_client_disconnect_without_streaming_frees_blocks(server2: Server) -> None:
    server = server2
    aborted = server.metric("request_success_total", finished_reason="abort")
    body = json.dumps({"model": NAME, "prompt": PROMPTS[2], "max_tokens": 480, "temperature": 0,
                       "ignore_eos": True}).encode()  # fmt: skip
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        server.wait_for_metric("num_requests_running", lambda v: v == 1)
    server.wait_for_metric("kv_cache_blocks_used", lambda v: v == 0)
    assert server.metric("request_success_total", finished_reason="abort") == aborted + 1


# ----------------------------------------------------------------------------------------- errors
def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_bad_requests_get_openai_400s(server1: Server) -> None:
    client = server1.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="hi", temperature=-1)
    assert info.value.status_code == 400 and "temperature" in info.value.message
    with pytest.raises(
        openai.BadRequestError, match=r"maximum context length is 512 tokens.*600 input tokens"
    ):
        client.completions.create(model=NAME, prompt=[5] * 600, max_tokens=4)
    with pytest.raises(
        openai.BadRequestError, match=r"'max_tokens' is too large: 1000.*\(1000 > 512 - \d+\)"
    ):
        client.completions.create(model=NAME, prompt="hi", max_tokens=1000)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi")
    url = f"{server1.url}/v1/completions"
    cases: list[tuple[dict[str, Any] | bytes, str]] = [
        (b"{not json", "not valid JSON"),
        # past what a number may hold (pydantic's parser): said so, where
        (b'{"prompt": "hi", "temperature": 1' + b"0" * 5000 + b"}", "number out of range at line 1"),
        ({"model": NAME}, "prompt"),
        ({"model": NAME, "prompt": 3}, "prompt: 3 is none of the types"),
        ({"model": NAME, "prompt": "hi", "n": 0}, "n must be"),
        ({"model": NAME, "prompt": "hi", "logprobs": 50}, "logprobs=50 exceeds"),
        ({"model": NAME, "prompt": "hi", "stop": [""]}, "stop must be"),
        ({"model": NAME, "prompt": "hi", "stop": ""}, "stop must be"),  # as [""], not dropped
        ({"model": NAME, "prompt": [1, 2, 99999]}, "outside the vocabulary"),
        # vLLM extensions this server does not serve are refused, not silently ignored.
        ({"model": NAME, "prompt": "hi", "prompt_logprobs": 50}, "prompt_logprobs=50 exceeds"),
        ({"model": NAME, "prompt": "hi", "prompt_logprobs": 1, "stream": True}, "not available with stream"),
        ({"model": NAME, "prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs must be"),
        ({"model": NAME, "prompt": "hi", "prompt_logprobs": -1, "echo": True, "logprobs": 3}, "must be"),
        ({"model": NAME, "prompt": "hi", "echo": True, "max_tokens": 0, "min_tokens": 2}, "must be 0"),
        # Structured outputs that cannot be compiled, or more than one constraint.
        ({"model": NAME, "prompt": "hi", "guided_regex": "(ab"}, "the regex is not valid"),
        ({"model": NAME, "prompt": "hi", "structured_outputs": {"json": {}, "regex": "a"}}, "exactly one of"),
        ({"model": NAME, "prompt": "hi", "structured_outputs": {"jsn": {}}}, "unknown fields ['jsn']"),
        (
            {"model": NAME, "prompt": "hi", "guided_choice": ["b"], "structured_outputs": {"regex": "a"}},
            "give one output constraint",
        ),
        ({"model": NAME, "prompt": "hi", "use_beam_search": True}, "use_beam_search is not"),
        ({"model": NAME, "prompt": ""}, "prompt is empty"),
        # JSON types are taken as they are: true is no token id or count, "3" no number.
        ({"model": NAME, "prompt": [True, False]}, "prompt"),
        ({"model": NAME, "prompt": "hi", "n": True}, "n"),
        ({"model": NAME, "prompt": "hi", "max_tokens": "3"}, "max_tokens"),
        ({"model": NAME, "prompt": "hi", "stream_options": {"include_usage": True}}, "with stream=true"),
    ]
    for body, message in cases:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        error = _error(httpx.post(url, content=content, headers={"Content-Type": "application/json"}), 400)
        assert message in error["message"] and error["type"] == "invalid_request_error", (body, error)
    chat = f"{server1.url}/v1/chat/completions"
    error = _error(httpx.post(chat, json={"model": NAME, "messages": []}), 400)
    assert "messages is empty" in error["message"]
    error = _error(httpx.post(chat, json={"messages": MESSAGES, "logprobs": False, "top_logprobs": 2}), 400)
    assert error["param"] == "top_logprobs"
    # top_logprobs 0 is vLLM's default for the field, so it is no request for logprobs.
    fields = {"max_tokens": 2, "logprobs": False, "top_logprobs": 0}
    reply = httpx.post(chat, json={"messages": MESSAGES, **fields})
    assert reply.status_code == 200 and reply.json()["choices"][0]["logprobs"] is None, reply.text
    # A null max_tokens in a completion is the rest of the context, as vLLM's (left out, it is 16).
    limit = httpx.get(f"{server1.url}/v1/models").json()["data"][0]["max_model_len"]
    body = {"prompt": "hi", "max_tokens": None, "ignore_eos": True, "temperature": 0}
    reply = httpx.post(url, json=body)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["completion_tokens"] == limit - usage["prompt_tokens"], (limit, usage)
    body.pop("max_tokens")
    assert httpx.post(url, json=body).json()["usage"]["completion_tokens"] == 16
    # A whole number written as a float is taken where a count is, as vLLM's lax parsing takes it.
    whole = httpx.post(url, json={"prompt": "hi", "max_tokens": 3.0, "n": 2.0, "seed": 7.0, "temperature": 1})
    ints = httpx.post(url, json={"prompt": "hi", "max_tokens": 3, "n": 2, "seed": 7, "temperature": 1})
    assert whole.status_code == 200, whole.text
    assert [c["text"] for c in whole.json()["choices"]] == [c["text"] for c in ints.json()["choices"]]
    for fields in ({"max_tokens": 3.5}, {"n": True}, {"seed": "7"}, {"prompt": [5.0, 6.0]}):
        error = _error(httpx.post(url, json={"prompt": "hi", **fields}), 400)
        assert error["param"] == next(iter(fields)) and error["code"] == 400, (fields, error)
    # Errors name the request's own fields, and a limit the server sets by its own flag.
    for fields, param, fragment in (
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs=21 exceeds this server's"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "top_logprobs must be"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be"),
    ):
        error = _error(httpx.post(chat, json={"messages": MESSAGES, **fields}), 400)
        assert (error["param"], fragment in error["message"]) == (param, True), (fields, error)
    assert "--max-logprobs" in _error(httpx.post(url, json={"prompt": "hi", "logprobs": 21}), 400)["message"]
    error = _error(httpx.post(chat, json={"messages": MESSAGES, "tool_choice": "required"}), 400)
    assert error["param"] == "tool_choice" and "tool_choice needs tools" in error["message"]
    for choice in ("none", "auto", None):  # no tools: the model answers in text either way
        ok = httpx.post(chat, json={"messages": MESSAGES, "tool_choice": choice, "max_tokens": 2, "n": None})
        assert ok.status_code == 200, (choice, ok.text)
    reserved = {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}
    error = _error(httpx.post(chat, json=reserved), 400)
    assert error["param"] == "chat_template_kwargs" and "may not set tokenize" in error["message"]
    error = _error(httpx.post(url, json={"prompt": [5] * 600, "max_tokens": 4}), 400)
    assert error["param"] == "prompt"
    error = _error(httpx.post(url, json={"prompt": [1, 2, 99999]}), 400)  # the engine's own prompt check
    assert error["param"] == "prompt" and "outside the vocabulary" in error["message"]
    assert _error(httpx.get(f"{server1.url}/v1/nothing-here"), 404)["code"] == 404  # the status, as vLLM's
    # An empty stream_options without stream is no request for anything (as vLLM takes it).
    assert httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "stream_options": {}}).status_code == 200
    # The server is unharmed.
    assert (
        client.completions.create(model=NAME, prompt="hi", max_tokens=2).choices[0].finish_reason == "length"
    )


def test_api_key_is_enforced(server2: Server) -> None:
    bad = openai.OpenAI(base_url=f"{server2.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=NAME, prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    error = _error(httpx.post(f"{server2.url}/v1/chat/completions", json={"messages": MESSAGES}), 401)
    assert error["code"] == "invalid_api_key"
    models = server2.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    # Health and metrics stay open to probes and scrapers.
    assert httpx.get(f"{server2.url}/health").status_code == 200
    assert httpx.get(f"{server2.url}/metrics").status_code == 200


def test_usage_reports_cached_prompt_tokens(server1: Server) -> None:
    """A prompt sent again finds its full blocks in the prefix cache (all but its last token's block):
    usage.prompt_tokens_details.cached_tokens says how many, and the cache's counters move by as much."""
    prompt = [5 + (i * 37) % 290 for i in range(45)]  # token ids: 45 tokens, 2 full blocks of 16 + 13
    queries, hits = server1.metric("prefix_cache_queries_total"), server1.metric("prefix_cache_hits_total")
    client = server1.client()
    cached = []
    for _ in range(2):
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
        assert out.usage is not None and out.usage.prompt_tokens == 45
        assert out.usage.prompt_tokens_details is not None
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    assert cached == [0, 32]
    assert server1.metric("prefix_cache_queries_total") == queries + 90
    assert server1.metric("prefix_cache_hits_total") == hits + 32


def test_models_health_and_metrics(server1: Server) -> None:
    models = httpx.get(f"{server1.url}/v1/models").json()
    assert models["data"][0]["id"] == NAME and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{server1.url}/health").status_code == 200
    server1.client().completions.create(model=NAME, prompt="hi", max_tokens=3)
    text = httpx.get(f"{server1.url}/metrics").text
    for name in (
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_cache_blocks_used",
        "prompt_tokens_total", "generation_tokens_total", "request_success_total",
        "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_count", "prefix_cache_queries_total", "prefix_cache_hits_total",
        "request_queue_time_seconds_bucket", "request_prefill_time_seconds_bucket",
    ):  # fmt: skip
        assert f"tp_runtime:{name}{{" in text, name
    # TTFT's engine-side parts lie within it (TTFT also holds the HTTP path before the engine and after
    # the first token): the prefill time once per first token, the queue time once per scheduled choice
    # (also one aborted before its first token).
    counts = {m: server1.metric(f"{m}_seconds_count") for m in ("time_to_first_token", "request_queue_time",
                                                               "request_prefill_time")}  # fmt: skip
    assert counts["request_prefill_time"] == counts["time_to_first_token"] >= 1, counts
    assert counts["request_queue_time"] >= counts["time_to_first_token"], counts
    prefill = server1.metric("request_prefill_time_seconds_sum")
    assert 0 < prefill <= server1.metric("time_to_first_token_seconds_sum")
    assert server1.metric("generation_tokens_total") >= 3
    assert server1.metric("request_success_total", finished_reason="length") >= 1


# --------------------------------------------------------------------------------- process life
def _stream_in_thread(server: Server, max_tokens: int) -> tuple[threading.Event, list[Any], threading.Thread]:
    """Stream a completion in a thread; the event is set at its first chunk. The list receives the chunks'
    (text, finish_reason), then whatever ended the stream ("[DONE]" or the exception)."""
    first = threading.Event()
    got: list[Any] = []

    def read() -> None:
        body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        got.append("[DONE]")
                    elif line.startswith("data: "):
                        choice = json.loads(line[6:])["choices"][0]
                        got.append((choice["text"], choice["finish_reason"]))
                        first.set()
        except Exception as exc:
            got.append(exc)
        first.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return first, got, thread


def _wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"workers {pids} outlived the server"
        time.sleep(0.05)


def _wait_refused(server: Server) -> None:
    """Until the server's listening socket refuses new connections (it closes once a signal is taken)."""
    host, port = server.url.removeprefix("http://").split(":")
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except ConnectionRefusedError:
            return
        assert time.monotonic() < deadline, "the server still accepts connections after the signal"
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_signal_drains_and_leaves_no_process(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM or Ctrl-C: new connections are refused; a request that can finish within the grace period
    does, one that cannot ends with finish_reason "abort" (its client still gets the last chunk and
    [DONE]); then the workers stop and the server exits with status 0. (A step of this model at TP=2 on a
    CPU takes milliseconds: 20 tokens take well under the 2 s grace, 2000 well over.)"""
    server = start_server("tiny-llama-tp", 2, tmp_path, "--shutdown-grace", "2", "--max-model-len", "2048")
    try:
        first_short, short, short_thread = _stream_in_thread(server, 20)
        first_long, long, long_thread = _stream_in_thread(server, 2000)
        assert first_short.wait(60) and first_long.wait(60)
        server.proc.send_signal(sig)
        _wait_refused(server)  # the listening socket closes: new clients are refused
        assert server.proc.wait(timeout=90) == 0, server.output()[-4000:]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    short_thread.join(30)
    long_thread.join(30)
    assert short[-1] == "[DONE]" and short[-2][1] == "length", short[-3:]
    assert len("".join(text for text, _ in short[:-1])) > 0
    assert long[-1] == "[DONE]" and long[-2][1] == "abort", long[-3:]
    assert all(r is None for _, r in long[:-2]) and len(long) < 2000, long[-3:]
    output = server.output()
    assert "timeout graceful shutdown exceeded" not in output and "shut down" in output, output[-4000:]
    assert "Traceback" not in output and "interrupted" not in output, output[-4000:]
    _wait_gone(server.worker_pids)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_second_signal_aborts_the_requests_at_once(tmp_path: Path, sig: signal.Signals) -> None:
    """The first signal gives the requests in flight the grace period; a second one ends them at once with
    finish_reason "abort", and the server exits with status 0. A second Ctrl-C had made uvicorn cancel
    them mid-response: the client got a 500 and the log two tracebacks."""
    server = start_server("tiny-llama-tp", 2, tmp_path, "--shutdown-grace", "120", "--max-model-len", "2048")
    try:
        first_long, long, long_thread = _stream_in_thread(server, 2000)
        assert first_long.wait(60)
        server.proc.send_signal(sig)
        _wait_refused(server)  # the first signal is taken: the listening socket closes
        server.proc.send_signal(sig)
        assert server.proc.wait(timeout=60) == 0, server.output()[-4000:]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    long_thread.join(30)
    assert long[-1] == "[DONE]" and long[-2][1] == "abort", long[-3:]
    output = server.output()
    assert "Traceback" not in output and "CancelledError" not in output, output[-4000:]
    _wait_gone(server.worker_pids)


def test_sigterm_while_loading_stops_the_workers(tmp_path: Path) -> None:
    """A signal while the model loads: the workers started so far are shut down and the server exits with
    status 0, never ready. The load is held (in the worker start-up wait) until the signal arrives."""
    script = """
import sys, threading
from tp_runtime.executor.multiproc import _SpawnedWorkers
from tp_runtime.server import cli

original = _SpawnedWorkers.wait_ready

def wait_ready(self, *args, **kwargs):
    print("loading, workers", *self.pids(), flush=True)
    threading.Event().wait(120)  # the test's SIGTERM interrupts this
    return original(self, *args, **kwargs)

_SpawnedWorkers.wait_ready = wait_ready
cli.main(["--model", "tiny-llama-tp", "-tp", "2", "--device", "cpu", "--port", "0", "--max-model-len",
          "256", "--log-level", "warning"])
"""
    log = tmp_path / "loading.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-c", script], cwd=REPO, stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        while not (match := re.search(r"loading, workers ([\d ]+)\n", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        workers = [int(pid) for pid in match.group(1).split()]
        assert len(workers) == 2 and all(_alive(pid) for pid in workers)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    output = log.read_text()
    assert "ready on" not in output and "shut down" in output, output[-4000:]
    _wait_gone(workers)


def test_dead_engine_fails_health_and_answers_500(model_dir: Path, tmp_path: Path) -> None:
    """A worker killed while the server is idle: /health reports it without any request being sent (the
    engine thread checks its workers while idle), in one line; later requests get the same 500."""
    server = start_server(model_dir, 2, tmp_path)
    try:
        assert server.client().completions.create(model=NAME, prompt="hi", max_tokens=2).choices
        os.kill(server.worker_pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (health := httpx.get(f"{server.url}/health", timeout=30)).status_code == 200:
            assert time.monotonic() < deadline, "/health stayed 200 after a worker died"
            time.sleep(0.05)
        error = _error(health, 500)
        assert "WorkerDiedError: worker rank 1 died" in error["message"] and "\n" not in error["message"]
        with pytest.raises(openai.InternalServerError) as info:
            server.client().completions.create(model=NAME, prompt="hi", max_tokens=2)
        assert info.value.status_code == 500 and "WorkerDiedError" in info.value.message
        error = _error(httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}), 500)
        assert error["type"] == "server_error"
        assert server.stop() == 0, server.output()[-4000:]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert not any(_alive(pid) for pid in server.worker_pids)


# ---------------------------------------------------------------------------- in process, scripted
@pytest.fixture(scope="module")
def scripted_config(make_checkpoint: Callable[..., Path]) -> Any:
    return build_model_config(make_checkpoint(seed=3), max_model_len=128)


@pytest.fixture(scope="module")
def byte_tokenizer() -> Any:
    """Byte-level: multi-byte characters are split across tokens."""
    return build_preset_tokenizer(VOCAB)


class InProcess:
    """`build_app` over an AsyncLLMEngine stepping a ScriptedExecutor; `client()` talks to the app
    directly (httpx's ASGI transport: a response arrives whole)."""

    def __init__(
        self, config: Any, tokenizer: Any, executor: ScriptedExecutor, front_tokenizer: Any = None,
        **options: Any,
    ) -> None:  # fmt: skip
        self.executor = executor
        self.engine = AsyncLLMEngine(make_engine(config, tokenizer, executor))
        self.app, self.begin_drain = build_app(
            self.engine, front_tokenizer or tokenizer, model_name=NAME, **options
        )

    def __enter__(self) -> InProcess:
        self.engine.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.executor.gate is not None:
            self.executor.gate.release(1000)
        self.engine.shutdown()

    def client(self, **headers: str) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=self.app)
        return httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers, timeout=60)


def _events(response: httpx.Response) -> list[Any]:
    """An event stream's events: the JSON objects, then "[DONE]"."""
    assert response.status_code == 200, response.text
    data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def test_worker_traceback_stays_in_the_server_log(
    scripted_config: Any, byte_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's exception kills the engine: streams, requests in flight, /health and later requests all
    get one line naming the rank and the exception's class; its traceback is logged once, on the server."""
    executor = ScriptedExecutor(closed_form)
    executor.fail_at_step = 3
    executor.fail_after_requests = 2  # both requests are in before the engine dies
    executor.failure = WorkerError(
        1, 'Traceback (most recent call last):\n  File "/srv/secret/worker.py", line 7, in step\n'
        "RuntimeError: CUDA error: secret detail\n",
    )  # fmt: skip
    expected = "the engine failed: WorkerError: worker rank 1 failed (RuntimeError); see the server log"
    request = {"prompt": "Hello", "max_tokens": 50, "ignore_eos": True}

    async def main(served: InProcess) -> None:
        async with served.client() as client:
            streamed, plain = await asyncio.gather(
                client.post("/v1/completions", json={**request, "stream": True}),
                client.post("/v1/completions", json=request),
            )
            events = _events(streamed)
            assert events[-1] == "[DONE]" and events[-2]["error"]["message"] == expected, events[-2:]
            assert _error(plain, 500)["message"] == expected
            assert _error(await client.get("/health"), 500)["message"] == expected
            assert _error(await client.post("/ping"), 500)["message"] == expected  # vLLM's /health
            later = await client.post("/v1/chat/completions", json={"messages": MESSAGES})
            assert _error(later, 500)["message"] == expected

    caplog.set_level(logging.ERROR)
    with InProcess(scripted_config, byte_tokenizer, executor) as served:
        added = []
        add = served.engine.add

        def counting_add(*args: Any, **kwargs: Any) -> Any:
            stream = add(*args, **kwargs)
            added.append(stream)
            return stream

        served.engine.add = counting_add  # type: ignore[method-assign]
        # Neither request may finish (50 tokens take a few ms) before the other one is in.
        executor.hold_until = lambda: len(added) == 2
        asyncio.run(main(served))
    logged = [r for r in caplog.records if "secret detail" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in caplog.records]


def test_stream_abandoned_before_its_first_event_is_aborted(
    scripted_config: Any, byte_tokenizer: Any
) -> None:
    """The client is gone before the response starts: Starlette cancels the response before the event
    generator ever runs, so only the response itself can abort the engine request. Steps advance only as
    the test releases them, so the request cannot finish by itself first (it asks for 100 tokens)."""
    gate = threading.Semaphore(0)
    executor = ScriptedExecutor(closed_form, gate)
    body = json.dumps({"prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "stream": True}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.start":
            await asyncio.Event().wait()  # the connection is gone: nothing goes out

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000), "server": ("test", 80),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }  # fmt: skip
    with InProcess(scripted_config, byte_tokenizer, executor) as served:
        asyncio.run(served.app(scope, receive, send))
        assert all(m["type"] != "http.response.body" for m in sent), sent
        deadline = time.monotonic() + 60
        while not dict(served.engine.stats.finished):  # one step at a time until the request ends
            assert time.monotonic() < deadline, "the request never ended"
            gate.release()
            time.sleep(0.01)
        assert dict(served.engine.stats.finished) == {"abort": 1}
        assert served.engine.stats.kv_blocks_used == 0


class _HeldTokenizer:
    """The front end's tokenizer, held inside its encode of one prompt until the test lets it go."""

    def __init__(self, inner: Any, held: str) -> None:
        self.inner, self.held = inner, held
        self.entered, self.go = threading.Event(), threading.Event()
        self.timed_out = False

    def __call__(self, text: str, **kwargs: Any) -> Any:
        if text == self.held:
            self.entered.set()
            self.timed_out = not self.go.wait(20)
        return self.inner(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_tokenizing_does_not_block_the_event_loop(scripted_config: Any, byte_tokenizer: Any) -> None:
    """While one request's prompt is being tokenized, /health and other requests are answered."""
    front = _HeldTokenizer(byte_tokenizer, "a huge prompt")
    executor = ScriptedExecutor(closed_form)

    async def main(served: InProcess) -> None:
        async with served.client() as client:
            held = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a huge prompt"}))
            assert await asyncio.to_thread(front.entered.wait, 60)
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/ping")).status_code == (await client.post("/ping")).status_code == 200
            other = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
            assert other.status_code == 200 and other.json()["choices"][0]["finish_reason"] == "length"
            assert not front.go.is_set()
            front.go.set()
            assert (await held).status_code == 200

    with InProcess(scripted_config, byte_tokenizer, executor, front_tokenizer=front) as served:
        asyncio.run(main(served))
    assert not front.timed_out, "the held tokenizer blocked the event loop"


def test_grammar_compiles_do_not_hold_up_other_requests(scripted_config: Any, byte_tokenizer: Any) -> None:
    """A schema can compile for minutes (a large enum): more such requests than the threads that parse
    every request leave those threads free, so a request without a grammar is answered meanwhile; each held
    compile's error then reaches its own request as a 400."""
    executor = ScriptedExecutor(closed_form)
    entered, go = threading.Semaphore(0), threading.Event()

    def held_compile(spec: Any) -> Any:
        entered.release()
        go.wait(60)
        raise InvalidRequestError("this schema took too long", "choice")

    async def main(served: InProcess) -> None:
        # Fewer parsing threads than held compiles, whatever the machine's cores.
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(4))
        served.engine.engine.grammars.compile = held_compile  # type: ignore[method-assign]
        constrained = {"prompt": "Hi", "max_tokens": 3, "structured_outputs": {"choice": ["yes", "no"]}}
        async with served.client() as client:
            held = [asyncio.create_task(client.post("/v1/completions", json=constrained)) for _ in range(8)]
            assert await asyncio.to_thread(entered.acquire, True, 60)
            other = await asyncio.wait_for(
                client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}), 60
            )
            assert other.status_code == 200 and other.json()["choices"][0]["finish_reason"] == "length"
            assert not go.is_set()
            go.set()
            for response in await asyncio.gather(*held):
                assert response.status_code == 400 and "took too long" in response.text, response.text

    with InProcess(scripted_config, byte_tokenizer, executor) as served:
        asyncio.run(main(served))


def test_grammar_compiles_outlive_a_lifespan(scripted_config: Any, byte_tokenizer: Any) -> None:
    """The app's grammar threads go with its lifespan, and the next request makes new ones (an app may
    run its lifespan more than once)."""
    executor = ScriptedExecutor(closed_form)

    def refuse(spec: Any) -> Any:
        raise InvalidRequestError("refused by the test", "choice")

    async def main(served: InProcess) -> None:
        served.engine.engine.grammars.compile = refuse  # type: ignore[method-assign]
        constrained = {"prompt": "Hi", "max_tokens": 3, "structured_outputs": {"choice": ["yes", "no"]}}
        async with served.client() as client:
            for _ in range(2):
                async with served.app.router.lifespan_context(served.app):
                    response = await client.post("/v1/completions", json=constrained)
                    assert response.status_code == 400 and "refused by the test" in response.text
            response = await client.post("/v1/completions", json=constrained)
            assert response.status_code == 400 and "refused by the test" in response.text, response.text

    with InProcess(scripted_config, byte_tokenizer, executor) as served:
        asyncio.run(main(served))


def test_key_is_checked_before_the_body_and_the_body_is_capped(
    scripted_config: Any, byte_tokenizer: Any
) -> None:
    executor = ScriptedExecutor(closed_form)

    async def main(served: InProcess) -> None:
        async with served.client() as client:
            bad_json = {"content": b"{not json", "headers": {"Content-Type": "application/json"}}
            error = _error(await client.post("/v1/completions", **bad_json), 401)  # type: ignore[arg-type]
            assert error["code"] == "invalid_api_key"
            json_type = {"Content-Type": "application/json"}
            big = {"content": b"x" * 5000, "headers": json_type}
            error = _error(await client.post("/v1/chat/completions", **big), 401)  # type: ignore[arg-type]
        async with served.client(Authorization="Bearer k") as client:
            error = _error(await client.post("/v1/completions", **bad_json), 400)  # type: ignore[arg-type]
            assert "not valid JSON" in error["message"]
            huge = {"prompt": "x" * 5000, "max_tokens": 2}
            error = _error(await client.post("/v1/completions", json=huge), 413)
            assert "larger than this server takes (4096 bytes)" in error["message"] and error["code"] == 413

            async def chunks() -> Any:  # no Content-Length: counted as it arrives
                for _ in range(10):
                    yield b"x" * 1000

            error = _error(await client.post("/v1/completions", content=chunks(), headers=json_type), 413)
            ok = await client.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 2})
            assert ok.status_code == 200, ok.text

    with InProcess(scripted_config, byte_tokenizer, executor, api_key="k", max_body_bytes=4096) as served:
        asyncio.run(main(served))


def test_stop_strings_are_bounded(scripted_config: Any, byte_tokenizer: Any) -> None:
    """At most protocol.MAX_STOP_STRINGS stop strings a request (each is looked for in every token's text
    on the engine's thread): one more is a 400 naming `stop`; that many are served."""
    from tp_runtime.server.protocol import MAX_STOP_STRINGS

    executor = ScriptedExecutor(closed_form)
    stops = [f"zz{i}" for i in range(MAX_STOP_STRINGS)]

    async def main(served: InProcess) -> None:
        async with served.client() as client:
            request = {"prompt": "x", "max_tokens": 2}
            over = {**request, "stop": [*stops, "zzz"]}
            error = _error(await client.post("/v1/completions", json=over), 400)
            assert error["param"] == "stop" and f"at most {MAX_STOP_STRINGS}" in error["message"], error
            ok = await client.post("/v1/completions", json={**request, "stop": stops})
            assert ok.status_code == 200, ok.text

    with InProcess(scripted_config, byte_tokenizer, executor) as served:
        asyncio.run(main(served))


def test_a_non_ascii_api_key_is_matched_as_clients_send_it(scripted_config: Any, byte_tokenizer: Any) -> None:
    """A key of non-ASCII characters, sent as clients send headers (UTF-8 bytes), is accepted; the same
    characters sent as latin-1 bytes are not the key (it failed the UTF-8 client and let the latin-1 one
    in)."""
    request = {"prompt": "x", "max_tokens": 2}

    async def main(served: InProcess, key: str) -> None:
        sent = b"Bearer " + key.encode()
        async with served.client(Authorization=sent) as client:  # type: ignore[arg-type]
            ok = await client.post("/v1/completions", json=request)
            assert ok.status_code == 200, ok.text
        async with served.client(Authorization=b"Bearer " + key.encode("latin-1")) as client:  # type: ignore[arg-type]
            _error(await client.post("/v1/completions", json=request), 401)

    # "voilà" ends in the byte 0xA0, which str.strip takes for a space.
    for key in ("pässwort", "voilà"):
        executor = ScriptedExecutor(closed_form)
        with InProcess(scripted_config, byte_tokenizer, executor, api_key=key) as served:
            asyncio.run(main(served, key))


@pytest.mark.parametrize("stop", [None, ["日本", "xyz"], ["€ f"]], ids=["no-stop", "stop-cjk", "stop-euro"])
def test_text_offsets_point_into_the_text(scripted_config: Any, byte_tokenizer: Any, stop: Any) -> None:
    """The completions `text_offset` of each token is where its text starts in the choice's text, although
    the byte-level tokenizer splits characters across tokens (each alone decodes to U+FFFD) and a possible
    stop string holds text back; streamed and whole alike."""
    ids = byte_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    executor = ScriptedExecutor(text_script(ids, len(PROMPT)))
    request = {"prompt": PROMPT, "max_tokens": len(ids), "logprobs": 0, "temperature": 0, "stop": stop}

    def check(text: str, tokens: list[str], offsets: list[int]) -> None:
        assert len(tokens) == len(offsets) and offsets == sorted(offsets) and offsets[-1] <= len(text)
        shown = [t for t, o in zip(tokens, offsets, strict=True) if "\ufffd" not in t and o < len(text)]
        assert len(shown) > 10
        for token, offset in zip(tokens, offsets, strict=True):
            if "\ufffd" not in token and offset < len(text):
                assert text[offset:].startswith(token), (token, offset, text[offset : offset + 8])

    async def main(served: InProcess) -> None:
        async with served.client() as client:
            whole = (await client.post("/v1/completions", json=request)).json()["choices"][0]
            lp = whole["logprobs"]
            assert whole["text"] == (TEXT[: TEXT.index(stop[0])] if stop else TEXT)
            check(whole["text"], lp["tokens"], lp["text_offset"])
            events = _events(await client.post("/v1/completions", json={**request, "stream": True}))
            choices = [e["choices"][0] for e in events[:-1]]
            text = "".join(c["text"] for c in choices)
            tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
            offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
            assert text == whole["text"] and tokens == lp["tokens"]
            check(text, tokens, offsets)

    with InProcess(scripted_config, byte_tokenizer, executor) as served:
        asyncio.run(main(served))


@pytest.mark.parametrize("stop", [None, ["中"], ["\ufffd\ufffd"]], ids=["no-stop", "stop-cjk", "stop-fffd"])
def test_a_byte_fallback_stream_joins_into_the_whole_text(scripted_config: Any, stop: Any) -> None:
    """SentencePiece byte fallback (Llama 2): a run of byte tokens that is not UTF-8 decodes to one U+FFFD
    per byte, also bytes that made a character before. The SSE chunks' texts join into the whole
    response's text, the tokenizer's decode, or cut where a stop string first shows in the decode of the
    tokens so far ("中" before <0xFF> spoils it); text_offset never goes back nor past the text."""
    f = FAMILIES["byte-fallback-skipTrue"]
    the, ok = f.tokenizer.convert_tokens_to_ids(["▁the", "▁ok"])
    zhong = f.bytes_of("中".encode())
    ids = [the, *zhong, *f.bytes_of(b"\xff"), ok, *zhong, ok, *f.bytes_of("é".encode())[:1], the]
    want = first_stop(f, the, ids, stop, include=False) if stop else None
    text = want[1] if want else detok_reference(f, the, ids)
    executor = ScriptedExecutor(text_script(ids, 2))
    request = {"prompt": [1, the], "max_tokens": len(ids), "logprobs": 0, "temperature": 0, "stop": stop}

    async def main(served: InProcess) -> None:
        async with served.client() as client:
            whole = (await client.post("/v1/completions", json=request)).json()["choices"][0]
            assert whole["text"] == text
            events = _events(await client.post("/v1/completions", json={**request, "stream": True}))
            choices = [e["choices"][0] for e in events[:-1]]
            assert "".join(c["text"] for c in choices) == text
            offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
            assert offsets == whole["logprobs"]["text_offset"] == sorted(offsets)
            assert offsets[-1] <= len(text) and len(offsets) == (want[0] if want else len(ids))

    with InProcess(scripted_config, f.tokenizer, executor) as served:
        asyncio.run(main(served))


def test_a_stream_sends_every_token_also_while_its_text_is_held_back(
    scripted_config: Any, byte_tokenizer: Any
) -> None:
    """Each engine output that brings a token is a chunk (vLLM's streams): where the text is held back
    (the byte-level tokenizer splits characters across tokens), its text is empty; the texts still join
    into the whole text, and a client sees every token come (one output per token here). Chat's deltas
    go through the same Piece.worth_sending."""
    ids = byte_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    executor = ScriptedExecutor(text_script(ids, len(PROMPT)))
    request = {"prompt": PROMPT, "max_tokens": len(ids), "temperature": 0, "ignore_eos": True, "stream": True}

    async def main(served: InProcess) -> None:
        async with served.client() as client:
            events = _events(await client.post("/v1/completions", json=request))
            texts = [e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices")]
            assert len(texts) == len(ids), (len(texts), len(ids))
            assert "".join(texts) == TEXT and not any("\ufffd" in t for t in texts)
            assert sum(1 for t in texts if not t) > 0, "the script should hold some text back"

    with InProcess(scripted_config, byte_tokenizer, executor) as served:
        asyncio.run(main(served))


def test_text_offsets_count_bytes_that_never_make_a_character(byte_tokenizer: Any) -> None:
    """A byte that begins a character no later token completes stays U+FFFD in the text: the tokens after
    it start one character later. Against a brute force: token i starts where the decode of the tokens
    before it stops agreeing with the whole text (a character they begin counts once complete)."""
    tok = byte_tokenizer

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    split = encode("ϝ")
    assert len(split) == 2  # the byte-level tokenizer splits it
    ids = encode("ab") + split[:1] + encode("cd") + split + encode("e") + split[1:] + encode("f")
    ids += split[:1] + split + encode("g")  # a first byte that the next first byte makes garbage
    text = tok.decode(ids)
    assert text.count("\ufffd") == 3 and text.count("ϝ") == 2
    offsets = TextOffsets(tok)
    got = [offsets.next(t) for t in ids]
    want = []
    for i in range(len(ids)):
        before = tok.decode(ids[:i])
        same = 0
        while same < len(before) and before[same] == text[same]:
            same += 1
        want.append(same)
    assert got == want


def test_chat_logprob_bytes_rebuild_split_characters(byte_tokenizer: Any) -> None:
    """Chat logprobs' `bytes` are each token's own UTF-8 bytes: joined over a text whose characters are
    split across tokens they give its UTF-8 (a token holding part of a character is U+FFFD as text). A
    SentencePiece byte token (<0xCF>) is its byte."""
    ids = byte_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    token_bytes = TokenBytes(byte_tokenizer)
    pieces = [token_bytes(i, byte_tokenizer.decode([i])) for i in ids]
    assert any("\ufffd" in byte_tokenizer.decode([i]) for i in ids)
    assert bytes(b for piece in pieces for b in piece) == TEXT.encode("utf-8")

    class ByteFallback:
        def convert_ids_to_tokens(self, token_id: int) -> str:
            return {7: "<0xCF>", 8: "<0x9D>"}.get(token_id, "▁word")

    sentencepiece = TokenBytes(ByteFallback())
    assert sentencepiece(7, "\ufffd") + sentencepiece(8, "\ufffd") == list("ϝ".encode())
    assert sentencepiece(9, "word") == list(b" word")  # decoded alone, its word loses the space
    # A real SentencePiece-style tokenizer (Metaspace words, byte fallback): the bytes rebuild the text
    # with its words' spaces.
    sp = _sentencepiece_style_tokenizer()
    text = " Paris. " + TEXT + " Ωμέγα ✈"  # the last characters are not in its vocabulary: bytes
    ids = sp(text, add_special_tokens=False)["input_ids"]
    assert any(sp.convert_ids_to_tokens(i).startswith("<0x") for i in ids)
    token_bytes = TokenBytes(sp)
    assert bytes(b for i in ids for b in token_bytes(i, sp.decode([i]))) == text.encode("utf-8")


def test_completion_top_logprobs_keep_the_chosen_tokens_value(byte_tokenizer: Any) -> None:
    """/v1/completions' top_logprobs are keyed by token text, and tokens that each hold part of a character
    all read U+FFFD: the chosen token's entry keeps its own logprob, then the likelier alternative's, for
    any `logprobs` (a less likely token of the same text overwrote it, so the value changed with the
    count asked for)."""
    from tp_runtime.outputs import CompletionOutput, Logprob
    from tp_runtime.server.protocol import CompletionRequest

    ids = byte_tokenizer("\u03dd\u03dd", add_special_tokens=False)["input_ids"]
    partial = [i for i in ids if byte_tokenizer.decode([i]) == "\ufffd"]
    word = byte_tokenizer("Paris", add_special_tokens=False)["input_ids"][0]
    assert len(set(partial)) == 2, ids
    chosen, other = partial[0], partial[1]
    for top in (1, 2, 3):
        body = CompletionRequest(model=NAME, prompt="Hi", max_tokens=1, logprobs=top)
        fmt = CompletionFormat(body, [[5, 6]], byte_tokenizer)
        position = {
            chosen: Logprob(-1.0, 2, "\ufffd"),
            word: Logprob(-0.5, 1, byte_tokenizer.decode([word])),
            other: Logprob(-1.5, 3, "\ufffd"),
        }
        out = CompletionOutput(0, "", [chosen], "length", logprobs=[position])
        logprobs, _ = fmt.logprobs(0, out, finished=True)
        assert logprobs.token_logprobs == [-1.0]
        assert logprobs.top_logprobs[0]["\ufffd"] == -1.0, (top, logprobs.top_logprobs)


def test_null_means_the_default_and_big_bad_requests_stay_cheap(
    scripted_config: Any, byte_tokenizer: Any
) -> None:
    """OpenAI's nullable fields may be sent as null (the default); a body whose long list is of the wrong
    type gets a short message; a request for too many choices is refused before any prompt is tokenized."""
    counting = _CountingTokenizer(byte_tokenizer)
    executor = ScriptedExecutor(closed_form)
    nulls = dict.fromkeys(("n", "stream", "echo", "logprobs", "min_tokens", "ignore_eos"))

    async def main(served: InProcess) -> None:
        async with served.client() as client:
            ok = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, **nulls})
            assert ok.status_code == 200, ok.text
            (choice,) = ok.json()["choices"]
            assert choice["logprobs"] is None and not choice["text"].startswith("Hi")
            stream = {"prompt": "Hi", "max_tokens": 2, "stream": True}
            stream["stream_options"] = {"include_usage": None}
            events = _events(await client.post("/v1/completions", json=stream))
            assert events[-1] == "[DONE]" and all(e.get("usage") is None for e in events[:-1])
            error = _error(await client.post("/v1/completions", json={"prompt": None}), 400)
            assert error["param"] == "prompt"
            wrong = await client.post("/v1/completions", json={"prompt": [0.5] * 200_000})
            error = _error(wrong, 400)
            assert "is none of the types" in error["message"] and len(error["message"]) < 400
            bad_stops = {"prompt": "x", "stop": [1] * 10_000}
            error = _error(await client.post("/v1/completions", json=bad_stops), 400)
            assert len(error["message"]) < 400
            counting.calls = 0
            error = _error(await client.post("/v1/completions", json={"prompt": ["x"] * 129}), 400)
            assert "129 choices" in error["message"] and counting.calls == 0
            error = _error(await client.post("/v1/completions", json={"prompt": ["x"] * 2, "n": 65}), 400)
            assert "130 choices" in error["message"] and counting.calls == 0
            chat = {"messages": [{"role": "user", "content": "x"}], "n": 129}  # refused before its template
            error = _error(await client.post("/v1/chat/completions", json=chat), 400)
            assert "129 choices" in error["message"] and counting.calls == 0
            # A dict's bad values are its keys' errors, not a union's branches; 5 are named, the rest counted.
            bias = {"prompt": "x", "logit_bias": {str(i): "a" for i in range(1000)}}
            error = _error(await client.post("/v1/completions", json=bias), 400)
            assert error["message"].startswith("logit_bias.0: Input should be a valid number"), error
            assert error["message"].endswith("; and 995 more") and len(error["message"]) < 500
            bias = {"prompt": "x", "logit_bias": {"a": "x", "b": "y"}}
            error = _error(await client.post("/v1/completions", json=bias), 400)
            assert "logit_bias.a: " in error["message"] and "logit_bias.b: " in error["message"], error

    with InProcess(scripted_config, byte_tokenizer, executor, front_tokenizer=counting) as served:
        asyncio.run(main(served))


class _CountingTokenizer:
    """The front end's tokenizer, counting its encodes."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, text: str, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_formatting_a_response_does_not_block_the_event_loop(
    scripted_config: Any, byte_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole response is assembled and encoded off the event loop (with echoed prompts and logprobs it
    can be megabytes): while one is held inside its assembly, /health and other requests are answered."""
    entered, go = threading.Event(), threading.Event()
    timed_out: list[bool] = []
    choice = CompletionFormat.choice

    def held_choice(self: Any, index: int, pieces: Any) -> Any:
        if self.top is not None:  # the held request is the one that asks for logprobs
            entered.set()
            timed_out.append(not go.wait(20))
        return choice(self, index, pieces)

    monkeypatch.setattr(CompletionFormat, "choice", held_choice)
    executor = ScriptedExecutor(closed_form)

    async def main(served: InProcess) -> None:
        async with served.client() as client:
            held_body = {"prompt": "Hi", "max_tokens": 3, "logprobs": 1, "echo": True}
            held = asyncio.create_task(client.post("/v1/completions", json=held_body))
            assert await asyncio.to_thread(entered.wait, 60)
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/ping")).status_code == (await client.post("/ping")).status_code == 200
            other = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
            assert other.status_code == 200 and other.json()["choices"][0]["finish_reason"] == "length"
            go.set()
            response = await held
            assert response.status_code == 200 and response.json()["choices"][0]["text"].startswith("Hi")

    with InProcess(scripted_config, byte_tokenizer, executor) as served:
        asyncio.run(main(served))
    assert timed_out == [False], "the held assembly blocked the event loop"


def test_structured_outputs_through_the_openai_client(server1: Server, llm1: LLM) -> None:
    """response_format (json_schema, json_object) on chat, vLLM's structured_outputs and guided_* fields on
    completions, streamed too: the noise model's text then follows the constraint, as LLM's does."""
    from tp_runtime import StructuredOutputsParams

    client = server1.client()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    chat = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=64, seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "count", "schema": schema}},
    )  # fmt: skip
    answer = json.loads(chat.choices[0].message.content or "", strict=False)
    assert set(answer) == {"n"} and 0 <= answer["n"] <= 99 and chat.choices[0].finish_reason == "stop"
    obj = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=300, seed=2,
                                         response_format={"type": "json_object"})  # fmt: skip
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content or "", strict=False), dict)
    else:
        assert (obj.choices[0].message.content or "").startswith("{")
    # Completions: vLLM's extra field, the same tokens as LLM.generate with the same constraint.
    regex = r"[0-9]{3}-[a-z]{2}"
    done = client.completions.create(model=NAME, prompt="Code:", max_tokens=20, seed=7,
                                     extra_body={"structured_outputs": {"regex": regex}})  # fmt: skip
    spec = StructuredOutputsParams(regex=regex)
    constrained = SamplingParams(max_tokens=20, seed=7, structured_outputs=spec)
    want = llm1.generate(["Code:"], constrained, use_tqdm=False)[0]
    assert done.choices[0].text == want.outputs[0].text and re.fullmatch(regex, done.choices[0].text)
    streamed = client.completions.create(model=NAME, prompt="Code:", max_tokens=20, seed=7, stream=True,
                                         extra_body={"guided_choice": ["north", "south"]})  # fmt: skip
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    assert text in ("north", "south")
    # A structural tag (vLLM's response_format type, or its structured_outputs field): the same text as
    # LLM.generate with it.
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<n>"}, {"type": "json_schema", "json_schema": schema},
        {"type": "const_string", "value": "</n>"}]}}  # fmt: skip
    tagged_params = SamplingParams(max_tokens=40, seed=3, structured_outputs=StructuredOutputsParams(
        structural_tag=tag))  # fmt: skip
    want_text = llm1.generate(["Code:"], tagged_params, use_tqdm=False)[0].outputs[0].text
    assert want_text.startswith("<n>")
    for extra in ({"response_format": tag}, {"structured_outputs": {"structural_tag": json.dumps(tag)}}):
        tagged = client.completions.create(model=NAME, prompt="Code:", max_tokens=40, seed=3,
                                           extra_body=extra)  # fmt: skip
        assert tagged.choices[0].text == want_text, extra
    with pytest.raises(openai.BadRequestError, match="JSON schema is not valid") as info:
        bad = {"structured_outputs": {"json": {"type": "object", "required": 3}}}
        client.completions.create(model=NAME, prompt="x", max_tokens=4, extra_body=bad)
    assert info.value.body["param"] == "structured_outputs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="response_format type 'xml'"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4,
                                       response_format={"type": "xml"})  # type: ignore[arg-type]  # fmt: skip


def test_tool_calls_through_the_openai_client(server1: Server) -> None:
    """tool_choice "required" and a named function constrain the noise model's output to calls, which
    come back in OpenAI's tool_calls shape, streamed too; "auto" needs --tool-call-parser."""
    client = server1.client()
    tools: Any = [
        {"type": "function", "function": {"name": "weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "clock", "parameters": {
            "type": "object", "properties": {}, "additionalProperties": False}}},
    ]  # fmt: skip
    named = client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=tools, max_tokens=80, seed=3,
        tool_choice={"type": "function", "function": {"name": "weather"}},
    )  # fmt: skip
    (call,) = named.choices[0].message.tool_calls or []
    assert call.type == "function" and call.function.name == "weather" and call.id
    assert set(json.loads(call.function.arguments)) == {"city"}  # no raw control character in its string
    required = client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=tools, max_tokens=200, seed=5, tool_choice="required",
        parallel_tool_calls=False,
    )  # fmt: skip
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls or []) == 1
    for c in choice.message.tool_calls:
        assert c.function.name in ("weather", "clock")
        assert isinstance(json.loads(c.function.arguments), dict)
    stream = client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=tools, max_tokens=80, seed=3, stream=True,
        tool_choice={"type": "function", "function": {"name": "weather"}},
    )  # fmt: skip
    ids, names, arguments = set(), set(), ""
    for chunk in stream:
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            ids.add(delta_call.id) if delta_call.id else None
            names.add(delta_call.function.name) if delta_call.function and delta_call.function.name else None
            arguments += (delta_call.function.arguments or "") if delta_call.function else ""
    assert len(ids) == 1 and names == {"weather"} and arguments == call.function.arguments
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser") as info:
        client.chat.completions.create(model=NAME, messages=MESSAGES, tools=tools, max_tokens=4)
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]


def test_process_age_matches_the_process_start_time() -> None:
    """The ready line's "started in" (runner.process_age_s, from /proc) against when the process was made:
    between the monotonic clock's reading before Popen and after it returned (the kernel's clock, which
    /proc/uptime follows, is shared by every process), in a process alive for at least a second. /proc
    counts in ticks of 1/CLK_TCK s: a tick's slack."""
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs Linux's /proc")
    code = ("import time; time.sleep(1.0); from tp_runtime.server.runner import process_age_s; "
            "age = process_age_s(); print(age, time.monotonic())")  # fmt: skip
    before = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)  # fmt: skip
    after = time.monotonic()
    stdout, stderr = child.communicate(timeout=120)
    assert child.returncode == 0, stderr[-2000:]
    ours, child_now = map(float, stdout.split())
    slack = 2.0 / os.sysconf("SC_CLK_TCK")
    assert ours >= 1.0 and child_now - after - slack <= ours <= child_now - before + slack, (
        ours,
        child_now - after,
        child_now - before,
    )


def test_an_echoed_prompt_cut_short_by_a_drain_says_abort(scripted_config: Any, byte_tokenizer: Any) -> None:
    """echo with max_tokens 0 (the prompt alone) reports "length" for the one token the engine makes and
    the response leaves out; a drain that ends it first is "abort", as for any other request (it was
    "length": a finished choice, though its prompt was never computed)."""
    gate = threading.Semaphore(0)
    executor = ScriptedExecutor(closed_form, gate)
    # 100 prompt tokens are 4 steps of prefill (32 tokens a step): the drain ends it midway.
    request = {"prompt": list(range(3, 103)), "echo": True, "max_tokens": 0}

    async def main(served: InProcess) -> dict[str, Any]:
        async with served.client() as client:
            pending = asyncio.ensure_future(client.post("/v1/completions", json=request))
            deadline = time.monotonic() + 60
            while executor.requests_seen == 0:  # its first step waits at the gate
                assert time.monotonic() < deadline, "the request never reached the engine"
                await asyncio.sleep(0.01)
            served.begin_drain(0.0)
            gate.release(1000)
            response = await pending
            assert response.status_code == 200, response.text
            return dict(response.json()["choices"][0])

    with InProcess(scripted_config, byte_tokenizer, executor) as served:
        choice = asyncio.run(main(served))
        assert dict(served.engine.stats.finished) == {"abort": 1}
    assert choice["finish_reason"] == "abort", choice


def test_hermes_markers_that_are_special_tokens_are_read(scripted_config: Any) -> None:
    """Some tokenizers hold Hermes' <tool_call> markers as special tokens: a request whose tools the model
    may call keeps them in its text (as vLLM's parser asks), so the call is read, not returned as content
    without its markers; with parallel_tool_calls false only the first call comes back, as in vLLM; and
    arguments the model wrote as a plain string come back as JSON."""
    tok = build_preset_tokenizer(VOCAB)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tok.chat_template = TEMPLATE
    opening, closing = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    calls = ['{"name":"wx","arguments":{"c":"Oslo"}}', '{"name":"t","arguments":"now"}']
    text_ids = [i for c in calls for i in (opening, *tok.encode(c, add_special_tokens=False), closing)]
    (eos,) = scripted_config.eos_token_ids
    starts: dict[int, int] = {}

    def script(req_id: int, position: int) -> int:
        at = position - starts.setdefault(req_id, position)
        return text_ids[at] if at < len(text_ids) else eos

    tools = [{"type": "function", "function": {"name": name}} for name in ("wx", "t")]
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 90}
    assert len(text_ids) < 90

    async def main(served: InProcess) -> list[Any]:
        async with served.client() as client:
            replies = [await client.post("/v1/chat/completions", json=body) for body in (
                chat, {**chat, "parallel_tool_calls": False}, {**chat, "stream": True},
                {**chat, "tool_choice": "none"})]  # fmt: skip
        return [r.json() if i != 2 else _events(r) for i, r in enumerate(replies)]

    with InProcess(scripted_config, tok, ScriptedExecutor(script), tool_call_parser="hermes") as served:
        both, first, streamed, none = asyncio.run(main(served))
    want = [("wx", {"c": "Oslo"}), ("t", "now")]
    message = both["choices"][0]["message"]
    assert both["choices"][0]["finish_reason"] == "tool_calls" and not message["content"]
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert got == want
    assert [c["function"]["name"] for c in first["choices"][0]["message"]["tool_calls"]] == ["wx"]
    deltas = [d for e in streamed[:-1] for d in e["choices"][0]["delta"].get("tool_calls", [])]
    assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == want
    # tool_choice "none": nothing is parsed, and the text leaves special tokens out as usual
    assert none["choices"][0]["message"]["content"] == tok.decode(text_ids, skip_special_tokens=True)
