"""Structured outputs: a request's grammar, compiled once by xgrammar, and the matcher that says which
tokens may come next.

The driver owns every matcher. A step's scheduler output (or, with async scheduling, its GrammarMask)
carries, for the constrained requests that sample in it, the packed bitmask of their allowed tokens (int32
words, bit i of word j allowing token 32 j + i, xgrammar's layout); every rank applies it to those rows'
logits before penalties and sampling, so every rank samples the same token. The matcher then advances on
the sampled id. With async scheduling the driver sends a step before it knows the previous step's ids, so
the step goes out with grammar_mask_follows: the ranks queue its forward, the driver advances the matchers
on the previous step's ids meanwhile, and then broadcasts the step's mask (a GrammarMask message), which
the ranks apply before sampling. The device only waits when the driver's update and mask take longer than
the forward.

xgrammar (a C++ library used by vLLM and SGLang) is imported on first use; compiling is thread-safe and
cached by the grammar's text, and the tokenizer's vocabulary is read once per engine.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, cast
from urllib.parse import unquote

import numpy as np

from tp_runtime.errors import ConfigError, InvalidRequestError
from tp_runtime.sampling_params import CONSTRAINT_FIELDS, StructuredOutputsParams

_RECENT_GRAMMARS = 64  # requests between a server thread's compile and the engine thread's add


# Keywords that only annotate a schema: they constrain nothing, so they may sit beside any other.
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
    "$schema", "$id", "$anchor", "$defs", "definitions", "contentEncoding", "contentMediaType",
    "discriminator",  # OpenAPI's (pydantic writes it beside oneOf): a hint, not a constraint
    # OpenAPI 3.0's; `nullable` only widens what is valid, so outputs that never take null still conform
    "nullable", "example", "externalDocs", "xml",
    "components",  # OpenAPI's home of schemas that $refs point into, like $defs
})  # fmt: skip
# Keywords xgrammar's JSON schema converter does not enforce (it drops them, so outputs would break them).
_UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
               "contains", "minContains", "maxContains")  # fmt: skip
# Keywords that constrain numbers or strings only when the schema says its type: without one, xgrammar
# ignores them (any JSON value may come out).
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
# Formats whose xgrammar rule lets out invalid strings, as patterns that hold only valid ones: ipv4 took
# leading zeros ("004.163.088.191"), hostname labels past 63 characters and names past 253, date (and
# date-time) days a month does not have ("2023-02-29"), time a second 60 at any minute (RFC 3339 has it
# only at 23:59 UTC). The hostname pattern takes up to four labels (the last at most 61 characters, so no
# name passes 253), date-time an upper-case T and Z, no leap second.
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_LAST_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,59}[A-Za-z0-9])?"
_LEAP_YEAR = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    r"([0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])|[0-9]{4}-(0[13-9]|1[0-2])-(29|30)"
    rf"|[0-9]{{4}}-(0[13578]|1[02])-31|{_LEAP_YEAR}-02-29)"
)
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_FORMAT_PATTERNS = {
    "ipv4": rf"^{_OCTET}(\.{_OCTET}){{3}}$",
    "hostname": rf"^({_LABEL}\.){{0,3}}{_LAST_LABEL}$",
    "date": rf"^{_DATE}$",
    "date-time": rf"^{_DATE}T{_TIME}$",
    "time": rf"^{_TIME}$",
}
# JSON Schema's own formats that xgrammar has no rule for: it takes any string there ("idn-email" let out
# "https://example.com/email-address"). Other names (OpenAPI's "int32", "password", ...) are annotations
# that validators ignore, as xgrammar does.
_UNENFORCED_FORMATS = ("idn-email", "idn-hostname", "iri", "iri-reference", "regex")
_MAX_INTEGER_STEP = 1024  # the largest multipleOf xgrammar enforces on integers (it drops larger ones)
# The widest range (largest - least allowed integer) whose multipleOf xgrammar enforces; it drops one between
# bounds further apart, and one beside a single bound.
_MAX_STEPPED_WIDTH = 9999
# Likewise for arrays and objects, unless xgrammar takes the schema as one from items/prefixItems
# (arrays) or properties/additionalProperties (objects).
_ARRAY_KEYWORDS = ("minItems", "maxItems")
_OBJECT_KEYWORDS = ("minProperties", "maxProperties", "patternProperties", "propertyNames")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
# xgrammar writes a string with minLength/maxLength with this class as its one character: a repeat of a
# rule whose body it is (`X_characters{m, n}`), for a bound of 1 a rule `("" | (CLASS))` or, for exactly
# one character, the class itself between the quotes. It takes raw control characters (invalid JSON) and
# no escapes; _json_strings_kept_valid puts one JSON string character in its place: no control character,
# quote or backslash, or an escape.
_BOUNDED_STRING_CLASS = r"[^\"\\\r\n]"
_BOUNDED_STRING_CHARACTER = f" ::= (({_BOUNDED_STRING_CLASS}))"
_BOUNDED_STRING_OPTIONAL = f' ::= ("" | ({_BOUNDED_STRING_CLASS}))'
# A \u escape is one character unless a surrogate: a high one counts with the low one that must follow it
# (one code point, as JSON Schema counts), and a lone one (no Unicode text; strict parsers refuse it) is out.
_HEX = "[A-Fa-f0-9]"
_NOT_SURROGATE = f"(([0-9A-Ca-cEFef] {_HEX} {_HEX} {_HEX}) | ([Dd] [0-7] {_HEX} {_HEX}))"
_SURROGATE_PAIR = f'([Dd] [89ABab] {_HEX} {_HEX} "\\\\u" [Dd] [C-Fc-f] {_HEX} {_HEX})'
_JSON_CHARACTER = (
    r'(([^\0-\x1f\"\\]) | ("\\" (([\"\\/bfnrt]) | ("u" ('
    + f"{_NOT_SURROGATE} | {_SURROGATE_PAIR}"
    + ")))))"
)
_QUOTE = r'"\""'
# Group nesting a pattern or regex may have: xgrammar's JSON-schema pattern conversion recursed until the
# process crashed on 30,000 nested groups (its `regex` parser refuses past about 1,000), and Python's own
# regex parsers, which the schema checks here use, fail past about 1,000.
_MAX_GROUP_NESTING = 100
# The schema checks match its own patterns against its property names (JSON Schema's rules, which
# xgrammar skips). Those are backtracking matches, exponential in the name for a pattern like `(a|a)*$`:
# one schema's searches share this much search time, and a schema whose searches need more is refused.
_PATTERN_SEARCH_BUDGET_S = 0.25
# Property names times patterns checked one by one at one object schema, at most.
_MAX_NAME_SEARCHES = 4096
# Branch pairs of a oneOf compared one by one, at most (a few µs each; const and enum branches are
# hashed instead).
_MAX_ONEOF_PAIRS = 200_000
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems",
               "unevaluatedItems", "propertyNames")  # fmt: skip
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_JSON_TYPES: dict[str, Any] = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: (
        (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    ),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def _document_for_xgrammar(schema: Any) -> Any:
    """A whole JSON schema as xgrammar should compile it (_schema_for_xgrammar), including the targets of
    `$ref`s that point where the walk over subschemas does not go (OpenAPI's `#/components/schemas/...`,
    any JSON pointer xgrammar resolves): each is checked and rewritten at its place in a copy of the
    document, so that no subschema an output must match escapes the checks."""
    refs: list[str] = []
    searches = _PatternSearches()
    out = _schema_for_xgrammar(schema, refs=refs, searches=searches)
    rewrites: dict[tuple[str, ...], Any] = {}
    while refs:
        parts = _pointer_parts(refs.pop())
        if parts is None or parts in rewrites:
            continue
        if _walked(parts, schema):
            if _at(out, parts) is None and _at(schema, parts) is not None:
                _put(out, parts, None, set(), parts)  # renamed on the walk: refused, naming the place
            continue
        target = _at(schema, parts)
        if target is None:
            continue  # a pointer that leads nowhere: xgrammar refuses it
        rewrites[parts] = _schema_for_xgrammar(target, _pointer_text(parts), schema, refs, searches)
    # Each container along the paths copied once (by its id; the caller's objects left as they are), an
    # enclosing target before the targets inside it, which then land in its rewrite.
    copies: set[int] = set()
    for parts in sorted(rewrites, key=len):
        out = _put(out, parts, rewrites[parts], copies, parts)
    return out


def _compile_structural_tag(compiler: Any, given: str | dict[str, Any]) -> Any:
    """xgrammar's grammar of a structural tag, its JSON schemas checked and rewritten as `json` ones are
    (_document_for_xgrammar). vLLM's form ({"structures": [{"begin", "schema", "end"}], "triggers"}) goes
    through xgrammar's items; any other is xgrammar's own ({"type": "structural_tag", "format": ...})."""
    field = "structural_tag"
    try:
        tag = json.loads(given) if isinstance(given, str) else given
    except ValueError as exc:
        raise InvalidRequestError(f"the structural tag is not valid JSON: {exc}", field) from None
    if not isinstance(tag, dict):
        raise InvalidRequestError("the structural tag must be a JSON object", field)
    try:
        if "structures" not in tag:
            return _compiled_tag(compiler, json.dumps(_checked_format(tag)))
        return _compile_structures(compiler, tag)
    except InvalidRequestError as exc:
        if exc.field == field:
            raise
        # A schema's (field "json"): the request's field is this one.
        raise InvalidRequestError(f"in the structural tag, {exc}", field) from None


def _compile_structures(compiler: Any, tag: dict[str, Any]) -> Any:
    import xgrammar

    field = "structural_tag"
    structures, triggers = tag["structures"], tag.get("triggers")
    if not (isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)):
        raise InvalidRequestError("the structural tag's triggers must be a list of non-empty strings", field)
    items = []
    for s in structures if isinstance(structures, list) else [None]:
        if not (isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                and isinstance(s.get("schema"), (dict, bool))):  # fmt: skip
            raise InvalidRequestError(
                'the structural tag\'s structures must be a list of {"begin": str, "schema": {...}, "end": '
                f"str}}, got {str(s)[:100]}",
                field,
            )
        schema = json.dumps(_document_for_xgrammar(s["schema"]))
        items.append(xgrammar.StructuralTagItem(begin=s["begin"], schema=schema, end=s["end"]))
    return _compiled_tag(compiler, items, triggers)


def _json_strings_kept_valid(grammar: Any, only_json: bool) -> Any:
    """xgrammar's grammar of a JSON schema (`only_json`) or of a structural tag (before compiling: rule
    names as its JSON converter writes them), with the character of its length-bounded JSON strings
    (_BOUNDED_STRING_CLASS) made one JSON string character. Bounds count characters, an escape as one, as
    JSON Schema counts them. A string of at most one character is written without the repeat, in forms a
    tag's regex or grammar may also take (the class inline between quotes, or an optional rule): those are
    rewritten only in a JSON schema's own grammar, where every rule is the converter's; a tag's regex and
    grammar rules keep their bodies."""
    import xgrammar

    text = str(grammar)
    if _BOUNDED_STRING_CLASS not in text:
        return grammar
    changed = False
    if only_json:  # exactly one character: the class inline between the quotes
        inline = f"{_QUOTE} {_BOUNDED_STRING_CLASS} {_QUOTE}"
        changed = inline in text
        text = text.replace(inline, f"{_QUOTE} {_JSON_CHARACTER} {_QUOTE}")
    quote = re.escape(_QUOTE)
    repeated = set(re.findall(rf"{quote} (\S+_characters)\{{\d+, -?\d+\}} {quote}", text))
    optional = set(re.findall(rf"{quote} (\S+) {quote}", text)) if only_json else set()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        name, _, body = line.partition(" ::= ")
        if name in repeated and " ::= " + body == _BOUNDED_STRING_CHARACTER:
            lines[i], changed = f"{name} ::= {_JSON_CHARACTER}", True
        elif name in optional and " ::= " + body == _BOUNDED_STRING_OPTIONAL:  # at most one character
            lines[i], changed = f'{name} ::= ("" | {_JSON_CHARACTER})', True
    # (the class only in a regex's or grammar's rules: nothing to parse again)
    return xgrammar.Grammar.from_ebnf("\n".join(lines)) if changed else grammar


def _compiled_tag(compiler: Any, *tag: Any) -> Any:
    """A structural tag compiled with its JSON strings kept valid (_json_strings_kept_valid). A tag that
    names tokens by their text needs the tokenizer to become a grammar, which only the compiler has: it
    is compiled as xgrammar writes it (its length-bounded strings may then take raw control
    characters)."""
    import xgrammar

    try:
        grammar = xgrammar.Grammar.from_structural_tag(*tag)
    except (RuntimeError, ValueError) as exc:
        if "tokenizer" not in str(exc):
            raise
        return compiler.compile_structural_tag(*tag)
    return compiler.compile_grammar(_json_strings_kept_valid(grammar, only_json=False))


def _checked_format(tag: dict[str, Any]) -> dict[str, Any]:
    """xgrammar's form of a structural tag, read by xgrammar's own model (every format node then names its
    type), with each JSON schema and regex in it checked and rewritten as a `json` or `regex` constraint
    is."""
    import pydantic
    import xgrammar

    try:
        read = xgrammar.StructuralTag.model_validate(tag)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise InvalidRequestError(
            f"the structural tag is not valid: {first['msg']} at {where or 'its top'}", "structural_tag"
        ) from None
    return cast(dict[str, Any], _checked_formats(read.model_dump(mode="json", exclude_none=True)))


def _checked_formats(node: Any) -> Any:
    if isinstance(node, list):
        return [_checked_formats(value) for value in node]
    if not isinstance(node, dict):
        return node
    kind = node.get("type")
    if kind in ("json_schema", "qwen_xml_parameter") and "json_schema" in node:
        schema = node["json_schema"]
        if node.get("excludes") and _has_length_bound(schema):
            raise InvalidRequestError(
                "the structural tag's json_schema has excludes beside minLength/maxLength, which xgrammar "
                "then drops; leave out excludes or the length bounds",
                "structural_tag",
            )
        return {**node, "json_schema": _document_for_xgrammar(schema)}
    if kind == "regex" and isinstance(node.get("pattern"), str):
        return {**node, "pattern": _regex_for_xgrammar(node["pattern"])}
    return {key: _checked_formats(value) for key, value in node.items()}


def _regex_for_xgrammar(pattern: str) -> str:
    """A regex constraint as xgrammar should compile it: refused where xgrammar would read it otherwise
    (_regex_problem), its dots kept off newlines and its \\xHH escapes two digits long
    (_regex_text_for_xgrammar)."""
    problem = _regex_problem(pattern)
    if problem:
        raise InvalidRequestError(f"the regex is not supported: {problem}", "regex")
    written = _regex_text_for_xgrammar(pattern)
    if written != pattern:
        import xgrammar

        xgrammar.Grammar.from_regex(pattern)  # its errors name places in the regex as given
    return written


def _has_length_bound(schema: Any) -> bool:
    if isinstance(schema, dict):
        return any(k in ("minLength", "maxLength") or _has_length_bound(v) for k, v in schema.items())
    if isinstance(schema, list):
        return any(_has_length_bound(v) for v in schema)
    return False


def _pointer_parts(ref: str) -> tuple[str, ...] | None:
    """The parts of a JSON pointer `#/a/b` as RFC 6901 reads a URI fragment (percent-decoded, split, then
    ~1 and ~0 unescaped), as xgrammar does; None for anything else."""
    if not ref.startswith("#/"):
        return None
    return tuple(p.replace("~1", "/").replace("~0", "~") for p in unquote(ref[2:]).split("/"))


def _pointer_text(parts: tuple[str, ...]) -> str:
    return "#/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in parts)


def _at(document: Any, parts: tuple[str, ...]) -> Any:
    """What a JSON pointer's `parts` point at in `document` (None: nothing). InvalidRequestError where the
    path enters an enum's or a const's value (data, not a schema), told apart from a property named
    "enum" or "const" by the maps of subschemas it passes."""
    name_next = False
    for i, part in enumerate(parts):
        if not name_next and part in ("enum", "const") and isinstance(document, dict) and part in document:
            raise InvalidRequestError(
                f"the JSON schema is not supported: a '$ref' into the value of {part!r} at "
                f"{_pointer_text(parts[: i + 1])} (a value is not a schema)",
                "json",
            )
        name_next = not name_next and part in _SUBSCHEMA_MAPS
        if isinstance(document, dict) and part in document:
            document = document[part]
        elif isinstance(document, list) and part.isdigit() and int(part) < len(document):
            document = document[int(part)]
        else:
            return None
    return document


def _walked(parts: tuple[str, ...], root: Any) -> bool:
    """Whether _schema_for_xgrammar's walk from `root` reaches the subschema at `parts` (it descends into
    the maps of _SUBSCHEMA_MAPS, the keys of _SUBSCHEMAS and the lists of prefixItems/anyOf/oneOf/allOf,
    never into an enum or const schema)."""
    node, i = root, 0
    while i < len(parts):
        if not isinstance(node, dict) or "enum" in node or "const" in node:
            return False
        key = parts[i]
        if key in _SUBSCHEMAS:
            node, i = node.get(key), i + 1
            continue
        if i + 1 == len(parts):
            return False
        container, name = node.get(key), parts[i + 1]
        if key in _SUBSCHEMA_MAPS and isinstance(container, dict) and name in container:
            node = container[name]
        elif (
            key in _SUBSCHEMA_LISTS and isinstance(container, list) and name.isdigit()
            and int(name) < len(container)
        ):  # fmt: skip
            node = container[int(name)]
        else:
            return False
        i += 2
    return True


def _put(document: Any, parts: tuple[str, ...], value: Any, copies: set[int], whole: tuple[str, ...]) -> Any:
    """`document` with `value` at `parts`: each container on the way copied unless it is one of `copies`
    (made by an earlier call, then changed in place). InvalidRequestError where the rewritten document no
    longer has the place (a rewrite renamed a patternProperties key, or dropped an enum's const)."""
    if not parts:
        return value
    if id(document) not in copies and isinstance(document, (dict, list)):
        document = dict(document) if isinstance(document, dict) else list(document)
        copies.add(id(document))
    head = parts[0]
    if isinstance(document, dict) and head in document:
        document[head] = _put(document[head], parts[1:], value, copies, whole)
    elif isinstance(document, list) and head.isdigit() and int(head) < len(document):
        document[int(head)] = _put(document[int(head)], parts[1:], value, copies, whole)
    else:
        raise InvalidRequestError(
            f"the JSON schema is not supported: a '$ref' to {_pointer_text(whole)}, a place the schema's "
            "rewrite for structured outputs does not keep (point it at $defs instead)",
            "json",
        )
    return document


def _schema_for_xgrammar(
    schema: Any, path: str = "#", root: Any = None, refs: list[str] | None = None,
    searches: _PatternSearches | None = None,
) -> Any:  # fmt: skip
    """`schema` (parsed JSON) as xgrammar should compile it: InvalidRequestError for a keyword, or a
    combination, that xgrammar would silently drop (its outputs could then break the schema), and with what
    xgrammar's strict mode (no properties or items beyond those the schema names) would make unsatisfiable
    opened again: an object's minProperties beyond its properties, an array's minItems beyond its
    prefixItems, where the schema leaves additional ones unsaid (JSON Schema then allows any). `root`: the
    whole schema, which `$ref`s point into (default: `schema`); `refs` collects the `$ref`s met on the way;
    `searches`: the pattern searches' shared budget (a new one by default)."""
    if not isinstance(schema, dict):
        return schema  # booleans, and what xgrammar refuses itself
    root = schema if root is None else root
    schema = _in_draft_2020_words(schema)
    searches = searches or _PatternSearches()

    def refuse(why: str) -> InvalidRequestError:
        return InvalidRequestError(
            f"the JSON schema is not supported: {why} at {path} (structured outputs cannot enforce it)",
            "json",
        )

    def invalid(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"the JSON schema is not valid: {why} at {path}", "json")

    out = dict(schema)
    for key in _UNENFORCED:
        if key in schema:
            raise refuse(f"{key!r}")
    # Invalid values that xgrammar takes without a word, into a grammar that breaks the schema: an empty
    # anyOf or oneOf (no value is valid) gave an empty value ("", `{"a": }`), maxLength -1 no limit at all,
    # `"type": []` (no value is valid) any value.
    for key in ("anyOf", "oneOf"):
        if schema.get(key) == []:
            raise invalid(f"{key!r} must be a non-empty array")
    for key in _COUNTS:
        count = schema.get(key)
        if isinstance(count, int) and not isinstance(count, bool) and count < 0:
            raise invalid(f"{key!r} must be a non-negative integer, got {count}")
    if schema.get("type") == []:
        raise invalid("'type' must name at least one type")
    branches = schema.get("oneOf")
    if isinstance(branches, list):
        apart = _apart(branches, root)
        if apart is None:
            raise refuse(
                f"'oneOf' with {len(branches)} branches, too many to check apart unless each is a const or "
                "an enum; use anyOf"
            )
        if not apart:
            # xgrammar takes oneOf as anyOf: an output matching two branches would break it
            # ({"oneOf": [{"type": "integer"}, {"type": "number"}]} gave 2004).
            raise refuse(
                "'oneOf' whose branches a value could match together (structured outputs take it as anyOf); "
                "use anyOf, or branches of different types, of different literal values, or objects told "
                "apart by a required property's const"
            )
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        # xgrammar resolves JSON pointers into this schema only, and takes any other $ref (another
        # document's URL, an $anchor) as any JSON value: {"$ref": "https://x/s.json"} let out 8007...
        raise refuse(f"'$ref' {ref!r} (only JSON pointers into this schema, '#/...', are resolved)")
    if isinstance(ref, str) and refs is not None:
        refs.append(ref)
    if schema.get("uniqueItems") is True:
        raise refuse("'uniqueItems'")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise refuse("'allOf' with more than one schema")
    kind = schema.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else set()
    # (`x-...`: OpenAPI's vendor extensions, annotations too)
    validating = sorted(k for k in schema if k not in _ANNOTATIONS and not k.startswith("x-"))
    for key in ("$ref", "anyOf", "oneOf", "allOf"):
        others = [k for k in validating if k != key]
        if key in schema and others:
            if key in ("anyOf", "oneOf") and others == ["type"] and _literals_of(schema[key], kinds):
                out.pop("type")  # "an enum with descriptions": every branch a value of the type already
                continue
            raise refuse(f"{key!r} beside {others}")
    if "enum" in schema or "const" in schema:
        others = [k for k in validating if k not in ("enum", "const", "type")]
        if others or ("enum" in schema and "const" in schema):
            raise refuse(f"{'enum' if 'enum' in schema else 'const'!r} beside {others or ['const']}")
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if _has_wide_integer(values):  # xgrammar writes it as a double, another number
            raise refuse("an integer beyond 64 bits in 'enum' or 'const'")
        if kinds and all(k in _JSON_TYPES for k in kinds) and isinstance(values, list):
            # xgrammar takes every listed value, whatever the type says: only those of the type remain.
            fits = [v for v in values if any(_JSON_TYPES[k](v) for k in kinds)]
            if not fits:
                raise refuse(f"no value of 'enum' or 'const' has type {kind!r}")
            out.pop("const", None)
            out.pop("type")
            out["enum"] = fits
        return out
    if not kinds:
        untyped = [k for k in (*_NUMBER_KEYWORDS, *_STRING_KEYWORDS) if k in schema]
        if not {"items", "prefixItems"} & schema.keys():
            untyped += [k for k in _ARRAY_KEYWORDS if k in schema]
        if not {"properties", "additionalProperties", "required"} & schema.keys():
            untyped += [k for k in _OBJECT_KEYWORDS if k in schema]
        if untyped:
            raise refuse(f"{untyped} without a 'type'")
    step = schema.get("multipleOf")
    if step is not None and "number" in kinds:  # (on integers xgrammar enforces it)
        raise refuse("'multipleOf' on a non-integer type")
    if "integer" in kinds and isinstance(step, (int, float)) and not isinstance(step, bool) and step > 0:
        # xgrammar enforces a whole multipleOf up to 1024 on integers and silently drops any other (2.5
        # let 7 out). The integers that are multiples of p/q (lowest terms) are the multiples of p: that
        # whole number is the step (1: every integer), the decimal read as written (0.1 is 1/10).
        whole = Fraction(repr(step)).numerator if isinstance(step, float) else step
        if whole > _MAX_INTEGER_STEP:
            raise refuse(f"'multipleOf' {step} on integers (at most {_MAX_INTEGER_STEP} can be enforced)")
        if whole == 1:
            out.pop("multipleOf")
        else:
            out["multipleOf"] = whole
            low, high = _integer_bounds(schema)
            if (low is None) != (high is None):
                # ({"minimum": 3, "multipleOf": 5} gave 2004)
                raise refuse(f"'multipleOf' {step} on integers beside one bound only (xgrammar drops it)")
            if low is not None and high is not None and high - low > _MAX_STEPPED_WIDTH:
                raise refuse(
                    f"'multipleOf' {step} on integers between bounds more than {_MAX_STEPPED_WIDTH} apart "
                    "(xgrammar drops it)"
                )
    bounds = [k for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum") if k in schema]
    fractional = [
        k for k in bounds
        if isinstance(schema[k], float) and math.isfinite(schema[k]) and not schema[k].is_integer()
    ]  # fmt: skip
    if "integer" in kinds and "number" not in kinds and fractional:
        # xgrammar refuses a fractional bound on integers ("must be a whole number"): the same integers,
        # between whole bounds ({"minimum": 1.5} is {"minimum": 2}).
        low, high = _integer_bounds(schema)
        if low is not None and high is not None and low > high:
            raise refuse("an 'integer' range that holds no integer")
        for key in bounds:
            out.pop(key)
        if low is not None:
            out["minimum"] = low
        if high is not None:
            out["maximum"] = high
    if "number" in kinds and not _range_has_decimals(schema):
        # xgrammar writes a number range with at most 6 decimals, and one that holds none as the empty
        # output: {"minimum": 1e-7, "maximum": 2e-7} finished ("stop") with "" (nested: `{"x": }`).
        raise refuse(f"a 'number' range that holds no number of at most {_RANGE_DECIMALS} decimals")
    patterns = [(f"'pattern' {schema['pattern']!r}", schema["pattern"])] if "pattern" in schema else []
    if isinstance(schema.get("patternProperties"), dict):
        patterns += [(f"'patternProperties' key {name!r}", name) for name in schema["patternProperties"]]
    for what, pattern in patterns:
        problem = _pattern_problem(pattern) if isinstance(pattern, str) else None
        if problem:
            raise refuse(f"{what} {problem}")
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    for key in ("pattern", "format"):
        if key in schema and lengths and "string" in kinds:
            raise refuse(f"{key!r} beside {lengths}")
    if schema.get("format") in _UNENFORCED_FORMATS and "string" in kinds:
        raise refuse(f"'format' {schema['format']!r}")
    written = _FORMAT_PATTERNS.get(schema["format"]) if isinstance(schema.get("format"), str) else None
    if written is not None and "string" in kinds:
        if "pattern" in schema:
            raise refuse(f"'format' {schema['format']!r} beside 'pattern'")
        out.pop("format")
        out["pattern"] = written
    if isinstance(out.get("pattern"), str):
        out["pattern"] = _json_pattern_for_xgrammar(out["pattern"])
    if isinstance(out.get("patternProperties"), dict):
        given = out["patternProperties"]
        # (a key's dots kept: a key is also a name that a $ref may point at, and a property name with U+2028
        # or U+2029 in it is rare enough)
        out["patternProperties"] = {
            _json_pattern_for_xgrammar(str(name), dots=False): sub for name, sub in given.items()
        }
        if len(out["patternProperties"]) < len(given):
            raise refuse("'patternProperties' keys that are the same pattern written two ways")
    # Strict mode: what the schema leaves unsaid is not allowed, unless that leaves nothing.
    min_props, props = schema.get("minProperties"), schema.get("properties", {})
    if (
        isinstance(min_props, int) and isinstance(props, dict) and min_props > len(props)
        and not {"additionalProperties", "unevaluatedProperties", "patternProperties"} & schema.keys()
    ):  # fmt: skip
        out["additionalProperties"] = True
    min_items, prefix = schema.get("minItems"), schema.get("prefixItems", [])
    if (
        isinstance(min_items, int) and isinstance(prefix, list) and min_items > len(prefix)
        and not {"items", "additionalItems", "unevaluatedItems"} & schema.keys()
    ):  # fmt: skip
        out["items"] = True
    # A required name that `properties` leaves out: xgrammar drops it (and made a listed property required
    # in its place); JSON Schema gives it the schema of additional properties.
    required = schema.get("required")
    if isinstance(required, list) and isinstance(props, dict):
        missing = [n for n in required if isinstance(n, str) and n not in props]
        extra = schema.get("additionalProperties", schema.get("unevaluatedProperties", True))
        if missing and ("patternProperties" in schema or extra is False):
            raise refuse(f"'required' {missing} beyond 'properties'")
        if missing:
            out["properties"] = {**props, **{n: {} if extra is True else extra for n in missing}}
    # JSON Schema checks a listed name against every patternProperties pattern it matches (re.search) as
    # well; xgrammar against its properties schema only.
    listed_names = out.get("properties")  # with the required names added above
    if isinstance(schema.get("patternProperties"), dict) and isinstance(listed_names, dict):
        by_pattern = schema["patternProperties"].items()
        if len(by_pattern) * len(listed_names) > _MAX_NAME_SEARCHES:
            raise refuse(
                f"{len(listed_names)} properties beside {len(by_pattern)} 'patternProperties' patterns, too "
                f"many to check against each other (at most {_MAX_NAME_SEARCHES} pairs)"
            )
        both = [
            n for n, listed in listed_names.items()
            if any(sub not in ({}, True, listed) and searches.may_match(str(p), n) for p, sub in by_pattern)
        ]  # fmt: skip
        if searches.cut_short:
            raise refuse(searches.too_long())
        if both:
            raise refuse(
                f"properties {both[:4]} that a 'patternProperties' pattern of another schema matches too "
                "(or may: a pattern that cannot be read here, or whose search took too long)"
            )
    # xgrammar applies propertyNames to additional names only: a listed (or required) name must fit it.
    names_schema, listed = schema.get("propertyNames"), out.get("properties")
    if isinstance(names_schema, dict) and isinstance(listed, dict):
        if len(listed) > _MAX_NAME_SEARCHES:
            raise refuse(
                f"{len(listed)} properties beside 'propertyNames', too many to check (at most "
                f"{_MAX_NAME_SEARCHES})"
            )
        unfit = [name for name in listed if not _name_fits(name, names_schema, searches)]
        if searches.cut_short:
            raise refuse(searches.too_long())
        if unfit:
            raise refuse(f"properties {unfit[:4]} that 'propertyNames' does not allow (or cannot be checked)")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {
                name: _schema_for_xgrammar(sub, f"{path}/{key}/{name}", root, refs, searches)
                for name, sub in out[key].items()
            }
    for key in _SUBSCHEMAS:
        if key in schema:
            sub = schema[key]
            if key == "propertyNames" and isinstance(sub, dict) and "type" not in sub:
                # a name is a string: its string keywords need no type (xgrammar enforces them there)
                sub = {**sub, "type": "string"} if any(k in sub for k in _STRING_KEYWORDS) else sub
            out[key] = _schema_for_xgrammar(sub, f"{path}/{key}", root, refs, searches)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [
                _schema_for_xgrammar(s, f"{path}/{key}/{i}", root, refs, searches)
                for i, s in enumerate(schema[key])
            ]
    return out


def _in_draft_2020_words(schema: dict[str, Any]) -> dict[str, Any]:
    """Draft 4's boolean exclusiveMinimum/exclusiveMaximum (OpenAPI 3.0's too) and drafts 4-7's array of
    `items` (with `additionalItems` for the rest) as draft 2020-12 writes them, which is what xgrammar
    reads: it called the boolean "not valid" (or, on an integer with a fractional bound, it was dropped)
    and refused the array, which pydantic 1 and zod write for a tuple."""
    out = schema
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        flag = schema.get(exclusive)
        if isinstance(flag, bool):
            out = dict(out) if out is schema else out
            del out[exclusive]
            if flag and bound in out:
                out[exclusive] = out.pop(bound)
    if isinstance(schema.get("items"), list) and "prefixItems" not in schema:
        out = dict(out) if out is schema else out
        out["prefixItems"] = out.pop("items")
        if "additionalItems" in out:
            out["items"] = out.pop("additionalItems")
    return out


def _has_wide_integer(value: Any) -> bool:
    """Whether a JSON value holds an integer that 64 bits (signed) cannot hold."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not -(2**63) <= value < 2**63
    if isinstance(value, list):
        return any(_has_wide_integer(v) for v in value)
    if isinstance(value, dict):
        return any(_has_wide_integer(v) for v in value.values())
    return False


class _PatternSearches:
    """Searches of a schema's patterns in its property names, with the `regex` module (transformers' own
    dependency), which can stop a search: all of one schema's share _PATTERN_SEARCH_BUDGET_S of search
    time; `cut_short` once one ran out of it."""

    def __init__(self) -> None:
        self.spent_s = 0.0
        self.cut_short = False

    def search(self, pattern: str, name: str, ascii_classes: bool = False) -> bool | None:
        """Whether `pattern` matches somewhere in `name`; None where that is not known: a pattern the module
        cannot read or nests too deep, or a search the budget stopped."""
        import regex  # type: ignore[import-untyped]

        left = _PATTERN_SEARCH_BUDGET_S - self.spent_s
        if left <= 0:
            self.cut_short = True
            return None
        if _nesting_problem(pattern):
            return None
        start = time.perf_counter()
        try:
            found = regex.search(pattern, name, regex.ASCII if ascii_classes else 0, timeout=left)
        except TimeoutError:
            self.cut_short = True
            return None
        except (regex.error, RecursionError, OverflowError, ValueError):
            return None
        finally:
            self.spent_s += time.perf_counter() - start
        return found is not None

    def too_long(self) -> str:
        return (
            f"patterns whose searches in its property names take more than {_PATTERN_SEARCH_BUDGET_S:g} s "
            "in all (a pattern such as '(a|a)*$' backtracks exponentially)"
        )

    def may_match(self, pattern: str, name: str) -> bool:
        """Whether ECMA-262 regex `pattern` may match somewhere in `name` (ASCII classes): True where that
        is not known."""
        return self.search(pattern, name, ascii_classes=True) is not False


_RANGE_DECIMALS = 6  # the decimals xgrammar writes the numbers of a bounded 'number' range with


def _range_has_decimals(schema: dict[str, Any]) -> bool:
    """Whether the bounds of a 'number' schema hold a number of at most _RANGE_DECIMALS decimals (each bound
    read as written: 1e-7 is 1/10**7)."""
    first, last = _scaled_bounds(schema, 10**_RANGE_DECIMALS)
    return first is None or last is None or first <= last


def _integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """The least and the greatest integer the bounds of an integer schema allow (None: unbounded there)."""
    return _scaled_bounds(schema, 1)


def _scaled_bounds(schema: dict[str, Any], scale: int) -> tuple[int | None, int | None]:
    """The least and the greatest multiple of 1/scale the schema's bounds allow, times scale (None:
    unbounded there); each bound read as written (its repr), so 0.1 is 1/10."""
    first, last = None, None
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        bound = schema.get(key)
        if not isinstance(bound, (int, float)) or isinstance(bound, bool):
            continue
        if isinstance(bound, float) and not math.isfinite(bound):  # (an int past a float's range is exact)
            continue
        at = Fraction(repr(bound)) * scale
        if key.endswith("inimum"):
            low = math.floor(at) + 1 if key == "exclusiveMinimum" else math.ceil(at)
            first = low if first is None else max(first, low)
        else:
            high = math.ceil(at) - 1 if key == "exclusiveMaximum" else math.floor(at)
            last = high if last is None else min(last, high)
    return first, last


# In a JSON schema's pattern: an escape, a character class, or a lookahead / negative lookahead.
_PATTERN_TOKEN = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)|\[\^?|\]|\(\?[=!]|.", re.S)
_QUOTE_OR_BACKSLASH = frozenset({'"', "\\"})
# The letters whose escape xgrammar does not know: it matches the letter itself, with a warning (`\Z`, the
# end of the text in Python, matched "Z"). Python refuses all of them but \A, \Z, \N and \U, and so do
# JSON Schema's ECMA-262 regexes (with the u flag).
_LITERAL_ESCAPES = frozenset("ghijlmoqyzACEFGHIJKLMNOQRTUVXYZ")
_UNESCAPED = "that names a '\"' or a backslash (xgrammar would write it unescaped: invalid JSON)"
_CLASS_OF_UNESCAPED = (
    "with a class of only quotes, backslashes or control characters (xgrammar would write them unescaped: "
    "invalid JSON)"
)
_RAW_CONTROL = "that names a control character (xgrammar would write it unescaped: invalid JSON)"
_CONTROL_ESCAPES = {"\\n": "\n", "\\r": "\r", "\\t": "\t", "\\v": "\v", "\\f": "\f", "\\0": "\0", "\\a": "\a"}


def _pattern_problem(pattern: str) -> str | None:
    """Why xgrammar would not enforce JSON-schema `pattern` as written, else None.

    xgrammar writes a pattern's literal characters into the JSON string as they are: a `"` or a `\\` that
    the pattern names outside a character class (or as a class of its own) came out unescaped, an invalid
    JSON string (`a"b` gave `"a"b"`). It drops a lookahead with a warning (`^(?=.*[A-Z]).{3}$` gave "abc").
    A class that names them beside other characters is fine: xgrammar leaves them out of it."""
    literal = _regex_problem(pattern, json_pattern=True)
    if literal:
        return f"with {literal}"
    in_class, negated, members = False, False, list[str]()
    for match in _PATTERN_TOKEN.finditer(pattern):
        token = match.group()
        char = token
        if token.startswith("\\") and len(token) > 2:  # \xHH, \uHHHH
            char = chr(int(token[2:], 16))
        elif token in _CONTROL_ESCAPES or (in_class and token == "\\b"):
            char = _CONTROL_ESCAPES.get(token, "\b")
        elif token.startswith("\\"):
            char = token[1] if token[1] in _QUOTE_OR_BACKSLASH else token
        code = ord(char) if len(char) == 1 else None
        if token == "\\c":
            return _RAW_CONTROL
        if token in ("\\x", "\\u"):  # (the token pattern takes only whole \xHH and \uHHHH escapes)
            return f"with an escape {token!r} not followed by its hex digits"
        if len(token) == 2 and token[0] == "\\" and ord(token[1]) > 0x7E:
            return f"with the escape {token!r} (write the character without its backslash)"
        if code is not None and (code > 0xFFFF or 0xD800 <= code <= 0xDFFF):
            return f"with the character {char!r}, past U+FFFF or half of one (xgrammar cannot take it)"
        if not in_class and code is not None and code < 0x20:
            return _RAW_CONTROL
        if in_class and token in ("\\p", "\\P"):
            return f"with {token!r} in a character class (xgrammar reads it as the letter)"
        quantifier = None if in_class else _QUANTIFIER.match(pattern, match.start())
        if quantifier and pattern.startswith("+", quantifier.end()):
            return "with a possessive quantifier (JSON Schema's regexes have none)"
        if quantifier and quantifier.group().startswith("{,"):
            return f"with the count {quantifier.group()!r} (Python's {{0,n}}, ECMA-262's text: write {{0,n}})"
        if in_class:
            if token == "]":
                in_class = False
                if members and not negated and all(m in _QUOTE_OR_BACKSLASH or m < " " for m in members):
                    return _CLASS_OF_UNESCAPED
            elif not (token == "-" and members and not pattern.startswith("]", match.end())):
                members.append(char)  # (a range's ends are its members here; its "-" is not)
        elif token.startswith("["):
            in_class, members, negated = True, [], token == "[^"
        elif token in ("(?=", "(?!"):
            return "with a lookahead (xgrammar ignores it)"
        elif char in _QUOTE_OR_BACKSLASH:
            return _UNESCAPED
    return None


def _nesting_problem(regex: str) -> str | None:
    """Groups nested deeper than _MAX_GROUP_NESTING, else None."""
    depth = deepest = 0
    in_class = False
    for match in _PATTERN_TOKEN.finditer(regex):
        token = match.group()
        if in_class:
            in_class = token != "]"
        elif token.startswith("["):
            in_class = True
        elif token.startswith("("):
            depth += 1
            deepest = max(deepest, depth)
        elif token == ")":
            depth = max(0, depth - 1)
    if deepest > _MAX_GROUP_NESTING:
        return f"groups nested {deepest} deep (at most {_MAX_GROUP_NESTING})"
    return None


def _regex_problem(regex: str, json_pattern: bool = False) -> str | None:
    """Why xgrammar would not enforce `regex` (the `regex` field's, else a JSON schema's `pattern`) as
    written: groups nested too deep, an escape it reads as a letter, an octal escape (`\\01` it read as
    NUL and "1"), a class that begins with `]` (Python's literal, ECMA-262's empty class: xgrammar ends the
    class there), in the `regex` field a class that begins with an escaped `^` (xgrammar negated
    `[\\^a]`), an anchor inside it; else None."""
    nesting = _nesting_problem(regex)
    if nesting:
        return nesting
    tokens = [m.group() for m in _PATTERN_TOKEN.finditer(regex)]
    for i, token in enumerate(tokens):
        after = tokens[i + 1] if i + 1 < len(tokens) else ""
        if len(token) == 2 and token[0] == "\\" and token[1] in _LITERAL_ESCAPES:
            return f"the escape '{token}', which xgrammar would match as the letter '{token[1]}'"
        if token == "\\0" and after.isdigit():
            return f"the octal escape '{token}{after}' (xgrammar reads it as NUL and a digit)"
        if token.startswith("[") and after == "]":
            return "a character class that begins with ']' (write it '\\]')"
        if not json_pattern and token == "[" and after in ("\\^", "\\x5e", "\\u005e"):
            return "a character class that begins with an escaped '^' (xgrammar negates it; put it later)"
    return _anchor_problem(regex)


_GROUP_PREFIX = re.compile(r"\?(?::|P?<[A-Za-z_][A-Za-z0-9_]*>|<?[=!])")  # after "(": (?:, (?P<n>, (?=, (?<!
_QUANTIFIER = re.compile(r"[*+?]\??|\{\d*(?:,\d*)?\}\??")


@dataclass
class _Alternative:
    """Where a scan of a regex stands in the current alternative of a group: whether the group can only
    begin at the text's start, whether the alternative matched a character yet, whether it passed a `$`;
    and whether any of the group's alternatives did the last two (for what follows the group)."""

    at_start: bool
    consumed: bool = False
    ended: bool = False
    any_consumed: bool = False
    any_ended: bool = False
    anchored: bool = False  # a `^` or `$` anywhere in the group


