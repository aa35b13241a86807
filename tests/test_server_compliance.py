"""OpenAI API compliance of `tp-runtime serve` on requests that are valid but unusual, against one real
server for the module (`python -m tp_runtime.server.cli tiny-llama-tp`, with a chat template and the
hermes tool-call parser). The random model's output is chosen where a test needs it with a guided regex.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import cli_servers

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama-tp"
START_DEADLINE_S = 180.0
REQUEST_TIMEOUT_S = 60.0
TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n{% endif %}"
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = [
        MODEL, "--device", "cpu", "--port", "0", "--max-model-len", "256", "--log-level", "warning",
        "--no-access-log", "--chat-template", TEMPLATE, "--tool-call-parser", "hermes",
    ]  # fmt: skip
    with cli_servers(tmp_path_factory.mktemp("compliance"), {"server": args}, START_DEADLINE_S) as urls:
        yield urls["server"]


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=REQUEST_TIMEOUT_S)


def _events(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """A stream's events, parsed (the last one "[DONE]")."""
    events: list[Any] = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=REQUEST_TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: "), line
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    assert events and events[-1] == "[DONE]", events
    return events


def test_streamed_content_before_a_hermes_call_is_sent_once(url: str) -> None:
    """The text before a `<tool_call>` goes out as content once, also when it reaches the stream only with
    the call, in the choice's last chunk (here a stop string that the whole output begins holds it back)."""
    output = 'Sure <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    body = {
        "messages": MESSAGES, "tools": [TOOL], "max_tokens": 60, "temperature": 0,
        "structured_outputs": {"regex": re.escape(output)}, "stop": [output + "!"],
    }  # fmt: skip
    events = _events(url, "/v1/chat/completions", body)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure "
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    named = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert named == [("f", {"a": 1})]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    # The whole response says the same, its content byte for byte as streamed.
    message = _post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message["content"] == "Sure " and len(message["tool_calls"]) == 1


def test_an_empty_model_name_means_the_served_model(url: str) -> None:
    """As vLLM serves it (and as a missing or null model): "" names no other model, so it is no 404."""
    for path, body in (
        ("/v1/completions", {"model": "", "prompt": "hi", "max_tokens": 1}),
        ("/v1/chat/completions", {"model": "", "messages": MESSAGES, "max_tokens": 1}),
    ):
        response = _post(url, path, body)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == MODEL
    missing = _post(url, "/v1/completions", {"model": "gpt-4", "prompt": "hi", "max_tokens": 1})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_stop_token_id_outside_the_vocabulary_names_its_field(url: str) -> None:
    response = _post(url, "/v1/completions", {"prompt": "hi", "stop_token_ids": [999_999], "max_tokens": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stop_token_ids" and "outside the vocabulary" in error["message"], error


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_each_choices_usage_in_its_chunks(url: str, path: str) -> None:
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk of a choice carries
    that choice's usage so far (its prompt's tokens, its tokens), the last chunk the request's."""
    if path == "/v1/completions":
        body: dict[str, Any] = {"prompt": [[5, 6, 7], [8, 9]], "n": 2}
        prompt_lengths = [3, 3, 2, 2]  # choice = prompt * n + sample
    else:
        body = {"messages": MESSAGES, "n": 2}
        prompt_lengths = [_post(url, path, {**body, "max_tokens": 1}).json()["usage"]["prompt_tokens"]] * 2
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = _events(url, path, {**body, "max_tokens": 3, "ignore_eos": True, "stream_options": options})
    *chunks, last, _ = events
    so_far = [0] * len(prompt_lengths)  # each choice's completion tokens, as its chunks say
    for chunk in chunks:
        (choice,) = chunk["choices"]
        i, usage = choice["index"], chunk["usage"]
        assert usage is not None and usage["prompt_tokens"] == prompt_lengths[i], (chunk, prompt_lengths)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], chunk
        assert usage["completion_tokens"] >= so_far[i], (chunk, so_far)
        assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int), chunk  # as the last chunk's
        so_far[i] = usage["completion_tokens"]
    assert so_far == [3] * len(prompt_lengths), so_far
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3 * len(prompt_lengths), last
    # include_usage false asks for nothing; left out, it is true, as vLLM's default.
    off = {"include_usage": False, "continuous_usage_stats": True}
    plain = _events(url, path, {**body, "max_tokens": 1, "stream_options": off})
    assert all("usage" not in e for e in plain[:-1]), plain
    continuous = {"continuous_usage_stats": True}
    implied = _events(url, path, {**body, "max_tokens": 1, "stream_options": continuous})
    assert all(e["usage"] is not None for e in implied[:-1]) and implied[-2]["choices"] == [], implied


