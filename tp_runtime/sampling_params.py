"""User-facing sampling parameters (shaped like vLLM's), validated on construction and on each assignment.

Options that travel to the workers are bounded here to what the workers store (int64 ids and seeds,
float32 settings), so a value that fits nowhere is an InvalidRequestError quoting it, never an overflow
inside a step. Checks that need the model (the vocabulary size) are in `LLMEngine.validate_params`.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass, fields, replace
from typing import Any

from tp_runtime.errors import InvalidRequestError

# Temperatures below this are treated as greedy (avoids dividing logits by ~0).
GREEDY_EPS = 1e-5
_INT64_END = 2**63
_FLOAT32_TINY, _FLOAT32_MAX = 1.2e-38, 3.4e38  # normal float32 range


_INT_FIELDS = (
    "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "n", "best_of", "prompt_logprobs",
    "truncate_prompt_tokens",
)  # fmt: skip
_REAL_FIELDS = (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
)  # fmt: skip

# StructuredOutputsParams' constraints given by value (json_object is a flag).
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on what a request may generate (vLLM's names), enforced by masking each step's
    logits with xgrammar: `json` (a JSON schema, as a dict or its text), `regex`, `choice` (one of these
    strings exactly), `grammar` (EBNF, xgrammar's GBNF dialect, with a `root` rule), `json_object=True`
    (any JSON object) or `structural_tag` (xgrammar's structural tag, as a dict or its text: free text in
    which each trigger starts a tagged structure, vLLM's {"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}, or any {"type": "structural_tag", "format": {...}}). `disable_any_whitespace`: JSON
    without whitespace between its tokens."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    structural_tag: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        given = [n for n in CONSTRAINT_FIELDS if getattr(self, n) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object, "
                "structural_tag; got "
                + (", ".join(given) if given else "none"),
                "structured_outputs",
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequestError(
                "structured_outputs.json must be a JSON schema (a dict or its text)", "json"
            )
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise InvalidRequestError(
                "structured_outputs.structural_tag must be a structural tag (a dict or its text)",
                "structural_tag",
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"structured_outputs.{name} must be a non-empty string", name)
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidRequestError(
                "structured_outputs.choice must be a list of non-empty strings", "choice"
            )
        flags = (self.json_object, self.disable_any_whitespace)
        if flags[0] not in (None, True, False) or not isinstance(flags[1], bool):
            raise InvalidRequestError(
                "structured_outputs.json_object and disable_any_whitespace are booleans"
            )


def _shown(value: Any) -> str:
    """`value` as an error message quotes it: cut short (a list of a million items would make the error
    as large as the request)."""
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


@dataclass
class SamplingParams:
    """A request's sampling options (vLLM's names and defaults), validated on construction and again on
    each assignment (`params.max_tokens = 64`, as vLLM's examples set them on get_default_sampling_params()),
    so an invalid value is an InvalidRequestError there. The engine takes a copy when a request is added:
    later changes reach later requests only."""

    # vLLM's order: the first positional argument is n (SamplingParams(2) asks for two samples).
    n: int = 1
    # Samples drawn per prompt, of which the n with the highest cumulative logprob are returned (None: n).
    best_of: int | None = None
    # vLLM's penalties. repetition_penalty (HF/CTRL style, 1 = off) divides positive logits and multiplies
    # negative ones of every token in the prompt or the output so far; presence_penalty (0 = off) is
    # subtracted from the logit of every token in the output so far and frequency_penalty (0 = off) once
    # per occurrence there (OpenAI style). They change what is sampled, not the returned logprobs.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None  # None (or -1, as in vLLM): unseeded
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs to return besides the sampled token
    prompt_logprobs: int | None = None  # top logprobs per prompt position (the first is None), as vLLM
    # vLLM's: False leaves the outputs without text (text "", logprobs without decoded tokens).
    detokenize: bool = True
    skip_special_tokens: bool = True  # the text leaves special tokens out (<|im_end|>, </s>), as vLLM's
    # vLLM's: a space between special tokens in the text. Given to a slow tokenizer's decode, which reads
    # it in transformers 4 only; a fast tokenizer's text is the same either way, as in vLLM.
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) in the text
    # vLLM's: keep only the prompt's last k tokens (-1: max_model_len of them); None: the whole prompt.
    truncate_prompt_tokens: int | None = None
    # A grammar the output must follow (JSON schema, regex, choice, EBNF); None: unconstrained.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's (OpenAI's logit_bias): token id -> a number in [-100, 100] added to its logit before the
    # penalties and sampling; -100 all but bans a token, 100 all but forces it.
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids may be sampled (None: any).
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never generated. Each is tokenized alone, and with a space before it (where that is
    # another token sequence of the same length); the last token of a sequence is never sampled where
    # the output so far ends with the tokens before it.
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid SamplingParams: {msg}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_real(v: object) -> bool:
            return (is_int(v) or isinstance(v, float)) and math.isfinite(v)  # type: ignore[arg-type]

        # numpy's scalars (np.int64, np.float32) as the Python numbers they stand for.
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (int, bool)):
                object.__setattr__(self, name, int(value))
        for name in _REAL_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (int, float, bool)):
                object.__setattr__(self, name, float(value))
        # Workers hold it as float32: it must stay finite there too.
        if not is_real(self.temperature) or not 0 <= self.temperature <= _FLOAT32_MAX:
            got = self.temperature
            raise bad(f"temperature must be a number in [0, {_FLOAT32_MAX:g}] (0 means greedy), got {got!r}")
        if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or not -1 <= self.top_k < _INT64_END:
            raise bad(f"top_k must be -1 or 0 (disabled) or a positive int below 2**63, got {self.top_k!r}")
        if not is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad(f"max_tokens must be an int >= 1 or None (to max_model_len), got {self.max_tokens!r}")
        max_tokens = math.inf if self.max_tokens is None else self.max_tokens
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= max_tokens:
            raise bad(
                f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if is_int(self.seed) and self.seed == -1:
            # vLLM's convention (and many UIs'): -1 asks for no seed, not for the seed -1.
            object.__setattr__(self, "seed", None)
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            raise bad(f"seed must be None or an int that fits in 64 bits (signed), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):  # the engine caps it at the vocab
                raise bad(f"{name} must be None or an int >= 0, got {value!r}")
        if not is_int(self.n) or self.n < 1:
            raise bad(f"n must be an int >= 1, got {self.n!r}")
        if self.best_of is not None:
            if not is_int(self.best_of) or self.best_of < self.n:
                raise bad(f"best_of must be None or an int >= n={self.n}, got {self.best_of!r}")
            if self.best_of > 1 and is_real(self.temperature) and self.temperature < GREEDY_EPS:
                raise bad(
                    f"best_of={self.best_of} with greedy sampling (temperature 0) would draw the same "
                    "sample each time; leave best_of out or set temperature > 0"
                )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_real(value) or not -2.0 <= value <= 2.0:
                raise bad(f"{name} must be a number in [-2, 2] (0 disables it), got {value!r}")
        rep = self.repetition_penalty
        # Workers hold it as float32: it must stay a positive finite number there too.
        if not is_real(rep) or not _FLOAT32_TINY <= rep <= _FLOAT32_MAX:
            raise bad(f"repetition_penalty must be a number > 0 (1 disables it), got {rep!r}")
        for name in (
            "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
            "spaces_between_special_tokens", "detokenize",
        ):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, (list, tuple))
            or not all(is_int(t) and t >= 0 for t in self.stop_token_ids)
        ):
            raise bad(
                f"stop_token_ids must be a list of non-negative ints, got {_shown(self.stop_token_ids)}"
            )
        constraint = self.structured_outputs
        if constraint is not None and not isinstance(constraint, StructuredOutputsParams):
            raise bad(f"structured_outputs must be a StructuredOutputsParams, got {constraint!r}")
        if constraint is not None and self.min_tokens:
            # Its grammar may be complete, allowing only EOS, before min_tokens: nothing could be sampled.
            raise bad("min_tokens must be 0 with structured_outputs (the grammar decides where it ends)")
        bias = self.logit_bias
        if bias is not None:
            entry = (
                next(((t, v) for t, v in bias.items() if not (is_int(t) and 0 <= t < _INT64_END and is_real(v)
                                                             and -100 <= v <= 100)), None)
                if isinstance(bias, dict) else bias
            )  # fmt: skip
            if entry is not None:  # quoted alone: the whole mapping may be huge
                raise bad(
                    f"logit_bias must map token ids (ints >= 0) to numbers in [-100, 100], got {entry!r}"
                )
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (list, tuple)) or not allowed:
                raise bad(
                    "allowed_token_ids must be a non-empty list of token ids (ints >= 0), got "
                    + _shown(allowed)
                )
            wrong = next((t for t in allowed if not (is_int(t) and 0 <= t < _INT64_END)), None)
            if wrong is not None:
                raise bad(
                    f"allowed_token_ids must be a non-empty list of token ids (ints >= 0), got {wrong!r}"
                )
        k = self.truncate_prompt_tokens
        if k is not None and (not is_int(k) or not (k >= 1 or k == -1)):
            raise bad(
                f"truncate_prompt_tokens must be None, -1 (max_model_len) or an int >= 1 (the prompt's last "
                f"tokens to keep), got {k!r}"
            )
        words = self.bad_words
        if words is not None and (
            not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words)
        ):
            raise bad(
                f"bad_words must be a list of words (strings with a non-space character), got {_shown(words)}"
            )
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
                raise bad(f"stop must be a non-empty string or a list of them, got {_shown(self.stop)}")
            if stops and not self.detokenize:
                raise bad("stop strings need detokenize=True: they are looked for in the output's text")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SAMPLING_FIELDS and name in self.__dict__:  # (set before: not __init__ setting it)
            # Checked as a whole (a field's bounds may depend on others), and normalized as on construction.
            value = getattr(replace(self, **{name: value}), name)
        object.__setattr__(self, name, value)

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's): its lists and dicts are its own."""
        return copy.deepcopy(self)

    @property
    def samples(self) -> int:
        """Samples drawn per prompt: best_of, else n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def truncated_prompt(prompt_ids: Any, keep: int | None, max_model_len: int) -> Any:
    """`prompt_ids` as `truncate_prompt_tokens=keep` asks (vLLM's): its last `keep` tokens, -1 meaning
    max_model_len of them, None all; InvalidRequestError when keep passes max_model_len (as vLLM says it).
    Anything but a list or tuple is returned as it is, for the prompt's own checks to name."""
    if keep is None:
        return prompt_ids
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_model_len}). Please, "
            "select a smaller truncation size.",
            "truncate_prompt_tokens",
        )
    return prompt_ids[-keep:] if isinstance(prompt_ids, (list, tuple)) else prompt_ids