def _repeats(quantifier: str) -> bool:
    """Whether a quantifier lets its atom match more than once."""
    if not quantifier.startswith("{"):
        return quantifier[0] in "*+"
    low, comma, high = quantifier.strip("{}?").partition(",")
    if not comma:
        return int(low or 0) > 1
    return not high or int(high) > 1


def _anchor_problem(regex: str) -> str | None:
    """A `^` after what can match a character, or a `$` before it: xgrammar ignores anchors (it matches
    whole texts), so `a$b` let "ab" out where nothing can match. Anchors where they mean nothing more than
    the text's ends, as in `^(a|b)$` or `^a$|^b$`, are fine."""
    frames = [_Alternative(at_start=True)]
    pos, in_class, closed_anchored = 0, False, False
    while pos < len(regex):
        match = _PATTERN_TOKEN.match(regex, pos)
        assert match is not None  # the pattern takes any character
        token, pos = match.group(), match.end()
        top = frames[-1]
        group_before, closed_anchored = closed_anchored, False
        if in_class:
            in_class = token != "]"
            continue
        if token in ("(", "(?=", "(?!"):
            if token == "(" and (prefix := _GROUP_PREFIX.match(regex, pos)):
                pos = prefix.end()
            frames.append(_Alternative(at_start=top.at_start and not top.consumed, ended=top.ended))
            continue
        if token == ")" and len(frames) > 1:
            done = frames.pop()
            frames[-1].consumed |= done.any_consumed or done.consumed
            frames[-1].ended |= done.any_ended or done.ended
            frames[-1].anchored |= done.anchored
            closed_anchored = done.anchored
            continue
        if token == "|":
            top.any_consumed |= top.consumed
            top.any_ended |= top.ended
            outer_ended = frames[-2].ended if len(frames) > 1 else False
            top.consumed, top.ended = False, outer_ended
            continue
        if token == "^":
            if not top.at_start or top.consumed:
                return "a '^' after what matches a character (xgrammar ignores anchors inside a regex)"
            top.anchored = True
            continue
        if token == "$":
            top.ended = top.anchored = True
            continue
        if quantifier := _QUANTIFIER.match(regex, match.start()):
            if group_before and _repeats(quantifier.group()):
                return "an anchor inside a repeated group (xgrammar ignores anchors inside a regex)"
            pos = quantifier.end()
            continue
        if top.ended:
            return "a '$' before what matches a character (xgrammar ignores anchors inside a regex)"
        top.consumed = True
        in_class = token.startswith("[")
    return None


