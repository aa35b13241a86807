"""OpenAI API compliance of `tp-runtime serve` on requests that are valid but unusual, against one real
server for the module (`python -m tp_runtime.server.cli tiny-llama-tp`, with a chat template and the
hermes tool-call parser). The random model's output is chosen where a test needs it with a guided regex.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama-tp"
START_DEADLINE_S = 180.0
REQUEST_TIMEOUT_S = 60.0
TEMPLATE = (
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
    log = tmp_path_factory.mktemp("compliance") / "server.log"
    cmd = [
        sys.executable, "-m", "tp_runtime.server.cli", MODEL, "--device", "cpu", "--port", "0",
        "--max-model-len", "256", "--log-level", "warning", "--no-access-log", "--chat-template", TEMPLATE,
        "--tool-call-parser", "hermes",
    ]  # fmt: skip
    with open(log, "wb") as sink:  # a file, not a pipe: a pipe nobody reads would block the server
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        while not (match := re.search(r"ready on (http://\S+)", log.read_text(errors="replace"))):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the server did not start:\n{log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.05)
        yield match.group(1)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    output = log.read_text(errors="replace")
    assert code == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]


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
    # The whole response says the same.
    message = _post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message["content"] == "Sure" and len(message["tool_calls"]) == 1


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
