"""Tool calls (server/tool_calls.py and ChatFormat): the plan a request's tools and tool_choice make, the
hermes and llama3_json parsers, and what a response and a stream carry. The server end to end, through
the openai client, is in tests/test_server.py."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tp_runtime.errors import InvalidRequestError
from tp_runtime.presets import build_preset_tokenizer
from tp_runtime.server.openai_format import ChatFormat, Piece
from tp_runtime.server.protocol import ChatCompletionRequest
from tp_runtime.server.tool_calls import ToolPlan, parse_hermes, parse_llama3_json, template_tool_call

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "time"}}
TOOLS = [WEATHER, TIME]


def test_plans_and_their_constraints() -> None:
    assert ToolPlan.of(None, None, None) is None and ToolPlan.of([], "auto", None) is None
    named = ToolPlan.of(TOOLS, {"type": "function", "function": {"name": "weather"}}, None)
    assert named is not None and named.mode == "named"
    spec = named.constraint()
    assert spec is not None and spec.json == WEATHER["function"]["parameters"]  # type: ignore[index]
    required = ToolPlan.of(TOOLS, "required", None)
    assert required is not None
    schema = required.constraint().json  # type: ignore[union-attr]
    assert isinstance(schema, dict) and schema["type"] == "array" and schema["minItems"] == 1
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["weather", "time"]
    none = ToolPlan.of(TOOLS, "none", None)
    assert none is not None and none.constraint() is None and none.template_tools(TOOLS) == TOOLS
    auto = ToolPlan.of(TOOLS, None, "hermes")
    assert auto is not None and auto.mode == "auto" and auto.constraint() is None
    for tools, choice, parser, field, fragment in [
        (TOOLS, "auto", None, "tool_choice", "--tool-call-parser"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice", "not in tools"),
        (TOOLS, "sometimes", None, "tool_choice", "must be"),
        (None, "required", None, "tool_choice", "needs tools"),
        ([{"type": "function"}], "required", None, "tools", "tools[0]"),
        ([WEATHER, WEATHER], "required", None, "tools", "two functions"),
    ]:
        with pytest.raises(InvalidRequestError, match=re.escape(fragment)) as info:
            ToolPlan.of(tools, choice, parser)  # type: ignore[arg-type]
        assert info.value.field == field


def test_required_calls_of_tools_with_refs_follow_each_tool_s_own_defs() -> None:
    """Parameters written by pydantic for nested models ($defs and $ref "#/$defs/..."; "#" for a
    recursive one) keep pointing at their own definitions once inside the array of calls: two tools with
    a definition of the same name each get theirs, and every finished output parses into calls whose
    arguments satisfy their tool's parameters (here on the random-weight model only the constraint can do
    that). The tools' own schemas are left as they were."""
    pytest.importorskip("xgrammar")
    from tp_runtime import LLM, SamplingParams

    def person(kind: str) -> dict[str, Any]:
        return {"$defs": {"Item": {"type": "object", "properties": {kind: {"type": kind}},
                                   "required": [kind], "additionalProperties": False}},
                "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}},
                "required": ["item"], "additionalProperties": False}  # fmt: skip

    tree = {"type": "object", "additionalProperties": False, "required": ["leaf"],
            "properties": {"leaf": {"type": "boolean"}, "kids": {"type": "array", "items": {"$ref": "#"},
                                                                 "maxItems": 1}}}  # fmt: skip
    params = {"with_int": person("integer"), "with_bool": person("boolean"), "tree": tree}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in params.items()]
    before = json.dumps(tools)
    plan = ToolPlan.of(tools, "required", None)
    assert plan is not None
    spec = plan.constraint()
    assert json.dumps(tools) == before

    def fits(value: Any, schema: dict[str, Any], root: dict[str, Any]) -> bool:
        if "$ref" in schema:
            ref = schema["$ref"]
            return fits(value, root if ref == "#" else root["$defs"][ref.split("/")[-1]], root)
        kind = {"integer": int, "boolean": bool, "object": dict, "array": list}[schema["type"]]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return False
        if kind is dict:
            props = schema["properties"]
            return set(schema["required"]) <= value.keys() <= props.keys() and all(
                fits(v, props[k], root) for k, v in value.items()
            )
        if kind is list:
            return len(value) <= schema.get("maxItems", len(value)) and all(
                fits(v, schema["items"], root) for v in value
            )
        return True

    finished = 0
    with LLM("tiny-llama-tp", device="cpu", max_model_len=512) as llm:
        samples = [SamplingParams(max_tokens=160, seed=s, structured_outputs=spec) for s in range(12)]
        for out in llm.generate(["Call:"] * len(samples), samples, use_tqdm=False):
            sample = out.outputs[0]
            if sample.finish_reason != "stop":
                continue
            finished += 1
            parsed = plan.parse(sample.text)
            assert parsed is not None and parsed.calls, sample.text
            for name, arguments in parsed.calls:
                assert fits(json.loads(arguments), params[name], params[name]), (name, arguments)
    assert finished >= 3