_COUNT = re.compile(r"\{\d+(?:,\d*)?\}")


def _classified(regex: str) -> Iterator[tuple[re.Match[str], bool]]:
    """Each token of `regex` and whether it lies inside a character class (its closing `]` too, its `[`
    not). A class ends at its first `]`, where xgrammar ends it."""
    in_class = False
    for match in _PATTERN_TOKEN.finditer(regex):
        inside = in_class
        if in_class:
            in_class = match.group() != "]"
        elif match.group().startswith("["):
            in_class = True
        yield match, inside


def _json_pattern_for_xgrammar(pattern: str, dots: bool = True) -> str:
    """A JSON schema's `pattern` (checked by _pattern_problem) written so that xgrammar reads it as
    ECMA-262 does: each optional group `(...)?` as `(...){0,1}` (xgrammar made the start of an optional
    group that ends in a repeat optional too: `^a(xy+)?b$` took "ayb"); each character past ASCII as
    `\\uXXXX` and a `]` outside a class as `\\]` (either one, as written, turned off xgrammar's JSON
    escaping for the whole pattern: `^é.$` let a raw `"` out); a `{` that begins no count as `\\{` (a
    literal in ECMA-262: xgrammar read `a{ 1}` as `a`); with `dots`, a `.` as a class without the line
    terminators."""
    out: list[str] = []
    for match, inside in _classified(pattern):
        token = match.group()
        if len(token) == 1 and ord(token) >= 0x7F:
            token = f"\\u{ord(token):04x}"
        elif inside:
            pass  # (a class's members are as ECMA-262 reads them)
        elif token == "." and dots:  # ECMA-262's dot takes no line terminator; xgrammar's took U+2028/9
            token = "[^\\n\\r\\u2028\\u2029]"
        elif token == "]":
            token = "\\]"
        elif token == "{" and not _COUNT.match(pattern, match.start()):
            token = "\\{"
        elif token == "?" and out and out[-1] == ")":
            token = "{0,1}"
        out.append(token)
    return "".join(out)


