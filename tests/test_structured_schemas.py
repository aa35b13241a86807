"""Structured outputs over the range of JSON schemas users send (engine/structured_output.py): on the
random-weight model only the constraint can make an output valid, so every finished sample is validated
against its schema by a hand-written checker (no jsonschema dependency). Schemas whose keywords xgrammar
would silently drop are clear errors before the request enters the engine; valid schemas that xgrammar's
strict mode would refuse compile; a constraint that allows no first token is refused up front."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import re
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

from tp_runtime import LLM, SamplingParams, StructuredOutputsParams
from tp_runtime.engine.structured_output import _document_for_xgrammar
from tp_runtime.errors import InvalidRequestError

pytest.importorskip("xgrammar")


def _is_type(value: Any, kind: str) -> bool:
    return {
        "null": value is None,
        "boolean": isinstance(value, bool),
        "integer": type(value) is int or (type(value) is float and value.is_integer()),
        "number": type(value) in (int, float),
        "string": isinstance(value, str),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
    }[kind]


def _parses(parse: Any, value: str) -> bool:
    try:
        parse(value)
    except ValueError:
        return False
    return True


def _hostname(value: str) -> bool:
    """RFC 1123: dot-separated labels of 1-63 letters, digits and inner hyphens, 253 characters at most."""
    label = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?")
    return len(value) <= 253 and all(len(p) <= 63 and label.fullmatch(p) for p in value.split("."))


# The formats the schemas below use, by independent parsers (RFC 3339's date-time as Python reads ISO 8601,
# with its T and an offset or Z required).
_FORMATS: dict[str, Any] = {
    "ipv4": lambda v: _parses(ipaddress.IPv4Address, v),
    "hostname": _hostname,
    "date": lambda v: bool(re.fullmatch(r"\d{4}-\d\d-\d\d", v)) and _parses(datetime.date.fromisoformat, v),
    "date-time": lambda v: (
        re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", v) is not None
        and _parses(lambda t: datetime.datetime.fromisoformat(t.replace("Z", "+00:00")), v)
    ),
    # RFC 3339's full-time (Python's time reads no second 60, which RFC 3339 has only at 23:59 UTC)
    "time": lambda v: (
        re.fullmatch(r"\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", v) is not None
        and _parses(lambda t: datetime.time.fromisoformat(t.replace("Z", "+00:00")), v)
    ),
}


def validate(value: Any, schema: Any, root: Any = None) -> bool:
    """JSON Schema validation for the keywords the schemas below use (independent of xgrammar)."""
    root = schema if root is None else root
    if schema is True or schema == {}:
        return True
    if schema is False:
        return False
    if "$ref" in schema:
        target = root
        for part in urllib.parse.unquote(schema["$ref"]).lstrip("#/").split("/"):
            if part:
                target = target[part.replace("~1", "/").replace("~0", "~")]
        if not validate(value, target, root):
            return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if "const" in schema and value != schema["const"]:
        return False
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(value, k) for k in kinds):
            return False
    if "anyOf" in schema and not any(validate(value, s, root) for s in schema["anyOf"]):
        return False
    if "oneOf" in schema and sum(validate(value, s, root) for s in schema["oneOf"]) != 1:
        return False
    if "allOf" in schema and not all(validate(value, s, root) for s in schema["allOf"]):
        return False
    if _is_type(value, "number") and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            return False
        if "maximum" in schema and value > schema["maximum"]:
            return False
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            return False
        if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
            return False
        if "multipleOf" in schema and value % schema["multipleOf"] != 0:
            return False
    if isinstance(value, str):
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            return False
        if "format" in schema and not _FORMATS.get(schema["format"], lambda v: True)(value):
            return False
        if "pattern" in schema and not re.search(schema["pattern"], value):
            return False
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
        prefix = schema.get("prefixItems", [])
        for i, item in enumerate(value):
            sub = prefix[i] if i < len(prefix) else schema.get("items", True)
            if not validate(item, sub, root):
                return False
    if isinstance(value, dict):
        if not schema.get("minProperties", 0) <= len(value) <= schema.get("maxProperties", len(value)):
            return False
        if not set(schema.get("required", [])) <= value.keys():
            return False
        if not all(validate(key, schema.get("propertyNames", True), root) for key in value):
            return False
        props = schema.get("properties", {})
        for key, item in value.items():
            sub = props[key] if key in props else schema.get("additionalProperties", True)
            if not validate(item, sub, root):
                return False
    return True


SCHEMAS: list[Any] = [
    {  # $defs / $ref, nested arrays with bounds, integer ranges, additionalProperties false
        "$defs": {"p": {"type": "object",
                        "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
                        "required": ["x"], "additionalProperties": False}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/p"},
                       "b": {"type": "array", "items": {"$ref": "#/$defs/p"}, "minItems": 1, "maxItems": 2}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 3},
               {"type": "null"}]},
    {"enum": ['a"b', 1, None, True, [1, 2], {"z": 1}]},
    {"const": {"q": [1, "two"]}},
    {"type": "array", "minItems": 1, "maxItems": 3,
     "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
               "minItems": 2, "maxItems": 2}},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
     "required": ["id"], "additionalProperties": False},
    {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 13},
    {"type": "number", "minimum": -1.5, "maximum": 2.5},
    {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}, "b": {"type": "boolean"},
                                      "c": {"type": "null"}},
     "required": ["b"], "additionalProperties": False},
    {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 100},
    # enum beside a type: only the values of that type may come out (xgrammar alone gave `1` here).
    {"type": "string", "enum": ["a", 1, "bc"]},
    {"type": ["boolean", "null"], "enum": [True, 0, None, "x"]},
    # minItems with no items schema: any items (xgrammar's strict mode refused it).
    {"type": "array", "minItems": 2, "maxItems": 3},
    # What xgrammar enforces, and the pre-check once refused: multipleOf on a nullable integer, OpenAPI's
    # annotations (nullable, x-...) beside enum and $ref, an "enum with descriptions" under a type.
    {"type": ["integer", "null"], "multipleOf": 4, "minimum": 1, "maximum": 50},
    {"type": "string", "enum": ["up", "down"], "nullable": True, "example": "up"},
    {"$defs": {"X": {"type": "boolean"}}, "$ref": "#/$defs/X", "x-order": 1},
    {"type": "string", "oneOf": [{"const": "a", "title": "A"}, {"const": "bb", "description": "B"}]},
    {"type": "array", "prefixItems": [{"type": "boolean"}], "minItems": 1, "maxItems": 1},
    # required names beyond properties: xgrammar left them out (and made "a" required instead)
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["z"],
     "additionalProperties": {"type": "boolean"}},
    {"type": "object", "required": ["k"]},
    # a name's string keywords need no type (they were refused)
    {"type": "object", "propertyNames": {"pattern": "^[a-c]+$"}, "additionalProperties": {"type": "null"},
     "maxProperties": 2},
    # a fractional multipleOf on integers: xgrammar dropped it (2.5 gave 7); the multiples of 5 are these
    {"type": "integer", "multipleOf": 2.5, "minimum": -60, "maximum": 60},
    # a quote or a backslash in a class beside other characters: xgrammar leaves them out (valid JSON)
    {"type": "string", "pattern": '^["x-z]{2}$'},
    {"type": "number", "minimum": 0, "maximum": 1e-6},  # (0 and 0.000001 fit, at 6 decimals)
    {"type": "object", "propertyNames": {"pattern": '^[^"\\\\]{1,3}$'},
     "additionalProperties": {"type": "null"}, "maxProperties": 2},
    # formats whose xgrammar rules let invalid strings out ("004.163.088.191", 277-character labels,
    # "2023-02-29"): written as patterns of valid ones
    {"type": "array", "items": {"type": "string", "format": "ipv4"}, "minItems": 2, "maxItems": 2},
    {"type": ["string", "null"], "format": "hostname"},
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                      "t": {"type": "string", "format": "date-time"}},
     "required": ["d", "t"], "additionalProperties": False},
    # oneOf whose branches no value can match together: by type, by literal, by a required const (the
    # discriminated union pydantic writes)
    {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 2},
               {"const": None}]},
    {"$defs": {"Cat": {"type": "object", "required": ["kind", "lives"], "additionalProperties": False,
                       "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}}},
               "Dog": {"type": "object", "required": ["kind"], "additionalProperties": False,
                       "properties": {"kind": {"enum": ["dog"]}, "good": {"type": "boolean"}}}},
     "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
     "discriminator": {"propertyName": "kind"}},
    # the same with percent-encoded pointers (RFC 6901 in a URI fragment): "A%20b" is the key "A b"
    {"$defs": {"A b": {"type": "integer", "minimum": 0, "maximum": 9}, "C%": {"type": "boolean"}},
     "oneOf": [{"$ref": "#/$defs/A%20b"}, {"$ref": "#/$defs/C%25"}]},
    {"type": "string", "pattern": "^ab$|^c+$"},  # anchors at each alternative's ends
    # fractional bounds on integers (xgrammar refused them): the integers between
    {"type": "object", "required": ["a", "b"], "additionalProperties": False,
     "properties": {"a": {"type": "integer", "minimum": 1.5, "maximum": 4.5},
                    "b": {"type": ["integer", "null"], "exclusiveMinimum": -0.5, "exclusiveMaximum": 2.5}}},
    # a target inside another target: rewritten there too, whichever $ref comes first ("2023-02-29" passed)
    {"type": "object", "required": ["a", "b"], "additionalProperties": False,
     "properties": {"a": {"$ref": "#/components/schemas/A"}, "b": {"$ref": "#/components/schemas/A/x-in/B"}},
     "components": {"schemas": {"A": {"type": "integer", "minimum": 0, "maximum": 9,
                                      "x-in": {"B": {"type": "string", "format": "date"}}}}}},
    # the whole document a $ref into OpenAPI's components (which may sit beside it, as $defs may)
    {"$ref": "#/components/schemas/D",
     "components": {"schemas": {"D": {"type": "string", "format": "date"}}}},
    # OpenAPI's components: a $ref into a place no subschema walk reaches, whose target's format is
    # rewritten as it is in place (an ipv4 with leading zeros broke it), and a chain of such refs.
    {"type": "object", "required": ["ip", "n"], "additionalProperties": False,
     "properties": {"ip": {"$ref": "#/components/schemas/Ip"}, "n": {"$ref": "#/components/schemas/N"}},
     "components": {"schemas": {"Ip": {"type": "string", "format": "ipv4"},
                                "N": {"$ref": "#/components/schemas/Small"},
                                "Small": {"type": "integer", "minimum": 0, "maximum": 9}}}},
]  # fmt: skip


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM("tiny-llama-tp", device="cpu", max_model_len=512) as engine:
        yield engine


def _spec(**constraint: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(**constraint)


def test_every_finished_sample_validates_against_its_schema(llm: LLM) -> None:
    params = [
        SamplingParams(max_tokens=200, seed=seed,
                       structured_outputs=_spec(json=schema, disable_any_whitespace=seed % 2 == 0))
        for schema in SCHEMAS for seed in range(3)
    ]  # fmt: skip
    outs = llm.generate(["Answer:"] * len(params), params, use_tqdm=False)
    for i, out in enumerate(outs):
        schema, sample = SCHEMAS[i // 3], out.outputs[0]
        assert sample.finish_reason in ("stop", "length"), sample
        if sample.finish_reason == "stop":
            assert validate(json.loads(sample.text, strict=False), schema), (schema, sample.text)
    for k in range(len(SCHEMAS)):  # each schema finished at least once
        assert any(o.outputs[0].finish_reason == "stop" for o in outs[3 * k : 3 * k + 3]), SCHEMAS[k]


UNENFORCEABLE: list[Any] = [
    {"type": "integer", "not": {"const": 1}},
    {"allOf": [{"type": "string"}, {"maxLength": 2}]},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]},
     "then": {"required": ["b"]}},
    {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2, "uniqueItems": True},
    {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
    {"type": "number", "multipleOf": 0.5},
    {"type": "string", "pattern": "^a+$", "maxLength": 3},
    {"type": "string", "format": "date", "maxLength": 3},
    {"minimum": 5, "maximum": 6},
    {"maxLength": 2},
    {"type": "integer", "enum": [1, 50], "maximum": 10},
    {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
     "anyOf": [{"required": ["a"]}]},
    {"type": "string", "oneOf": [{"maxLength": 1}, {"minLength": 3}]},
    {"type": "object", "properties": {"deep": {"type": "array", "items": {"not": {"type": "null"}}}}},
    {"type": "string", "enum": [1, 2]},
    {"type": "string", "anyOf": [{"const": "a"}, {"type": "integer"}]},  # the type would be dropped
    {"type": "string", "oneOf": [{"const": "a"}, {"const": 3}]},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"],
     "additionalProperties": False},
    {"minItems": 2},  # array and object keywords without a type (xgrammar gave any value)
    {"maxProperties": 0},
    # propertyNames applies to additional names only in xgrammar: a listed name it refuses came out.
    {"type": "object", "properties": {"long_name": {"type": "integer"}}, "propertyNames": {"maxLength": 3}},
    {"type": "object", "required": ["xy"], "propertyNames": {"pattern": "^a"}},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "propertyNames": {"format": "email"}},
    {"type": "integer", "multipleOf": 2048},  # xgrammar drops a multipleOf past 1024
    # xgrammar enforces an integer multipleOf with both bounds at most 9999 apart, or none: it dropped it
    # beside one bound (this one gave 2004) and between bounds further apart.
    {"type": "integer", "multipleOf": 5, "minimum": 3},
    {"type": ["integer", "null"], "multipleOf": 4, "exclusiveMaximum": -3},
    {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 10000},
    {"type": ["integer", "null"], "multipleOf": 1e30},
    # A pattern that names a quote or a backslash: xgrammar wrote it unescaped, invalid JSON (`a"b` gave
    # `"a"b"`, a Windows path `"C:\x"`); one with a lookahead: xgrammar ignored it (this one gave "abc").
    {"type": "string", "pattern": 'a"b'},
    {"type": "string", "pattern": "^C:\\\\[a-z]+$"},
    {"type": "string", "pattern": "^[\\x22]$"},
    {"type": "object", "patternProperties": {'^"': {"type": "integer"}}, "additionalProperties": False},
    {"type": "object", "properties": {"pw": {"type": "string", "pattern": "^(?=.*[A-Z]).{3}$"}}},
    # An escape xgrammar does not know: it matched the letter itself (`\\Z`, the end of the text, gave "12Z").
    {"type": "string", "pattern": "^[0-9]+\\Z"},
    # A number range with no number of 6 decimals: xgrammar's grammar for it was the empty text ("" and
    # `{"x": }` finished "stop").
    {"type": "number", "minimum": 1e-7, "maximum": 2e-7},
    # $ref beyond this schema (a URL, another file, an $anchor): xgrammar took any value in its place.
    {"$ref": "https://example.com/s.json"},
    {"type": "object", "properties": {"x": {"$ref": "other.json#/$defs/x"}}, "required": ["x"]},
    {"$defs": {"a": {"$anchor": "A", "type": "null"}}, "$ref": "#A"},
    # ... and JSON pointers into places no subschema walk reaches (OpenAPI's components): their targets
    # escaped every check (uniqueItems gave [0, 0, 0], "not" gave the value it excludes).
    {"type": "object", "properties": {"v": {"$ref": "#/components/D"}}, "required": ["v"],
     "components": {"D": {"type": "array", "uniqueItems": True, "items": {"type": "integer"}}}},
    {"type": "object", "properties": {"v": {"$ref": "#/components/a/b"}}, "required": ["v"],
     "components": {"a": {"b": {"$ref": "#/x~1y"}}}, "x/y": {"type": "integer", "not": {"const": 0}}},
    {"type": "array", "items": {"$ref": "#/properties/p/enum/0"},
     "properties": {"p": {"enum": [{"type": "number", "multipleOf": 0.5}]}}},
    {"type": "integer", "minimum": 1.2, "maximum": 1.8},  # (no integer between)
    # a pointer percent-encoded, as a URI fragment is (xgrammar decodes it; it escaped the checks)
    {"type": "object", "properties": {"a": {"$ref": "#/components/schemas/A%20B"}}, "required": ["a"],
     "components": {"schemas": {"A B": {"type": "array", "items": {"type": "integer"},
                                        "uniqueItems": True}}}},
    # a place the rewrite does not keep (a patternProperties key written anew for xgrammar)
    {"type": "object", "properties": {"s": {"$ref": "#/patternProperties/^a(b)?$/x-defs/S"}},
     "patternProperties": {"^a(b)?$": {"type": "integer", "x-defs": {"S": {"type": "string"}}}}},
    # ... also where the walk reaches it (xgrammar said "Cannot find field"): a renamed key, and draft 7's
    # additionalItems, which is 2020-12's items after the rewrite
    {"type": "object", "properties": {"x": {"$ref": "#/patternProperties/^a(b)?$"}},
     "patternProperties": {"^a(b)?$": {"type": "integer"}}},
    {"type": "object", "properties": {"u": {"$ref": "#/properties/t/additionalItems"},
     "t": {"type": "array", "items": [{"type": "integer"}], "additionalItems": {"type": "string"}}}},
    {"type": "array", "items": {"$ref": "#/properties/p/const"},
     "properties": {"p": {"type": "object", "const": {"type": "integer"}}}},
    {"type": "object", "properties": {"x": {"type": ["number", "null"], "exclusiveMinimum": 0,
                                            "exclusiveMaximum": 1e-6}}, "required": ["x"]},
    # oneOf whose branches a value can match together: xgrammar takes it as anyOf (the first gave 2004,
    # the second 6, both valid under both branches)
    {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                      {"type": "integer", "minimum": 5, "maximum": 20}]}}},
    {"oneOf": [{"type": "object", "properties": {"a": {"const": 1}}}, {"type": "object"}]},
    {"oneOf": [{"enum": [1, 2]}, {"const": 2.0}]},
    # an anchor inside a pattern: xgrammar ignores it ("a$b", which nothing matches, gave "ab")
    {"type": "string", "pattern": "a$b"},
    {"type": "string", "pattern": "^x(^y)"},
    {"type": "string", "format": "ipv4", "pattern": "^1"},  # (the format is written as a pattern)
    # JSON Schema's formats xgrammar has no rule for: it took any string ("idn-email" gave a URL)
    {"type": "string", "format": "idn-email"},
    {"type": "object", "properties": {"h": {"type": ["string", "null"], "format": "idn-hostname"}}},
    {"type": "array", "items": {"type": "string", "format": "iri"}},
    {"type": "string", "format": "iri-reference"},
    {"type": "string", "format": "regex"},
    # oneOf branches told apart by a const only where both are objects: null matched both of these
    {"oneOf": [{"type": ["object", "null"], "properties": {"k": {"const": 1}}, "required": ["k"]},
               {"type": ["object", "null"], "properties": {"k": {"const": 2}}, "required": ["k"]}]},
    # what xgrammar misreads in a pattern: a control character (written raw: invalid JSON), a possessive
    # quantifier, a class that begins with "]", an octal escape, an anchor in a repeated group, a
    # character past U+FFFF
    {"type": "string", "pattern": "^a\\nb$"},
    {"type": "string", "pattern": "^[\\x00-\\x1f]$"},
    {"type": "string", "pattern": "1*+1"},
    {"type": "string", "pattern": "^[]a]$"},
    {"type": "string", "pattern": "^\\01$"},
    {"type": "string", "pattern": "^(a$)*$"},
    {"type": "string", "pattern": "^\U0001F600$"},
    # ... an escaped character past ASCII, half an escape, an escaped surrogate pair (xgrammar matched
    # its CESU-8 bytes), \p in a class (read as its letters), Python's {,n}, a control escape, a class of
    # control characters only (xgrammar wrote them raw)
    {"type": "string", "pattern": "^\\é.$"},
    {"type": "string", "pattern": "^\\x.$"},
    {"type": "string", "pattern": "^\\ud83d\\ude00$"},
    {"type": "string", "pattern": "^[\\p{L} ]+$"},
    {"type": "string", "pattern": "^x{,3}$"},
    {"type": "string", "pattern": "^\\cJ$"},
    {"type": "string", "pattern": "^[\\x00-\\x1f]$"},
]  # fmt: skip


def test_keywords_xgrammar_would_drop_are_clear_errors_and_the_batch_serves_on(llm: LLM) -> None:
    """Each of these schemas compiled before, and xgrammar dropped a keyword: outputs broke the schema
    (`{"maxLength": 2}` gave `18`, uniqueItems gave `[1, 1]`, the enum beside maximum 10 gave `50`)."""
    for schema in UNENFORCEABLE:
        spec = _spec(json=schema)
        with pytest.raises(InvalidRequestError, match="not supported") as info:
            llm.engine.grammars.compile(spec)
        assert info.value.field == "json"
        good = SamplingParams(max_tokens=8, seed=1, structured_outputs=_spec(choice=["ok", "fine"]))
        bad = SamplingParams(max_tokens=8, seed=1, structured_outputs=spec)
        with pytest.raises(InvalidRequestError, match="not supported"):
            llm.generate(["x", "x"], [good, bad], use_tqdm=False)
    out = llm.generate(["x"], good, use_tqdm=False)[0].outputs[0]
    assert out.text in ("ok", "fine") and out.finish_reason == "stop"
    # Annotations beside $ref / anyOf are fine (pydantic writes them); so are listed names that fit
    # propertyNames.
    for schema in (
        {"type": "object", "properties": {"abc": {"type": "integer"}}, "required": ["abc"],
         "propertyNames": {"pattern": "^[a-c]+$"}},
        {"$defs": {"s": {"type": "boolean"}}, "$ref": "#/$defs/s", "description": "d", "title": "t"},
        {"anyOf": [{"type": "boolean"}, {"type": "null"}], "default": None, "title": "x"},
        {"type": "integer", "multipleOf": 5, "exclusiveMinimum": -1, "exclusiveMaximum": 10000},
        # formats outside JSON Schema's own (OpenAPI's) are annotations, which validators ignore
        {"type": "object", "properties": {"n": {"type": "integer", "format": "int32"},
                                          "p": {"type": "string", "format": "password"}}},
    ):
        llm.engine.grammars.compile(_spec(json=schema))


# Schemas whose outputs broke them, each refused now: a listed name that a patternProperties pattern also
# matches (JSON Schema checks both schemas; xgrammar the listed one: 4328 beside maximum 9), an integer
# past 64 bits in an enum (xgrammar wrote 1.8446744073709552e+19).
OVERLAPS_AND_WIDE: list[Any] = [
    {"type": "object", "properties": {"n_items": {"type": "integer"}}, "required": ["n_items"],
     "patternProperties": {"^n_": {"type": "integer", "maximum": 9}}, "additionalProperties": False},
    {"type": "object", "required": ["n_x"], "patternProperties": {"_x$": {"type": "integer"}},
     "additionalProperties": {"type": "string"}},
    {"type": "object", "properties": {"id": {"enum": [18446744073709551617, 1]}}},
    {"const": {"a": [-(2**63) - 1]}},
]  # fmt: skip


def _all_refused(llm: LLM, schemas: list[Any], says: str) -> None:
    for schema in schemas:
        with pytest.raises(InvalidRequestError, match=says) as info:
            llm.engine.grammars.compile(_spec(json=schema))
        assert info.value.field == "json"


def test_overlapping_names_and_wide_integers_are_refused(llm: LLM) -> None:
    _all_refused(llm, OVERLAPS_AND_WIDE, "not supported")
    # Fine: a pattern that matches none of the listed names (read as ECMA-262 reads it: ASCII classes,
    # `(?<name>` groups), one whose schema adds nothing to the listed one's, integers that fit 64 bits.
    name = {"type": "string"}
    for pattern, sub in [("^n_", {"type": "integer"}), (".*", {}), (".*", True), (".*", name),
                         ("^\\w+$", {"type": "integer"}), ("^(?<p>X)-", {"type": "integer"})]:  # fmt: skip
        schema = {"type": "object", "properties": {"café": name}, "patternProperties": {pattern: sub}}
        llm.engine.grammars.compile(_spec(json=schema))
    llm.engine.grammars.compile(_spec(json={"enum": [2**63 - 1, -(2**63), 2**53 + 1]}))


def test_hostile_schemas_are_refused_or_checked_in_bounded_time(llm: LLM) -> None:
    """Schemas made to hurt the checks or xgrammar: a pattern of 30,000 nested groups crashed the process
    inside xgrammar; a pattern that backtracks exponentially (`(a|a)*$`) against a long property name held
    a compile thread for minutes in Python's re; a oneOf of 2,000 consts took 15 s to be told apart, pair
    by pair; an integer bound past a float's range raised OverflowError."""
    deep = "(" * 30_000 + "a" + ")" * 30_000
    for schema in ({"type": "string", "pattern": deep},
                   {"type": "object", "patternProperties": {deep: {"type": "integer"}}},
                   {"type": "object", "propertyNames": {"pattern": deep}}):  # fmt: skip
        with pytest.raises(InvalidRequestError, match="nested 30000 deep"):
            llm.engine.grammars.compile(_spec(json=schema))
    with pytest.raises(InvalidRequestError, match="nested"):
        llm.engine.grammars.compile(_spec(regex=deep))
    llm.engine.grammars.compile(_spec(json={"type": "string", "pattern": "(" * 20 + "a" + ")" * 20}))

    name = "a" * 40 + "!"
    slow = [  # a search that cannot finish counts as a possible match (refused), or an unknown fit
        {"type": "object", "properties": {name: {"type": "integer"}},
         "patternProperties": {"^(a|a)*$": {"type": "string"}}},
        {"type": "object", "properties": {name: {"type": "integer"}},
         "propertyNames": {"pattern": "^(a|a)*$"}},
    ]  # fmt: skip
    for schema in slow:
        start = time.perf_counter()
        with pytest.raises(InvalidRequestError, match="searches in its property names take more than"):
            llm.engine.grammars.compile(_spec(json=schema))
        assert time.perf_counter() - start < 5
    # The same patterns against a name they do not match quickly are checked as before.
    fine = {
        "type": "object", "properties": {"b": {"type": "integer"}}, "propertyNames": {"pattern": "^(a|b)*$"},
        "patternProperties": {"^(a|a)*$": {"type": "string"}},
    }  # fmt: skip
    llm.engine.grammars.compile(_spec(json=fine))

    start = time.perf_counter()
    llm.engine.grammars.compile(_spec(json={"oneOf": [{"const": i} for i in range(2000)]}))
    twice = [{"const": i} for i in range(1999)] + [{"enum": ["x", 5.0]}]  # 5.0 is 5
    with pytest.raises(InvalidRequestError, match="could match together"):
        llm.engine.grammars.compile(_spec(json={"oneOf": twice}))
    assert time.perf_counter() - start < 10
    many = [{"type": "object", "properties": {"k": {"const": i}}, "required": ["k"]} for i in range(700)]
    with pytest.raises(InvalidRequestError, match="too many to check apart"):
        llm.engine.grammars.compile(_spec(json={"oneOf": many}))
    _document_for_xgrammar({"oneOf": many[:300]})  # few enough: told apart by "k", pair by pair
    # Branches that $ref consts are consts too, however many.
    consts = {"$defs": {f"c{i}": {"const": f"v{i}"} for i in range(700)},
              "oneOf": [{"$ref": f"#/$defs/c{i}"} for i in range(700)]}  # fmt: skip
    _document_for_xgrammar(consts)
    # The search budget is search time: a long schema's other checks do not use it up.
    wide = {"type": "object", "properties": {
        **{f"p{i}": {"type": "string", "pattern": "^[a-z]{1,8}$"} for i in range(6000)},
        "o": {"type": "object", "properties": {"x": {}}, "patternProperties": {"^y_": {"type": "string"}}},
    }}  # fmt: skip
    _document_for_xgrammar(wide)

    huge = 10**400
    for schema in ({"type": "number", "minimum": huge}, {"type": "number", "maximum": -huge},
                   {"type": "integer", "minimum": 1.5, "maximum": huge}):  # fmt: skip
        with contextlib.suppress(InvalidRequestError):  # refused with a message, or compiled: not a crash
            llm.engine.grammars.compile(_spec(json=schema))