def test_parsers() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
           '<tool_call>{"name": "time", "arguments": {}}</tool_call>'  # fmt: skip
    parsed = parse_hermes(text)
    assert parsed is not None and parsed.content == "Let me look.\n"  # as a stream sends it
    assert [(n, json.loads(a)) for n, a in parsed.calls] == [("weather", {"city": "Oslo"}), ("time", {})]
    assert parse_hermes("no calls here") is None
    assert parse_hermes("<tool_call>{not json}</tool_call>") is None
    # An unterminated last call (the stop token came first) still counts.
    assert parse_hermes('<tool_call>{"name": "time", "arguments": {}}').calls == [("time", "{}")]  # type: ignore[union-attr]
    llama = parse_llama3_json('<|python_tag|>{"name": "weather", "parameters": {"city": "Rome"}}; '
                              '{"name": "time", "parameters": {}}')  # fmt: skip
    assert llama is not None and [n for n, _ in llama.calls] == ["weather", "time"]
    assert json.loads(llama.calls[0][1]) == {"city": "Rome"}
    assert parse_llama3_json("The answer is 4.") is None and parse_llama3_json('{"x": 1}') is None
    # A ";" inside a call's JSON (SQL, shell) is no separator between calls.
    sql = parse_llama3_json('{"name": "query", "parameters": {"sql": "SELECT 1; SELECT 2;"}};'
                            '{"name": "time"}')  # fmt: skip
    assert sql is not None and [(n, json.loads(a)) for n, a in sql.calls] == [
        ("query", {"sql": "SELECT 1; SELECT 2;"}), ("time", {})]  # fmt: skip
    assert parse_llama3_json('{"name": "time", "parameters": {}} and then some text') is None
    # A message's earlier call goes to the template with its arguments as an object.
    call = {"id": "c1", "type": "function", "function": {"name": "time", "arguments": '{"tz": "UTC"}'}}
    assert template_tool_call(call)["function"]["arguments"] == {"tz": "UTC"}
    for none in ({"arguments": ""}, {"arguments": None}, {}):  # a call without arguments: {} (vLLM's)
        bare = {"id": "c2", "type": "function", "function": {"name": "time", **none}}
        assert template_tool_call(bare)["function"] == {"name": "time", "arguments": {}}


def _format(tool_choice: Any, parser: str | None) -> ChatFormat:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                 tool_choice=tool_choice)  # type: ignore[list-item]  # fmt: skip
    return ChatFormat(body, build_preset_tokenizer(300), ToolPlan.of(TOOLS, tool_choice, parser))


def _piece(text: str, finished: bool = False) -> Piece:
    return Piece(index=0, text=text, logprobs=None, num_logprobs=0, finished=finished,
                 finish_reason="stop" if finished else None, stop_reason=None)  # fmt: skip


def test_auto_hermes_stream_sends_content_then_the_calls_and_the_response_matches() -> None:
    fmt = _format("auto", "hermes")
    parts = ["Checking", " now. <tool", '_call>{"name": "weather", ', '"arguments": {"city": "Oslo"}}',
             "</tool_call>"]
    deltas = [fmt.delta(_piece(p, i == len(parts) - 1)).model_dump() for i, p in enumerate(parts)]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    assert content == "Checking now. "  # "<tool" was held back: it could begin a call
    assert all("tool_calls" not in d["delta"] for d in deltas[:-1])
    (call,) = deltas[-1]["delta"]["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'} and call["id"]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    choice = _format("auto", "hermes").choice(0, [_piece("".join(parts), True)]).model_dump()
    # The response's content is what the stream sent, byte for byte.
    assert choice["message"]["content"] == content and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "weather"
    plain = _format("auto", "hermes").choice(0, [_piece("Just text.", True)]).model_dump()
    assert plain["message"] == {"role": "assistant", "content": "Just text.", "tool_calls": []}
    assert plain["finish_reason"] == "stop"


def test_named_stream_opens_the_call_and_streams_its_arguments() -> None:
    fmt = _format({"type": "function", "function": {"name": "weather"}}, None)
    (opening,) = fmt.opening(1)
    header = opening.model_dump()["delta"]["tool_calls"][0]  # type: ignore[attr-defined]
    assert header["function"] == {"name": "weather", "arguments": ""}
    assert header["index"] == 0 and header["id"]
    chunks = [fmt.delta(_piece(p, i == 1)).model_dump() for i, p in enumerate(['{"city": ', '"Oslo"}'])]
    assert "".join(c["delta"]["tool_calls"][0]["function"]["arguments"] for c in chunks) == '{"city": "Oslo"}'
    assert "id" not in chunks[0]["delta"]["tool_calls"][0]