def _regex_text_for_xgrammar(regex: str) -> str:
    """`regex` with each `.` outside a class written `[^\\n]`: xgrammar's `.` takes a newline too, Python's
    and ECMA-262's do not (`..` gave "\\n\\n"). Classes end where xgrammar ends them, at the first `]`.
    Each `\\xHH` is written `\\u00HH`: xgrammar reads as many hex digits as follow `\\x` (`\\x41BC` took
    U+41BC, not "ABC")."""

    def written(token: str, inside: bool) -> str:
        if token == "." and not inside:
            return "[^\\n]"
        if len(token) == 4 and token.startswith("\\x"):
            return "\\u00" + token[2:]
        return token

    return "".join(written(match.group(), inside) for match, inside in _classified(regex))


def _name_fits(name: str, names_schema: dict[str, Any], searches: _PatternSearches) -> bool:
    """Whether property name `name` is valid under a propertyNames schema of string keywords; False for a
    schema with any other keyword, or a pattern whose search `searches` cannot finish (not checked here)."""
    keys = {k for k in names_schema if k not in _ANNOTATIONS and not k.startswith("x-")}
    if not keys <= {"type", "minLength", "maxLength", "pattern", "enum", "const"}:
        return False
    kind = names_schema.get("type", "string")
    if kind != "string" and not (isinstance(kind, list) and "string" in kind):
        return False
    try:  # (a keyword of the wrong type: not checked, so refused)
        if not names_schema.get("minLength", 0) <= len(name) <= names_schema.get("maxLength", len(name)):
            return False
        if "enum" in names_schema and name not in names_schema["enum"]:
            return False
        if "const" in names_schema and name != names_schema["const"]:
            return False
        pattern = names_schema.get("pattern")
        return pattern is None or (isinstance(pattern, str) and searches.search(pattern, name) is True)
    except TypeError:
        return False


