"""Tool calls on /v1/chat/completions, in OpenAI's shapes.

`tool_choice` decides how a request's `tools` are used:
- "required" or a named function: the output is constrained (structured outputs) to the calls' JSON, a
  JSON array of {"name", "parameters"} objects (one of the tools each, vLLM's shape) or the named
  function's arguments, so it always parses into `tool_calls`;
- "auto" (the default with tools): the model decides; its own tool-call format is parsed from the text by
  the server's `--tool-call-parser` (`hermes`: `<tool_call>{"name": ..., "arguments": ...}</tool_call>`,
  as Qwen's templates write; `llama3_json`: a JSON object {"name", "parameters"}, optionally after
  `<|python_tag|>`, several separated by ";");
- "none": the tools are only shown to the template, never called.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tp_runtime.errors import InvalidRequestError
from tp_runtime.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ParsedCalls:
    """An output read as tool calls: the text before them (None: none) and each call's (name, arguments
    as JSON text)."""

    content: str | None
    calls: list[tuple[str, str]]


def _bad(message: str, field: str) -> InvalidRequestError:
    return InvalidRequestError(message, field)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools and tool_choice ask for. mode: "none", "auto", "required" or "named"."""

    mode: str
    tools: tuple[Tool, ...]
    named: Tool | None = None
    parser: str | None = None
    parallel: bool = True  # several calls may come back (parallel_tool_calls); False: the first only

    @classmethod
    def of(
        cls, tools: list[dict[str, Any]] | None, tool_choice: Any, parser: str | None, parallel: bool = True
    ) -> ToolPlan | None:
        """None without tools (tool_choice "none"/"auto"/absent); InvalidRequestError naming the field for
        a malformed tool, an unknown named function, or "auto" on a server without a parser."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise _bad("tool_choice needs tools", "tool_choice")
            return None
        parsed = []
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            well_formed = isinstance(tool, dict) and tool.get("type", "function") == "function"
            if not well_formed or not isinstance(function, dict):
                raise _bad(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
            name = function.get("name")
            params = function.get("parameters") or {"type": "object", "properties": {}}
            if not isinstance(name, str) or not name or not isinstance(params, dict):
                raise _bad(
                    f"tools[{i}].function needs a name and a JSON-schema object for parameters", "tools"
                )
            parsed.append(Tool(name, params))
        by_name = {t.name: t for t in parsed}
        if len(by_name) != len(parsed):
            raise _bad("tools have two functions of one name", "tools")
        if tool_choice is None or tool_choice == "auto":
            if parser is None:
                raise _bad(
                    'tool_choice "auto" needs a server started with --tool-call-parser (hermes, '
                    'llama3_json); or ask for "required" or a named function',
                    "tool_choice",
                )
            return cls("auto", tuple(parsed), parser=parser, parallel=parallel)
        if tool_choice in ("none", "required"):
            return cls(tool_choice, tuple(parsed), parallel=parallel)
        function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise _bad(
                'tool_choice must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in by_name:
            raise _bad(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return cls("named", tuple(parsed), named=by_name[name])

    def template_tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model: all of them, "none" included (it only keeps the
        model from calling them), as vLLM passes them by default."""
        return tools

    def constraint(self) -> StructuredOutputsParams | None:
        # Arguments as compact JSON, as OpenAI's models write them.
        if self.mode == "named" and self.named is not None:
            return StructuredOutputsParams(json=self.named.parameters, disable_any_whitespace=True)
        if self.mode == "required":
            # Each tool's parameters sit inside the array's schema: their JSON pointers ($ref "#/$defs/X",
            # as pydantic writes nested models) are made to point from where they now are.
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": t.name},
                        "parameters": rebased(t.parameters, f"#/items/anyOf/{i}/properties/parameters"),
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for i, t in enumerate(self.tools)
            ]
            array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=array, disable_any_whitespace=True)
        return None

    def parse(self, text: str) -> ParsedCalls | None:
        """The finished output's tool calls, or None where it holds none (then it is plain content)."""
        if self.mode == "named" and self.named is not None:
            return ParsedCalls(None, [(self.named.name, text)])
        if self.mode == "required":
            try:
                calls = [
                    (c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)
                ]
            except (ValueError, KeyError, TypeError, RecursionError):
                return None  # cut short (max_tokens), or nested past what json reads: the text as it is
            return ParsedCalls(None, calls)
        if self.mode == "auto":
            found = parse_hermes(text) if self.parser == "hermes" else parse_llama3_json(text)
            if found is not None and not self.parallel:  # as vLLM: the first call, the others dropped
                found = ParsedCalls(found.content, found.calls[:1])
            return found
        return None

    @property
    def keeps_special_tokens(self) -> bool:
        """Hermes' markers are special tokens in some tokenizers: the text must keep them to be parsed (as
        vLLM's parser sets skip_special_tokens=False for a request whose tools may be called)."""
        return self.mode == "auto" and self.parser == "hermes"

    def streamed_content(self, text: str) -> int:
        """How much of a growing output a stream may send as content now (the rest may become a call)."""
        if self.mode in ("named", "required"):
            return 0
        if self.mode == "auto":
            if self.parser == "hermes":
                start = text.find(_HERMES_OPEN)
                if start >= 0:
                    return start
                # A suffix that could begin the marker waits.
                for keep in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):
                    if _HERMES_OPEN.startswith(text[-keep:]):
                        return len(text) - keep
                return len(text)
            stripped = text.lstrip()
            if not stripped or stripped[0] == "{" or _PYTHON_TAG.startswith(stripped[: len(_PYTHON_TAG)]):
                return 0
        return len(text)