# Invalid schemas that xgrammar compiled all the same, into grammars that break them: an empty anyOf or
# oneOf (no value is valid) came out as an empty value ("", `{"a": }`, `[,]`), maxLength -1 as no limit,
# and `"type": []` (no value is valid) as any value.
INVALID: list[Any] = [
    {"anyOf": []},
    {"type": "object", "properties": {"a": {"oneOf": []}}, "required": ["a"]},
    {"$defs": {"n": {"anyOf": []}}, "type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1},
    {"type": "string", "maxLength": -1},
    {"type": "object", "properties": {"a": {"type": "array", "minItems": -1}}},
    {"type": []},
]  # fmt: skip


def test_invalid_schemas_xgrammar_would_take_are_clear_errors(llm: LLM) -> None:
    _all_refused(llm, INVALID, "JSON schema is not valid")


def test_constraints_that_allow_no_output_are_refused_up_front(llm: LLM) -> None:
    """Before: such a request entered the engine, sampled a token its grammar refused, and was aborted."""
    for constraint, field in (({"regex": r"[^\s\S]"}, "regex"),
                              ({"grammar": r"root ::= [^\x00-\U0010FFFF]"}, "grammar")):  # fmt: skip
        params = SamplingParams(max_tokens=8, seed=0, structured_outputs=_spec(**constraint))
        with pytest.raises(InvalidRequestError, match="allows no output") as info:
            llm.generate(["x"], params, use_tqdm=False)
        assert info.value.field == field
    # The empty output is an output: the grammar may end at once.
    out = llm.generate(["x"], SamplingParams(max_tokens=8, structured_outputs=_spec(regex="a{0}")),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert (out.text, out.finish_reason) == ("", "stop")


def test_special_tokens_are_never_text_to_a_grammar(llm: LLM) -> None:
    """xgrammar read <s>, </s>, <unk> as their literal text, while the output text leaves them out: a JSON
    string took <s>, and the regex <.{1,5}> took </s> (EOS) first, an empty text finished "stop"."""
    import xgrammar

    grammars, tokenizer = llm.engine.grammars, llm.get_tokenizer()
    special = sorted(set(tokenizer.all_special_ids))
    assert special
    quote = tokenizer.convert_tokens_to_ids('"')
    for spec, prefix in ((_spec(regex="<.{1,5}>"), []), (_spec(json={"type": "string"}), [quote])):
        state = grammars.matcher(grammars.compile(spec))
        assert all(state.accept(token) for token in prefix)
        bitmask = xgrammar.allocate_token_bitmask(1, grammars.vocab_size)
        state.fill(bitmask, 0)
        words = bitmask[0].tolist()
        assert [i for i in special if words[i // 32] >> (i % 32) & 1] == [], spec
    spec = _spec(regex="<.{1,5}>")
    params = [SamplingParams(max_tokens=40, seed=s, structured_outputs=spec) for s in range(8)]
    for out in llm.generate(["Answer:"] * len(params), params, use_tqdm=False):
        sample = out.outputs[0]
        assert sample.finish_reason == "length" or re.fullmatch("<.{1,5}>", sample.text, re.S), sample.text


def _takes(llm: LLM, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether the compiled constraint takes `text` (a JSON text with its characters past ASCII as they are:
    the grammar writes them so) as a whole output (its tokens, then EOS)."""
    grammars, tokenizer = llm.engine.grammars, llm.get_tokenizer()
    state = grammars.matcher(grammars.compile(spec))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(state.accept(i) for i in ids) and state.accept(tokenizer.eos_token_id) and state.finished


@pytest.mark.parametrize(
    ("schema", "valid", "invalid"),
    [
        # xgrammar read an optional group ending in a repeat as if its start were optional too
        ({"type": "string", "pattern": "^a(x[0-9]{1,3})?b$"}, ["ab", "ax12b"], ["a1b", "axb"]),
        ({"type": "string", "pattern": "^v(-rc[0-9]+)?$"}, ["v", "v-rc12"], ["v12", "vrc1"]),
        ({"type": "string", "format": "ipv4"}, ["10.0.0.1", "255.255.255.255"], ["010.0.0.1", "1.2.3.256"]),
        ({"type": "string", "format": "hostname"}, ["a.example", "x-1"], ["a" * 64 + ".com", "-a.com"]),
        ({"type": "string", "format": "date"}, ["2024-02-29", "2000-02-29"], ["2023-02-29", "2023-04-31"]),
        ({"type": "string", "format": "date-time"}, ["2024-01-01T00:00:00.5Z", "2024-02-29T23:59:59+05:30"],
         ["2024-01-01T00:00:005Z", "1900-02-29T00:00:00Z"]),
        # xgrammar's time took a second 60 at any minute
        ({"type": "string", "format": "time"}, ["04:41:59.42+12:44", "23:59:00Z"],
         ["04:41:60Z", "24:00:00Z"]),
        # ECMA-262 reads "{ 1}" as text (xgrammar read it as a count); characters past ASCII and a "]"
        # outside a class as themselves
        ({"type": "string", "pattern": "^a{ 1}$"}, ["a{ 1}"], ["a"]),
        ({"type": "string", "pattern": "^é[^é]]$"}, ["éa]", "éb]"], ["éé]", "a]"]),
        ({"type": "string", "pattern": "^[А-Я]+$"}, ["АБ"], ["аб", "A"]),
        # classes that leave control characters out, as they should be (they were refused)
        ({"type": "string", "pattern": "^[^\\r\\n]+$"}, ["a b"], ["a\nb"]),
        ({"type": "string", "pattern": "^[\\t a-z]+$"}, ["a b"], ["a-b"]),
    ],
)  # fmt: skip
def test_patterns_and_formats_take_exactly_their_strings(
    llm: LLM, schema: dict[str, Any], valid: list[str], invalid: list[str]
) -> None:
    """Each valid string (checked by Python's re, ipaddress, datetime first) is a complete output; no
    invalid one is."""
    for text in valid:
        assert validate(text, schema), text
        assert _takes(llm, _spec(json=schema), json.dumps(text, ensure_ascii=False)), text
    for text in invalid:
        assert not validate(text, schema), text
        assert not _takes(llm, _spec(json=schema), json.dumps(text, ensure_ascii=False)), text


@pytest.mark.parametrize("pattern", ["^é.$", ".]", "^[^é]$", '^["é]$', "^[^a]{2}$", "^\x7f.$", "^[^\\n]+$"])
def test_a_pattern_never_lets_out_invalid_json(llm: LLM, pattern: str) -> None:
    """A character past ASCII or a "]" in a pattern turned off xgrammar's JSON escaping for the whole
    string: `^é.$` took a raw quote, `.]` a raw tab. No JSON string may hold a raw quote, backslash or
    control character."""
    spec = _spec(json={"type": "string", "pattern": pattern})
    for inner in ('é"', "é\\", "é\t", '"]', "\t]", '"', "\\", '""', "\n\n"):
        assert not _takes(llm, spec, f'"{inner}"'), (pattern, inner)


@pytest.mark.parametrize("pattern", ["^.$", "^a.b$", "^(.)$", "^[a.]$"])
def test_a_patterns_dot_takes_no_line_terminator(llm: LLM, pattern: str) -> None:
    """ECMA-262's `.` (a JSON schema pattern's) matches no line terminator (LF, CR, U+2028, U+2029);
    xgrammar's let a raw U+2028 and U+2029 out, which a JavaScript validator refuses."""
    spec = _spec(json={"type": "string", "pattern": pattern})

    def texts(middle: str) -> list[str]:
        value = "a" + middle + "b" if pattern == "^a.b$" else middle
        return [json.dumps(value), json.dumps(value, ensure_ascii=False)]  # escaped, and raw where JSON may

    for terminator in ("\n", "\r", "\u2028", "\u2029"):
        assert [t for t in texts(terminator) if _takes(llm, spec, t)] == [], repr(terminator)
    # A patternProperties key keeps its dots: it is a name a $ref may point at too.
    keyed = {"type": "object", "patternProperties": {"^a.$": {"type": "integer"}}, "required": ["x"],
             "properties": {"x": {"$ref": "#/patternProperties/^a.$"}}, "additionalProperties": False}
    assert _takes(llm, _spec(json=keyed), '{"x": 1}') and not _takes(llm, _spec(json=keyed), '{"x": "s"}')
    for other in ("a", "é", "\u0085"):
        want = pattern != "^[a.]$" or other == "a"  # (a dot in a class is a dot)
        assert _takes(llm, spec, texts(other)[1]) == want, repr(other)  # (xgrammar writes them raw)


@pytest.mark.parametrize(
    ("schema", "low", "high"),
    [
        ({"type": "string", "minLength": 2, "maxLength": 3}, 2, 3),
        ({"type": "string", "maxLength": 512}, 0, 512),
        ({"type": ["string", "null"], "minLength": 1}, 1, None),
        ({"type": "string", "maxLength": 8000}, 0, 8000),
        ({"type": "string", "minLength": 600}, 600, None),
        ({"type": "string", "minLength": 3, "maxLength": 4096}, 3, 4096),
        # a bound of one: xgrammar writes the class as an optional rule, or inline between the quotes
        ({"type": "string", "maxLength": 1}, 0, 1),
        ({"type": "string", "minLength": 1, "maxLength": 1}, 1, 1),
        ({"type": ["string", "null"], "maxLength": 1}, 0, 1),
    ],
)  # fmt: skip
def test_length_bounded_strings_take_no_control_character(
    llm: LLM, schema: dict[str, Any], low: int, high: int | None
) -> None:
    """xgrammar's own rule for a string with minLength/maxLength let raw control characters in (a tab,
    U+0017): an output that finished "stop" was no JSON; at any bound (a pattern for bounds to 512 had
    kept them out, but longer ones went to xgrammar's rule: as a pattern, compile time grows with the
    square of the bound, 45 s at 8,000). xgrammar's one-character rule is now a JSON string character's,
    escapes included, each counted as one character as JSON Schema counts them."""
    spec = _spec(json=schema)
    for control in ("\t", "\x17", "\n", "\x00"):
        for value in ("a" * max(low, 1) + control, control):
            assert not _takes(llm, spec, '"' + value + '"'), repr(value)  # raw: no JSON
    for n in sorted({low - 1, low, low + 1, 12, (high or 12) + 1}):
        fits = low <= n <= (high if high is not None else n) and n >= 0
        if 0 <= n <= max(low + 1, 12):
            assert _takes(llm, spec, json.dumps("é" * n, ensure_ascii=False)) == fits, n
    # escapes: quote, backslash, a control character and a \u escape, each one character of the bound
    escaped = json.dumps('"\\\t\x17' + "a" * max(0, low - 4))
    assert _takes(llm, spec, escaped) == (high is None or max(low, 4) <= high), escaped
    for one in ('"', "\\", "\t", "\x17"):  # each escape alone: one character
        assert _takes(llm, spec, json.dumps(one)) == (low <= 1 and (high is None or high >= 1)), repr(one)
    if high is not None and high <= 600:
        assert not _takes(llm, spec, json.dumps("\t" * (high + 1))), "one escape past the bound"
    # A surrogate pair's escapes are one character (one code point, as JSON Schema counts); a lone
    # surrogate is no text at all.
    one_character = low <= 1 and (high is None or high >= 1)
    for pair in ("\\ud83d\\ude00", "\\uD83D\\uDE00", "😀"):
        assert _takes(llm, spec, f'"{pair}"') == one_character, pair
        if high is not None and high <= 12:
            assert not _takes(llm, spec, '"' + pair * (high + 1) + '"'), pair
    for lone in ("\\ud83d", "\\ude00", "\\ude00\\ud83d", "\\ud83da"):
        assert not _takes(llm, spec, f'"{lone}"' if low <= 1 else f'"{lone}{"b" * low}"'), lone


def test_only_json_strings_get_the_json_string_character(llm: LLM) -> None:
    """A structural tag's regex with the class xgrammar writes a bounded JSON string's character with keeps
    its own language (a raw tab, no escapes), beside a length-bounded JSON string that gets the JSON rule;
    and a token named by its text still resolves (the tag is compiled with the tokenizer)."""
    regex = '"[^"\\\\\\r\\n]{1,8}"'  # quote, up to 8 of anything but a quote, backslash or line end, quote
    bounded = {"type": "string", "maxLength": 4}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "regex", "pattern": regex}, {"type": "const_string", "value": "="},
        {"type": "json_schema", "json_schema": bounded}]}}  # fmt: skip
    spec = _spec(structural_tag=tag)
    assert _takes(llm, spec, '"a\tb"="ab"') and not _takes(llm, spec, '"a\\nb"="ab"')
    assert _takes(llm, spec, '"ab"="a\\nb"') and not _takes(llm, spec, '"ab"="a\tb"')
    tokenizer = llm.get_tokenizer()
    token = tokenizer.convert_ids_to_tokens(tokenizer.encode("hello", add_special_tokens=False))[0]
    named = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "json_schema", "json_schema": bounded}, {"type": "token", "token": token}]}}  # fmt: skip
    assert llm.engine.grammars.compile(_spec(structural_tag=named)) is not None
    # One character, exactly or at most: xgrammar writes those as a JSON schema's one-character string
    # (inline, or an optional rule), which only a schema's own grammar rewrites.
    for one in ('"[^"\\\\\\r\\n]"', '"[^"\\\\\\r\\n]?"'):
        spec = _spec(structural_tag={"type": "structural_tag", "format": {"type": "regex", "pattern": one}})
        assert _takes(llm, spec, '"\t"') and not _takes(llm, spec, '"\\n"'), one
    grammar = 'root ::= "\\"" c "\\""\nc ::= "" | [^"\\\\\\r\\n]'
    spec = _spec(structural_tag={"type": "structural_tag", "format": {"type": "grammar", "grammar": grammar}})
    assert _takes(llm, spec, '"\t"') and not _takes(llm, spec, '"\\n"')