def _resolved(schema: Any, root: Any) -> Any:
    """`schema` with its `$ref` (a JSON pointer into `root`, read as _pointer_parts reads it) followed,
    through chains; None where a pointer leads nowhere or the chain loops."""
    for _ in range(32):
        if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
            return schema
        ref = schema["$ref"]
        parts = () if ref == "#" else _pointer_parts(ref)
        if parts is None:
            return None
        schema = _at(root, parts)
    return None


def _literal_values(schema: dict[str, Any]) -> list[Any] | None:
    """The values a `const` or `enum` schema allows (None: not such a schema)."""
    if "const" in schema:
        return [schema["const"]]
    values = schema.get("enum")
    return values if isinstance(values, list) else None


def _types(schema: dict[str, Any]) -> set[str] | None:
    """The JSON types a schema's values can have, "integer" counted as "number" (None: it does not say)."""
    values = _literal_values(schema)
    if values is not None:
        order = ("null", "boolean", "string", "array", "object", "number")
        named: list[Any] = [next((k for k in order if _JSON_TYPES[k](v)), None) for v in values]
    else:
        kind = schema.get("type")
        named = kind if isinstance(kind, list) else [kind]
    if not named or not all(isinstance(k, str) and k in _JSON_TYPES for k in named):
        return None
    return {"number" if k == "integer" else str(k) for k in named}