# Keys of a JSON schema whose values are data, not schemas, and maps and lists whose values are schemas.
_LITERAL_KEYS = frozenset({"enum", "const", "default", "examples", "example", "required"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def rebased(schema: Any, base: str) -> Any:
    """`schema` with each `$ref` JSON pointer into it ("#", "#/...") made to point from `base`, the pointer
    to where the schema is placed inside another one. Literal values (enum, const, ...) are left alone."""
    if isinstance(schema, list):
        return [rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in _LITERAL_KEYS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: rebased(sub, base) for name, sub in value.items()}
        else:
            out[key] = rebased(value, base)
    return out


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def _call(obj: Any, arguments_key: str) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):  # JSON text already (some models write it so), else a string value
        try:
            json.loads(args)
            return obj["name"], args
        except (ValueError, RecursionError):
            pass
    return obj["name"], json.dumps(args, ensure_ascii=False)


def parse_hermes(text: str) -> ParsedCalls | None:
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return None
    calls = []
    for match in _HERMES_CALL.finditer(text, start):
        try:
            call = _call(json.loads(match.group(1)), "arguments")
        except (ValueError, RecursionError):  # not JSON, or nested past what json reads
            call = None
        if call is None:
            return None  # a malformed call: the text stays content
        calls.append(call)
    # The text before the calls as it is, as a stream sends it (and as vLLM's parser leaves it).
    content = text[:start]
    return ParsedCalls(content or None, calls) if calls else None


_JSON = json.JSONDecoder()


def parse_llama3_json(text: str) -> ParsedCalls | None:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    # Each call is read as one JSON value up to its end, so a ";" inside its arguments (SQL, a shell
    # command) does not split it; calls are separated by ";".
    calls, at = [], 0
    while True:
        try:
            obj, at = _JSON.raw_decode(body, at)
        except (ValueError, RecursionError):
            return None
        call = _call(obj, "parameters")
        if call is None:
            return None
        calls.append(call)
        rest = body[at:].lstrip()
        if not rest:
            return ParsedCalls(None, calls)
        if not rest.startswith(";"):
            return None  # text after a call: the whole output stays content
        rest = rest[1:].lstrip()
        if not rest:  # a trailing ";"
            return ParsedCalls(None, calls)
        at = len(body) - len(rest)


def template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool call as chat templates take it: its arguments as an object (OpenAI's
    are JSON text; none, null or "" is {}), as vLLM gives them."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise InvalidRequestError(
            'a message\'s tool_calls entry needs {"function": {"name", "arguments"}}', "messages"
        )
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        arguments = {}  # a call without arguments
    elif isinstance(arguments, str):
        # Not JSON, or JSON nested past what json reads (RecursionError): given to the template as it is.
        with contextlib.suppress(ValueError, RecursionError):
            arguments = json.loads(arguments)
    return {**call, "function": {**function, "arguments": arguments}}


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"