def test_length_bounded_property_names_take_no_control_character(llm: LLM) -> None:
    names = {"maxLength": 4}
    spec = _spec(json={"type": "object", "propertyNames": names, "additionalProperties": {"type": "integer"}})
    assert _takes(llm, spec, '{"abcd": 1}') and not _takes(llm, spec, '{"abcde": 1}')
    assert not _takes(llm, spec, '{"a\tb": 1}')


@pytest.mark.parametrize("where", ["items", "additionalProperties", "anyOf", "propertyNames"])
def test_one_character_strings_take_no_control_character_wherever_they_sit(llm: LLM, where: str) -> None:
    """A string of at most one character is written by xgrammar without the repeat the other bounds get
    (its class optional, or inline between the quotes); it took a raw U+001D, in a tool's argument too."""
    one = {"type": "string", "maxLength": 1}
    schema: dict[str, Any] = {
        "items": {"type": "array", "items": one},
        "additionalProperties": {"type": "object", "additionalProperties": one},
        "anyOf": {"anyOf": [one, {"type": "integer"}]},
        "propertyNames": {"type": "object", "propertyNames": one, "additionalProperties": {"type": "number"}},
    }[where]
    spec = _spec(json=schema)
    wrap = {"items": "[{}]", "additionalProperties": '{{"k":{}}}', "anyOf": "{}", "propertyNames": "{{{}:1}}"}
    assert _takes(llm, spec, wrap[where].format('"x"')) and _takes(llm, spec, wrap[where].format('"\\t"'))
    for control in ("\t", "\x1d", "\x00"):
        assert not _takes(llm, spec, wrap[where].format(f'"{control}"')), repr(control)