def _value_key(value: Any) -> Any:
    """A hashable key of a JSON value, equal for the same JSON value: 1 and 1.0 alike, true apart from 1
    (non-finite numbers, which JSON lacks, by their text)."""
    if isinstance(value, bool) or value is None:
        return (type(value).__name__, value)
    if isinstance(value, (int, float)):
        return ("number", Fraction(value) if math.isfinite(value) else repr(value))
    if isinstance(value, str):
        return ("string", value)
    if isinstance(value, list):
        return ("array", tuple(_value_key(v) for v in value))
    if isinstance(value, dict):
        return ("object", frozenset((k, _value_key(v)) for k, v in value.items()))
    return ("other", repr(value))


def _disjoint_values(a: list[Any], b: list[Any]) -> bool:
    return not {_value_key(v) for v in a} & {_value_key(v) for v in b}


def _discriminated(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two object schemas both require a property whose literal values differ between them."""
    props_a, props_b = a.get("properties"), b.get("properties")
    required_a, required_b = a.get("required"), b.get("required")
    if not (isinstance(props_a, dict) and isinstance(props_b, dict)):
        return False
    if not (isinstance(required_a, list) and isinstance(required_b, list)):
        return False
    for name in set(map(str, required_a)) & set(map(str, required_b)):
        sub_a, sub_b = props_a.get(name), props_b.get(name)
        values_a = _literal_values(sub_a) if isinstance(sub_a, dict) else None
        values_b = _literal_values(sub_b) if isinstance(sub_b, dict) else None
        if values_a is not None and values_b is not None and _disjoint_values(values_a, values_b):
            return True
    return False


def _apart(branches: list[Any], root: Any) -> bool | None:
    """Whether no JSON value can match two of `branches` (oneOf's promise), as far as their types, their
    literal values, or a required property with literal values tell them apart; None where there are
    more than _MAX_ONEOF_PAIRS pairs to compare one by one (not every branch a const or an enum)."""
    schemas = [_resolved(b, root) for b in branches]
    literals = [_literal_values(s) if isinstance(s, dict) else None for s in schemas]
    every_literal = all(values is not None for values in literals)
    if len(schemas) * (len(schemas) - 1) // 2 > _MAX_ONEOF_PAIRS and not every_literal:
        return None
    if not all(isinstance(s, dict) for s in schemas):
        return len(schemas) == 1 and schemas[0] is not None
    if every_literal:  # every branch a const or enum: one pass
        owner: dict[Any, int] = {}
        for i, values in enumerate(literals):
            for value in values or ():
                if owner.setdefault(_value_key(value), i) != i:
                    return False
        return True
    for i, a in enumerate(schemas):
        for b in schemas[i + 1 :]:
            types_a, types_b = _types(a), _types(b)
            if types_a is not None and types_b is not None and not types_a & types_b:
                continue
            values_a, values_b = _literal_values(a), _literal_values(b)
            if values_a is not None and values_b is not None and _disjoint_values(values_a, values_b):
                continue
            if types_a == types_b == {"object"} and _discriminated(a, b):
                continue
            return False
    return True


def _literals_of(branches: Any, kinds: set[Any]) -> bool:
    """Whether `branches` (an anyOf or oneOf) are all `const` or `enum` schemas whose every value has one
    of the JSON types `kinds`."""
    if not (kinds and kinds <= _JSON_TYPES.keys() and isinstance(branches, list) and branches):
        return False
    for branch in branches:
        if not isinstance(branch, dict):
            return False
        keys = {k for k in branch if k not in _ANNOTATIONS and not k.startswith("x-")}
        if keys - {"type"} == {"const"}:
            values = [branch["const"]]
        elif keys - {"type"} == {"enum"} and isinstance(branch["enum"], list):
            values = branch["enum"]
        else:
            return False
        if not all(any(_JSON_TYPES[k](v) for k in kinds) for v in values):
            return False
    return True


def _hidden_token_ids(tokenizer: Any, vocab_size: int) -> set[int]:
    """The special ids whose text a decode with skip_special_tokens leaves out: grammars never allow them,
    whatever a request's skip_special_tokens (xgrammar would read their literal text)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids |= {i for i, token in added.items() if getattr(token, "special", False)}
    return {i for i in ids if 0 <= i < vocab_size and tokenizer.decode([i], skip_special_tokens=True) == ""}


def _is_lark(grammar: str) -> bool:
    """vLLM's test of a grammar's syntax: Lark (`start: ...`) unless a rule is written `name ::= ...`
    (GBNF/EBNF), comments (# and //) aside."""
    lines = (re.sub(r"(#|//).*$", "", line).strip() for line in grammar.split("\n"))
    return not any("::=" in line for line in lines)


def _choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of `choices` (each a JSON-escaped string literal)."""
    # (not ASCII-escaped: xgrammar reads a \ud83d surrogate pair as two code points)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer and vocabulary (the model's: ids past the
    tokenizer's are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compiler: Any = None
        self._lock = threading.Lock()
        # The grammars compiled last, by the identity of their StructuredOutputsParams (kept here, so the
        # id stays theirs): the server compiles in its request threads and the engine thread then takes
        # the same object's grammar without compiling again, whatever xgrammar's cache evicted since.
        self._recent: OrderedDict[int, tuple[StructuredOutputsParams, Any]] = OrderedDict()
        self._utf8: Utf8Masks | None = None  # made with the xgrammar compiler

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar
                except ImportError:
                    raise ConfigError(
                        "structured outputs need xgrammar (`pip install xgrammar`; scripts/setup.sh "
                        "installs it)"
                    ) from None
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids or None
                )
                hidden = _hidden_token_ids(self._tokenizer, self.vocab_size)
                if hidden:
                    # xgrammar read special tokens (<s>, <|im_start|>) as their literal text, so a grammar
                    # took them inside a string or a regex while the output text leaves them out: an empty
                    # text is special to xgrammar (never allowed), so those ids get one.
                    vocab = [b"" if i in hidden else t for i, t in enumerate(info.decoded_vocab)]
                    info = xgrammar.TokenizerInfo(
                        vocab, vocab_type=xgrammar.VocabType.RAW, vocab_size=self.vocab_size,
                        stop_token_ids=info.stop_token_ids, add_prefix_space=info.add_prefix_space,
                    )  # fmt: skip
                # Bounded: a server caches the grammars its clients send.
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=4, cache_enabled=True, cache_limit_bytes=256 << 20
                )
                self._utf8 = Utf8Masks(
                    [b"" if i in hidden else t for i, t in enumerate(info.decoded_vocab)], self.vocab_size
                )
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec`; InvalidRequestError naming the field for a bad schema, regex or
        grammar. Safe to call from any thread."""
        with self._lock:
            recent = self._recent.get(id(spec))
            if recent is not None and recent[0] is spec:
                self._recent.move_to_end(id(spec))
                return recent[1]
        compiled = self._compile(spec)
        self._check_satisfiable(spec, compiled)
        with self._lock:
            self._recent[id(spec)] = (spec, compiled)
            while len(self._recent) > _RECENT_GRAMMARS:
                self._recent.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        import xgrammar

        compiler = self._xgrammar_compiler()
        field, what = "structured_outputs", "the constraint"
        try:
            if spec.json is not None:
                field, what = "json", "the JSON schema"
                try:
                    parsed = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
                except ValueError as exc:
                    raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}", "json") from None
                schema = json.dumps(_document_for_xgrammar(parsed))
                whitespace = not spec.disable_any_whitespace
                grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=whitespace)
                return compiler.compile_grammar(_json_strings_kept_valid(grammar, only_json=True))
            if spec.structural_tag is not None:
                field, what = "structural_tag", "the structural tag"
                return _compile_structural_tag(compiler, spec.structural_tag)
            if spec.json_object:
                field, what = "json_object", "the JSON grammar"
                # OpenAI's json_object is an object (as vLLM compiles it), not any JSON value.
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=not spec.disable_any_whitespace
                )
            if spec.regex is not None:
                field, what = "regex", "the regex"
                return compiler.compile_regex(_regex_for_xgrammar(spec.regex))
            if spec.choice is not None:
                field, what = "choice", "the choices"
                return compiler.compile_grammar(_choice_grammar(list(spec.choice)))
            field, what = "grammar", "the grammar"
            if spec.grammar is not None and _is_lark(spec.grammar):
                what = "the Lark grammar"
                compile_lark = getattr(compiler, "compile_lark", None)
                if compile_lark is None:
                    raise InvalidRequestError(
                        "Lark grammars need a newer xgrammar (one with GrammarCompiler.compile_lark); "
                        "write the grammar in EBNF (rules as `name ::= ...`)",
                        "grammar",
                    )
                return compile_lark(spec.grammar)
            return compiler.compile_grammar(spec.grammar)
        except InvalidRequestError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:
            lines = [line for line in str(exc).strip().splitlines() if line.strip(" ^")]
            # the line that says what is wrong (a Lark error's last lines quote the grammar and mark it)
            last = lines[-1] if lines else type(exc).__name__
            detail = next((line for line in lines if "error" in line.lower()), last)
            # xgrammar prefixes its messages with a timestamp and a source location.
            detail = detail.split(": ", 1)[-1] if detail.startswith("[") else detail
            raise InvalidRequestError(f"{what} is not valid: {detail}", field) from None

    def _check_satisfiable(self, spec: StructuredOutputsParams, compiled: Any) -> None:
        """InvalidRequestError for a constraint that allows no first token (nor the end): its request could
        only sample a token the grammar refuses."""
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            field = next((n for n in CONSTRAINT_FIELDS if getattr(spec, n) is not None), "json_object")
            raise InvalidRequestError(
                f"structured_outputs.{field} allows no output that this model's tokens can spell", field
            )

    def matcher(self, compiled: Any) -> GrammarState:
        import xgrammar

        self._xgrammar_compiler()  # (the UTF-8 masks come with it)
        assert self._utf8 is not None
        return GrammarState(xgrammar.GrammarMatcher(compiled), self._utf8)