def test_tool_choice_none_still_shows_the_tools_to_the_template(url: str) -> None:
    """tool_choice "none" only keeps the model from calling: the tools reach the chat template as with "auto"
    (vLLM's default; the README's word), so the prompt is the same."""

    def prompt_tokens(**fields: Any) -> int:
        response = _post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, **fields})
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens"])

    bare = prompt_tokens()
    shown = prompt_tokens(tools=[TOOL], tool_choice="auto")
    assert shown > bare
    assert prompt_tokens(tools=[TOOL], tool_choice="none") == shown


TEXTLESS_PARTS = [{"type": "text"}, {"type": "text", "text": 3}, {"type": "text", "text": None}]


@pytest.mark.parametrize("part", TEXTLESS_PARTS, ids=["missing", "int", "null"])
def test_a_text_part_without_its_text_is_named_as_such(url: str, part: dict[str, Any]) -> None:
    """Not "only text content parts are supported, got 'text'", which contradicts itself."""
    body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
    response = _post(url, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "text content part needs its text" in error["message"], error


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(url: str) -> None:
    """vLLM's truncate_prompt_tokens: the completion of the last k prompt tokens, counted as k prompt tokens,
    echoed as the model read them; -1 is max_model_len; more is a 400 naming the field."""
    ids = [5, 6, 7, 8, 9, 10, 11]
    base = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    # Echoed with logprobs and their offsets, two seeded samples: as the last 3 tokens sent alone.
    echo = {**base, "echo": True, "logprobs": 1, "n": 2, "seed": 3, "temperature": 1.0}
    cut = _post(url, "/v1/completions", {**echo, "prompt": ids, "truncate_prompt_tokens": 3}).json()
    alone = _post(url, "/v1/completions", {**echo, "prompt": ids[-3:]}).json()
    assert cut["usage"] == alone["usage"] and cut["usage"]["prompt_tokens"] == 3, cut["usage"]
    assert cut["choices"] == alone["choices"]
    whole = _post(url, "/v1/completions", {**base, "prompt": ids, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == len(ids)
    chat = _post(url, "/v1/chat/completions", {**base, "messages": MESSAGES}).json()
    n = chat["usage"]["prompt_tokens"]
    chat_body = {**base, "messages": MESSAGES, "truncate_prompt_tokens": n - 1}
    short = _post(url, "/v1/chat/completions", chat_body)
    assert short.json()["usage"]["prompt_tokens"] == n - 1, short.text
    for keep, status in ((257, 400), (0, 400), (1.5, 400)):
        response = _post(url, "/v1/completions", {**base, "prompt": ids, "truncate_prompt_tokens": keep})
        assert response.status_code == status, response.text
        assert response.json()["error"]["param"] == "truncate_prompt_tokens", response.text


def test_spaces_between_special_tokens_is_a_checked_field(url: str) -> None:
    """vLLM's spaces_between_special_tokens reaches SamplingParams: false is taken (a fast tokenizer's
    text is the same), a value that is not a boolean is a 400 naming it."""
    body = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
    plain = _post(url, "/v1/completions", body)
    spaced = _post(url, "/v1/completions", {**body, "spaces_between_special_tokens": False})
    assert plain.status_code == spaced.status_code == 200, spaced.text
    assert spaced.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    bad = _post(url, "/v1/chat/completions", {**chat, "spaces_between_special_tokens": "no"})
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "spaces_between_special_tokens", bad.text