@pytest.mark.parametrize(
    ("regex", "text"), [(r"\x41BC", "ABC"), (r"id-\x2Dabc", "id--abc"), (r"[\x41B]+", "BAB")]
)
def test_a_regex_hex_escape_is_two_digits(llm: LLM, regex: str, text: str) -> None:
    """xgrammar read every hex digit after \\x: `\\x41BC` took U+41BC and finished "stop" with it."""
    assert re.fullmatch(regex, text)
    assert _takes(llm, _spec(regex=regex), text)
    assert not _takes(llm, _spec(regex=regex), chr(int(regex[2:6], 16)) if regex.startswith("\\x") else "Л")


@pytest.mark.parametrize("regex", ["a$b", "a^b", "(a$)b", "x(^y)", "a*^b", "(a$)*", "(^a)+", "(a$){2}"])
def test_an_anchor_inside_a_regex_is_refused(llm: LLM, regex: str) -> None:
    """xgrammar ignores anchors inside a regex: "a$b", which nothing matches, finished "stop" with "ab"."""
    with pytest.raises(InvalidRequestError, match=r"not supported: .*anchors inside a regex") as info:
        llm.engine.grammars.compile(_spec(regex=regex))
    assert info.value.field == "regex"
    for fine in ("^ab$", "^(a|b)+$", "^a$|^b$", "[$^]x", "(^a)?b", "(a$){1}"):
        llm.engine.grammars.compile(_spec(regex=fine))