# UTF-8's byte automaton (RFC 3629): state 0 lies between characters; 1 awaits one more continuation byte
# (80-BF), 3 two; 2, 4, 5, 6 and 7 await the first continuation after E0 (A0-BF: no overlong form), ED
# (80-9F: no surrogate), F0 (90-BF), F1-F3 (80-BF) and F4 (80-8F: nothing past U+10FFFF). -1: not UTF-8.
_UTF8_STATES = 8


def _utf8_table() -> list[list[int]]:
    table = [[-1] * 256 for _ in range(_UTF8_STATES)]
    for byte in range(256):
        if byte < 0x80:
            table[0][byte] = 0
        elif 0xC2 <= byte <= 0xDF:
            table[0][byte] = 1
        elif 0xE0 <= byte <= 0xEF:
            table[0][byte] = {0xE0: 2, 0xED: 4}.get(byte, 3)
        elif 0xF0 <= byte <= 0xF4:
            table[0][byte] = {0xF0: 5, 0xF4: 7}.get(byte, 6)
    for state, (low, high, then) in {1: (0x80, 0xBF, 0), 2: (0xA0, 0xBF, 1), 3: (0x80, 0xBF, 1),
                                     4: (0x80, 0x9F, 1), 5: (0x90, 0xBF, 3), 6: (0x80, 0xBF, 3),
                                     7: (0x80, 0x8F, 3)}.items():  # fmt: skip
        for byte in range(low, high + 1):
            table[state][byte] = then
    return table


