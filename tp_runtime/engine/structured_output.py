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
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from tp_runtime.errors import ConfigError, InvalidRequestError
from tp_runtime.sampling_params import StructuredOutputsParams

_RECENT_GRAMMARS = 64  # requests between a server thread's compile and the engine thread's add


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
                # Bounded: a server caches the grammars its clients send.
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=4, cache_enabled=True, cache_limit_bytes=256 << 20
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
        with self._lock:
            self._recent[id(spec)] = (spec, compiled)
            while len(self._recent) > _RECENT_GRAMMARS:
                self._recent.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        compiler = self._xgrammar_compiler()
        field, what = "structured_outputs", "the constraint"
        try:
            if spec.json is not None:
                field, what = "json", "the JSON schema"
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return compiler.compile_json_schema(schema, any_whitespace=not spec.disable_any_whitespace)
            if spec.json_object:
                field, what = "json_object", "the JSON grammar"
                # OpenAI's json_object is an object (as vLLM compiles it), not any JSON value.
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=not spec.disable_any_whitespace
                )
            if spec.regex is not None:
                field, what = "regex", "the regex"
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                field, what = "choice", "the choices"
                return compiler.compile_grammar(_choice_grammar(list(spec.choice)))
            field, what = "grammar", "the grammar"
            return compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            # xgrammar prefixes its messages with a timestamp and a source location.
            detail = detail.split(": ", 1)[-1] if detail.startswith("[") else detail
            raise InvalidRequestError(f"{what} is not valid: {detail}", field) from None

    def matcher(self, compiled: Any) -> GrammarState:
        import xgrammar

        return GrammarState(xgrammar.GrammarMatcher(compiled))


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance on a sampled token; False if the grammar does not allow it (then nothing changes)."""
        return bool(self._matcher.accept_token(token))

    @property
    def finished(self) -> bool:
        """The grammar is complete and its stop token was taken: nothing may follow."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: Any, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


def pack_bitmasks(states: list[GrammarState | None], vocab_size: int) -> bytes:
    """The allowed-token bitmask of each state, one row each, as little-endian int32 words; None: every
    token (a request that ended, whose token is dropped)."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(states), vocab_size)  # all allowed
    for row, state in enumerate(states):
        if state is not None:
            state.fill(bitmask, row)
    return np.ascontiguousarray(bitmask.numpy(), dtype="<i4").tobytes()