def test_a_regex_class_that_begins_with_an_escaped_caret_is_refused(llm: LLM) -> None:
    """xgrammar negated `[\\^a]` (it took "x" and refused "a"); `[a^]` means the same and is taken."""
    with pytest.raises(InvalidRequestError, match="begins with an escaped"):
        llm.engine.grammars.compile(_spec(regex="[\\^a]"))
    assert _takes(llm, _spec(regex="[a^]"), "^") and not _takes(llm, _spec(regex="[a^]"), "x")


def test_targets_inside_targets_are_rewritten_whichever_ref_comes_first() -> None:
    """The rewrite of a $ref target that holds another target keeps the inner one's rewrite, in either
    order of the refs, and leaves the caller's schema as it was."""
    from tp_runtime.engine.structured_output import _document_for_xgrammar

    inner = {"B": {"type": "string", "format": "date"}}
    for order in (("a", "b"), ("b", "a")):
        refs = {"a": {"$ref": "#/components/A"}, "b": {"$ref": "#/components/A/x-in/B"}}
        schema = {"type": "object", "properties": {k: refs[k] for k in order},
                  "components": {"A": {"type": "integer", "x-in": inner}}}  # fmt: skip
        before = json.dumps(schema)
        out = _document_for_xgrammar(schema)
        written = out["components"]["A"]["x-in"]["B"]
        assert "format" not in written and written["pattern"].startswith("^"), (order, written)
        assert json.dumps(schema) == before