class Utf8Masks:
    """For each UTF-8 state, the tokens whose bytes may follow it, as an xgrammar bitmask row, and the state
    each one leaves. xgrammar's byte-level rules for negated classes (a string's characters, `[^a]`) took
    byte tokens that spell no UTF-8 (overlong forms, surrogates): the text then held one U+FFFD per byte,
    past a maxLength or a pattern. Tokens without bytes (special ones) change nothing."""

    def __init__(self, token_bytes: list[bytes], vocab_size: int) -> None:
        import torch

        table = _utf8_table()
        # next_state[s, t]: the state after token t from state s; -1 where t may not follow s
        self.next_state = np.full((_UTF8_STATES, vocab_size), -1, dtype=np.int8)
        self.next_state[:, len(token_bytes) :] = np.arange(_UTF8_STATES)[:, None]  # (the grammar's to refuse)
        for token, spelled in enumerate(token_bytes[:vocab_size]):
            if not spelled:
                self.next_state[:, token] = np.arange(_UTF8_STATES)
                continue
            if spelled.isascii():  # most tokens: only between characters, and they stay there
                self.next_state[0, token] = 0
                continue
            for start in range(_UTF8_STATES):
                state = start
                for byte in spelled:
                    state = table[state][byte]
                    if state < 0:
                        break
                self.next_state[start, token] = state
        words = (vocab_size + 31) // 32
        allowed = np.zeros((_UTF8_STATES, words * 32), dtype=bool)
        allowed[:, :vocab_size] = self.next_state >= 0
        bits = allowed.reshape(_UTF8_STATES, words, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
        packed = bits.sum(axis=2).astype(np.uint32).view(np.int32)
        self.masks = torch.from_numpy(np.ascontiguousarray(packed))


class GrammarState:
    """One request's position in its grammar, and in UTF-8 (see Utf8Masks)."""

    def __init__(self, matcher: Any, utf8: Utf8Masks) -> None:
        self._matcher = matcher
        self._utf8 = utf8
        self._utf8_state = 0

    def accept(self, token: int) -> bool:
        """Advance on a sampled token; False if the grammar does not allow it (then nothing changes)."""
        if not self._matcher.accept_token(token):
            return False
        table = self._utf8.next_state
        following = int(table[self._utf8_state, token]) if token < table.shape[1] else 0
        self._utf8_state = max(following, 0)  # (not UTF-8 only where fill() had to allow it: start again)
        return True

    @property
    def finished(self) -> bool:
        """The grammar is complete and its stop token was taken: nothing may follow."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: Any, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        valid = bitmask[row] & self._utf8.masks[self._utf8_state]
        # A class whose every valid continuation the grammar excludes (`[^\uD000-\uD7FF]` after byte
        # ED) leaves nothing valid: the grammar's own choice then, rather than no token at all.
        if bool(valid.any()):
            bitmask[row] = valid


def pack_bitmasks(states: list[GrammarState | None], vocab_size: int) -> bytes:
    """The allowed-token bitmask of each state, one row each, as little-endian int32 words; None: every
    token (a request that ended, whose token is dropped)."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(states), vocab_size)  # all allowed
    for row, state in enumerate(states):
        if state is not None:
            state.fill(bitmask, row)
    return np.ascontiguousarray(bitmask.numpy(), dtype="<i4").tobytes()
