"""Bad and hostile request bodies against a real server (`python -m tp_runtime.server.cli tiny-llama-tp`,
one for the module, with a chat template and the hermes tool-call parser): each gets OpenAI's error shape
with a 4xx status, or (a valid request) its answer; none gets a 500, and none holds the server's threads
for long. The tool-call parsers are also checked directly on output text nested deeper than `json` reads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import cli_servers

from tp_runtime.server.api_server import MAX_SCHEMA_DEPTH, json_depth
from tp_runtime.server.tool_calls import ToolPlan, parse_hermes, parse_llama3_json

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama-tp"
START_DEADLINE_S = 180.0
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# Far deeper than the server takes, well within Python's own recursion limit for json (about 1000).
DEEP = 800
# A request that misbehaves gets this long; a refused one is answered in milliseconds.
REQUEST_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = [
        MODEL, "--device", "cpu", "--port", "0", "--max-model-len", "1000", "--log-level", "warning",
        "--no-access-log", "--chat-template", TEMPLATE, "--tool-call-parser", "hermes",
    ]  # fmt: skip
    with cli_servers(tmp_path_factory.mktemp("inputs"), {"server": args}, START_DEADLINE_S) as urls:
        yield urls["server"]


def _post(url: str, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=REQUEST_TIMEOUT_S)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text[:2000])
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "invalid_request_error", body
    return dict(body["error"])


def _nested_schema(depth: int) -> dict[str, Any]:
    """A JSON schema nested `depth` levels deep: arrays of arrays of ... of objects."""
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def _nested_schema_text(depth: int) -> str:
    # Built as text: json.dumps of so deep a dict would itself need the recursion depth.
    return '{"type": "array", "items": ' * (depth - 1) + '{"type": "object"}' + "}" * (depth - 1)


# ----------------------------------------------------------------------------- tool calls' JSON
def test_earlier_tool_call_arguments_nested_past_json_are_taken_as_text(url: str) -> None:
    """An assistant message's tool call whose arguments (JSON text, as OpenAI sends them) nest deeper than
    Python's json reads: the template gets them as the text they are, as it gets any text that is not
    JSON. It was a 500 (RecursionError)."""
    for arguments in ("[" * 100_000, "[" * 100_000 + "]" * 100_000, "{not json"):
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        messages = [*MESSAGES, {"role": "assistant", "tool_calls": [call]}, {"role": "user", "content": "x"}]
        response = _post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
        assert response.status_code == 200, (arguments[:20], response.status_code, response.text[:2000])
        assert response.json()["choices"][0]["finish_reason"] == "length"


def test_tool_call_parsers_take_output_nested_past_json_as_content() -> None:
    """A model's output that nests deeper than json reads (a hostile prompt can ask for one) is no tool
    call: it stays the choice's content. It raised RecursionError while the response was made (a 500, or
    an error event ending a stream)."""
    deep = "[" * 100_000
    assert parse_hermes(f"<tool_call>{deep}</tool_call>") is None
    assert parse_hermes(f"<tool_call>{deep}") is None
    assert parse_llama3_json("{" + deep) is None
    assert parse_llama3_json('{"name": "f", "parameters": ' + deep + "}") is None
    required = ToolPlan.of([TOOL], "required", None)
    assert required is not None and required.parse(deep) is None
    auto = ToolPlan.of([TOOL], "auto", "hermes")
    assert auto is not None and auto.parse(f"<tool_call>{deep}") is None
    # Calls that parse are still calls.
    parsed = parse_hermes('<tool_call>{"name": "f", "arguments": {"a": [[1]]}}</tool_call>')
    assert parsed is not None and parsed.calls == [("f", '{"a": [[1]]}')]


# ------------------------------------------------------------------------------ deep JSON schemas
def test_json_depth() -> None:
    assert json_depth(5) == 0 and json_depth({}) == 1 and json_depth([[], {"a": [1]}]) == 3
    assert json_depth(_nested_schema(DEEP)) == DEEP


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("structured_outputs", "structured_outputs"),
        ("guided_json", "guided_json"),
        ("response_format", "response_format"),
    ],
)
def test_a_schema_nested_too_deep_is_refused_at_once(url: str, field: str, param: str) -> None:
    """A JSON schema given as text is bounded by no parser's depth limit, and xgrammar's compile time grows
    with the cube of its depth (800 levels: about a minute of a CPU, in a thread the request holds, so a
    few such requests stall every other). It is refused before it is compiled; a schema as deep as the
    limit is still served."""
    text = _nested_schema_text(DEEP)
    # As a dict, a schema is bounded by the body parser's depth limit (about 200), but that is deeper than
    # the server takes too.
    schema = _nested_schema(MAX_SCHEMA_DEPTH + 1)
    value: Any = {
        "structured_outputs": {"json": text},
        "guided_json": text,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }[field]
    body = {"prompt": "hi", "max_tokens": 2, field: value}
    started = time.monotonic()
    error = _error(_post(url, "/v1/completions", body), 400)
    assert error["param"] == param and f"more than {MAX_SCHEMA_DEPTH} levels deep" in error["message"]
    assert time.monotonic() - started < REQUEST_TIMEOUT_S
    # As deep as the limit, the request is served.
    within = _nested_schema(MAX_SCHEMA_DEPTH)
    assert json_depth(within) == MAX_SCHEMA_DEPTH
    ok = _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_json": within})
    assert ok.status_code == 200, ok.text[:2000]


def test_a_tool_whose_parameters_nest_too_deep_is_refused(url: str) -> None:
    deep_tool = {
        "type": "function",
        "function": {"name": "f", "parameters": _nested_schema(MAX_SCHEMA_DEPTH + 1)},
    }
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        body = {"messages": MESSAGES, "tools": [deep_tool], "tool_choice": choice, "max_tokens": 2}
        error = _error(_post(url, "/v1/chat/completions", body), 400)
        assert error["param"] == "tools" and "levels deep" in error["message"], error


# ------------------------------------------------------------------------------ a sweep of bodies
_COMPLETION = {"prompt": "hi", "max_tokens": 2}
_HOSTILE: list[tuple[str, dict[str, Any] | bytes]] = [
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}'),
    ("/v1/completions", b'{"prompt": "hi", "top_p": Infinity}'),
    ("/v1/completions", b'{"prompt": "hi", "presence_penalty": 1e999}'),
    ("/v1/completions", b'{"prompt": "h\xffi"}'),  # not UTF-8
    ("/v1/completions", b"\xef\xbb\xbf{}"),  # a byte-order mark
    ("/v1/completions", b"[" * 100_000),  # nested past the parser's limit
    ("/v1/completions", b"null"),
    ("/v1/completions", {**_COMPLETION, "max_tokens": 10**400}),
    ("/v1/completions", {**_COMPLETION, "n": 10**400}),
    ("/v1/completions", {**_COMPLETION, "seed": 2**64}),
    ("/v1/completions", {**_COMPLETION, "top_k": -(2**64)}),
    ("/v1/completions", {**_COMPLETION, "logprobs": 2**64}),
    ("/v1/completions", {**_COMPLETION, "stop_token_ids": [2**70]}),
    ("/v1/completions", {"prompt": [10**400]}),
    ("/v1/completions", {"prompt": [[1, 2], []]}),
    ("/v1/completions", {"prompt": [[-1]]}),
    ("/v1/completions", {"prompt": [[1], "a"]}),
    ("/v1/completions", {"prompt": {"a": 1}}),
    (
        "/v1/completions",
        {**_COMPLETION, "structured_outputs": {"json": {"type": "integer", "minimum": 10**400}}},
    ),
    ("/v1/completions", {**_COMPLETION, "response_format": {"type": ["json_object"]}}),
    ("/v1/completions", {**_COMPLETION, "response_format": {}}),  # OpenAI: the type is required
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"json_schema": {"schema": {}}}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": {"text": "x"}}]}),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL], "tool_choice": ["f"]}),
    # A bad constraint beside one that tool_choice makes (it was a 500).
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL], "tool_choice": "required",
                              "response_format": {"type": "bogus"}}),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL], "tool_choice": "required",
                              "structured_outputs": {"foo": 1}}),
    # A pattern whose groups nest 30,000 deep (xgrammar's conversion crashed the server).
    ("/v1/completions", {**_COMPLETION, "structured_outputs": {
        "json": {"type": "string", "pattern": "(" * 30_000 + "a" + ")" * 30_000}}}),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"function": {"name": "f", "parameters": 1}}]}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 10**400}),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2**64}),
]


def test_hostile_bodies_get_openai_400s(url: str) -> None:
    for path, body in _HOSTILE:
        _error(_post(url, path, body), 400)
    # The server is unharmed.
    ok = _post(url, "/v1/completions", _COMPLETION)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length", ok.text


def test_cache_salt(url: str) -> None:
    """vLLM's cache_salt on both endpoints: the same salt shares the prompt's cached blocks, another does
    not (usage.prompt_tokens_details.cached_tokens says which), and the text is the same either way; an
    empty one is a 400 naming it."""
    prompt = list(range(40, 100))
    cached, texts = [], []
    for salt in ("s1", "s1", "s2", None):
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        reply = _post(url, "/v1/completions", body)
        assert reply.status_code == 200, reply.text
        details = reply.json()["usage"].get("prompt_tokens_details") or {}
        cached.append(details.get("cached_tokens", 0))
        texts.append(reply.json()["choices"][0]["text"])
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0, cached
    assert len(set(texts)) == 1
    chat = _post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "cache_salt": "s1"})
    assert chat.status_code == 200, chat.text
    for path, body in (
        ("/v1/completions", {"prompt": prompt}), ("/v1/chat/completions", {"messages": MESSAGES})
    ):  # fmt: skip
        assert _error(_post(url, path, {**body, "cache_salt": ""}), 400)["param"] == "cache_salt"


def test_a_sample_whose_seed_comes_to_minus_one_is_seeded(url: str) -> None:
    """Sample j is seeded with seed + j, as vLLM's: with seed -2 sample 1 has the seed -1, which the server
    turned back into "no seed" (SamplingParams reads a given -1 so), and it came out different each time."""
    body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 1.0, "seed": -2, "n": 3, "ignore_eos": True}
    runs = [[c["text"] for c in _post(url, "/v1/completions", body).json()["choices"]] for _ in range(2)]
    assert runs[0] == runs[1] and len(set(runs[0])) == 3, runs