def test_byte_tokens_never_spell_what_is_not_utf8(llm: LLM) -> None:
    """xgrammar's byte-level rules for a string's characters and negated classes took byte tokens that
    spell no UTF-8 (an overlong form, an encoded surrogate, past U+10FFFF): the text got one U+FFFD a byte,
    past maxLength 1 (`"���"`) or a pattern. Each such byte is refused (and masked) where UTF-8 has none;
    valid characters spelled byte by byte still go through."""
    import xgrammar

    tokenizer = llm.get_tokenizer()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=llm.engine.config.model.vocab_size)
    ids: dict[bytes, int] = {}
    for i, spelled in enumerate(info.decoded_vocab):
        ids.setdefault(bytes(spelled), i)
    grammars = llm.engine.grammars
    one_char, not_a = _spec(json={"type": "string", "maxLength": 1}), _spec(regex="[^a]{1,2}")
    cases = [  # (constraint, UTF-8 bytes, the first byte that breaks UTF-8 or None)
        (one_char, b'"\xf0\x88\x88\xa7"', 2),  # U+0827 in four bytes (overlong)
        (one_char, b'"\xf0\x9f\x98\x80"', None),  # U+1F600
        (not_a, b"\xed\xa8\xbd", 1),  # a surrogate
        (not_a, b"\xed\x9f\xbf", None),  # U+D7FF
        (not_a, b"\xe0\x93\xb6", 1),  # overlong
        (not_a, b"\xf4\x90\x80\x80", 1),  # past U+10FFFF
        (not_a, b"\xc3\xa9\xc3", None),  # é, then the start of another character
    ]
    vocab_size = llm.engine.config.model.vocab_size

    def offered(state: Any, token: int) -> bool:
        row = xgrammar.allocate_token_bitmask(1, vocab_size)
        state.fill(row, 0)
        return bool((int(row[0, token // 32]) >> (token % 32)) & 1)

    for spec, spelled, breaks in cases:
        state = grammars.matcher(grammars.compile(spec))
        for at, byte in enumerate(spelled):
            token = ids[bytes([byte])]
            if at == breaks:
                assert not offered(state, token), (spelled, at)
                break
            assert offered(state, token) and state.accept(token), (spelled, at)
    # A class that leaves no valid continuation after a lead byte it takes (ED then A0-BF only, the
    # surrogates): the grammar's own choice, not a row with no token at all.
    state = grammars.matcher(grammars.compile(_spec(regex="[^\ud000-\ud7ff]x")))
    assert state.accept(ids[b"\xed"])
    assert offered(state, ids[b"\xa0"])


@pytest.mark.parametrize(
    ("schema", "taken", "refused"),
    [
        # draft 4 (and OpenAPI 3.0): exclusiveMinimum/exclusiveMaximum are booleans on minimum/maximum
        ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer", "minimum": 0,
          "exclusiveMinimum": True, "maximum": 3, "exclusiveMaximum": True}, ["1", "2"], ["0", "3", "-1"]),
        ({"type": "integer", "minimum": 0.5, "maximum": 2, "exclusiveMaximum": True}, ["1"], ["0", "2"]),
        ({"type": "number", "minimum": 0.5, "exclusiveMinimum": True}, ["0.6", "1"], ["0.5", "0"]),
        ({"type": "integer", "minimum": 1, "exclusiveMinimum": False}, ["1", "2"], ["0"]),
        # drafts 4 to 7: an array of items is 2020-12's prefixItems, additionalItems its items
        ({"type": "array", "items": [{"type": "integer"}, {"type": "string"}]},
         ['[1, "a"]', "[1]", "[]"], ['[1, "a", 2]', '["a", 1]']),
        ({"type": "array", "items": [{"type": "integer"}], "additionalItems": {"type": "boolean"}},
         ["[1, true, false]", "[1]"], ["[1, 2]", "[true]"]),
        ({"type": "array", "items": [{"type": "integer"}], "additionalItems": False}, ["[1]"], ["[1, 2]"]),
    ],
)  # fmt: skip
def test_older_drafts_keywords_are_read_as_they_mean(
    llm: LLM, schema: dict[str, Any], taken: list[str], refused: list[str]
) -> None:
    """Draft 4's boolean exclusive bounds were refused as "not valid" (or, on an integer with a fractional
    bound, dropped: 2 came out under exclusiveMaximum 2), and an array of items (pydantic 1's and zod's
    tuples) was refused."""
    spec = _spec(json=schema)
    assert [t for t in taken if not _takes(llm, spec, t)] == []
    assert [t for t in refused if _takes(llm, spec, t)] == []
