"""LLMEngine: the driver's step loop (scheduler, executor), tokenizer-side checks and stop conditions.

Requests come in through `add_request` and leave through `step()`, which returns `RequestOutput`s: for a
request added with `stream=True`, one per step that gave it a token (the new token ids, the text they
add, their logprobs; `finished` on the last), else one when it finishes, with the whole output.
`abort_request` ends a request wherever it is. One thread drives an engine: `LLM` in the caller's thread,
`AsyncLLMEngine` in its own.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import numbers
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tp_runtime.config import (
    EngineConfig,
)
from tp_runtime.engine.pacing import StepPacer
from tp_runtime.engine.scheduler import Request, Scheduler
from tp_runtime.engine.structured_output import GrammarCompiler, pack_bitmasks
from tp_runtime.errors import ConfigError, InvalidRequestError
from tp_runtime.executor.base import Executor, make_executor
from tp_runtime.messages import (
    GrammarMask,
    ModelRunnerOutput,
    RequestSampling,
    SchedulerOutput,
    sampling_ids_limit,
)
from tp_runtime.outputs import CompletionOutput, Logprob, RequestOutput
from tp_runtime.sampling_params import SamplingParams, truncated_prompt


def _common_prefix(a: str, b: str) -> int:
    """The number of leading characters `a` and `b` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    same = 0
    while a[same] == b[same]:
        same += 1
    return same


def byte_run_probe(tokenizer: Any, decode: Callable[[list[int]], str]) -> int | None:
    """The token IncrementalDetokenizer puts after a text to learn whether a later byte token could still
    rewrite it, for a decoder that does: SentencePiece-style byte fallback (Llama 2, Mistral: byte tokens
    `<0xE4>`; tokenizers' ByteFallback decoder) decodes a run of consecutive byte tokens that is not valid
    UTF-8 as one U+FFFD per byte, so the text of a run ("中" from <0xE4><0xB8><0xAD>) may change until a
    token that is not a byte ends the run. The probe is a byte token that can never be part of a character
    (0xFF, else the highest non-ASCII one the vocabulary has: each makes a valid run invalid). None where
    the vocabulary has no byte tokens, or where its decoder keeps the text before such a byte (byte-level
    BPE and SentencePiece's own decoder make only the invalid bytes U+FFFD: only an unfinished last
    character can change, which the detokenizer's U+FFFD rule covers)."""
    if tokenizer is None or not hasattr(tokenizer, "convert_tokens_to_ids"):
        return None

    def byte_token(byte: int) -> int | None:
        piece = f"<0x{byte:02X}>"
        token = tokenizer.convert_tokens_to_ids(piece)
        if not isinstance(token, int) or tokenizer.convert_ids_to_tokens(token) != piece:
            return None  # not in the vocabulary (the unknown token's id comes back)
        return token

    if all(byte_token(byte) is None for byte in (0x00, 0x41, 0x80, 0xFF)):
        return None  # no byte tokens (a vocabulary that has them has them all)
    probe = None
    for byte in range(0xFF, 0x7F, -1):
        token = byte_token(byte)
        if token is not None and decode([token]) == "\ufffd":
            probe = token
            break
    if probe is None:
        return None
    for byte in range(0x21, 0x7F):  # a printable ASCII byte token: does the probe rewrite its text?
        token = byte_token(byte)
        if token is not None and decode([token]) == chr(byte):
            return None if decode([token, probe]) == chr(byte) + "\ufffd" else probe
    return probe  # no way to tell: probing costs a decode, never correctness


# transformers' clean_up_tokenization (a decode with clean_up_tokenization_spaces, on the whole text): each
# pattern loses its first space (" ' " both), so text may change where its end begins one.
CLEANUP_PATTERNS = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")


def cleanup_tails(tokenizer: Any) -> tuple[str, ...]:
    """The ends of a text that a later token may rewrite where the tokenizer's decode cleans up
    tokenization spaces (WordPiece tokenizers: "don '" becomes "don't" once "t" follows): the beginnings
    of CLEANUP_PATTERNS. None where its decode does not ("a ." stays: transformers leaves BPE alone)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return ()
    try:
        ids = list(tokenizer.encode("a .", add_special_tokens=False))
        cleaned = tokenizer.decode(ids, skip_special_tokens=True)
        raw = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    except Exception:
        cleaned, raw = "", ""
    if cleaned == raw == "a .":
        return ()
    return tuple(sorted({p[:n] for p in CLEANUP_PATTERNS for n in range(1, len(p))}))


@dataclass(frozen=True)
class TextFinality:
    """How to tell that the decode of some tokens is final: that no tokens after them change it (a stream
    may send it). `probe`: byte_run_probe's; `tails`: cleanup_tails'."""

    probe: int | None = None
    tails: tuple[str, ...] = ()
    # Per token id, whether the probe is to be tried after it (_may_continue_run).
    _runs: dict[int, bool] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, tokenizer: Any, decode: Callable[[list[int]], str]) -> TextFinality:
        """For `decode`, the tokenizer's decode (as the engine or the server calls it)."""
        return cls(byte_run_probe(tokenizer, decode), cleanup_tails(tokenizer))

    def is_final(self, decode: Callable[[list[int]], str], tokens: list[int], text: str) -> bool:
        """Whether `text`, the decode of `tokens`, stays the start of the decode whatever tokens follow:
        it does not end in U+FFFD (its last bytes may begin a character that later bytes complete) nor in
        the beginning of a cleanup pattern, and, for a decoder that rewrites byte runs (`probe`), the probe
        byte after it adds its U+FFFD and nothing else (not where it joins a run of bytes before it, also
        one whose text is empty: a space byte that the decoder strips at the start)."""
        if text.endswith("\ufffd") or (self.tails and text.endswith(self.tails)):
            return False
        if self.probe is None or not self._may_continue_run(decode, tokens[-1]):
            return True
        return decode([*tokens, self.probe]) == text + "\ufffd"

    def _may_continue_run(self, decode: Callable[[list[int]], str], token: int) -> bool:
        """Whether a run of byte tokens may go on through `token`, so that the probe is to be tried after
        it: after the probe byte it decodes to U+FFFD twice (a byte token: the run is not UTF-8; or a token
        that is U+FFFD itself) or to the probe's U+FFFD alone (a token without text, such as a special
        token the decode skips). Any other token ends a run. Decoded once per token id."""
        known = self._runs.get(token)
        if known is None:
            assert self.probe is not None
            known = self._runs[token] = decode([self.probe, token]) in ("\ufffd", "\ufffd\ufffd")
        return known


NO_RULES = TextFinality()


class IncrementalDetokenizer:
    """The text of a growing list of token ids, a piece at a time (vLLM's incremental detokenization).

    The text is that of `context + ids` past the text of `context` (the prompt's last tokens): a
    SentencePiece decoder drops the leading space of a text's first word, so the output decoded alone
    would lose the space its first token begins with (vLLM and transformers' text-generation pipeline keep
    it). Each call decodes the tokens from the start of the previous piece on (from the start, for a
    tokenizer that cleans up tokenization spaces), so the decoder sees the same context as in the whole
    text, and keeps what that window adds past the previous piece.

    `text` only ever grows by text that no later token can change (`finality`, TextFinality): a window
    whose text ends in U+FFFD is held back (its last bytes may begin a character the next token completes:
    byte-level BPE splits multi-byte characters), with a byte-run probe so is one that a later byte token
    would rewrite (a byte-fallback run of bytes, until a token that is not a byte ends it), and with cleanup
    tails one whose end a cleanup of tokenization spaces may rewrite. So `text` is always a prefix of the
    output's text; only the held-back tail is missing, which the caller takes from a full decode at the
    end (`output_text`).

    `pending` is the held-back tail as it decoded at the last step whose window did not end in U+FFFD
    (then "" once `text` takes it): `text + pending` is the text as vLLM's detokenizer makes it, which stop
    strings are looked for in (a stop string that byte tokens complete is found at the token that
    completes it, although those bytes' text may still change).
    """

    __slots__ = (
        "_context", "_decode", "_final", "_prefix_offset", "_prefix_text", "_read_offset", "pending", "text",
    )  # fmt: skip

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        context: Sequence[int] = (),
        finality: TextFinality = NO_RULES,
    ) -> None:
        self._decode = decode
        self._context = list(context)
        self._final = finality
        # Offsets into context + ids.
        self._prefix_offset = 0  # start of the previous piece's tokens
        self._read_offset = len(self._context)  # tokens already in `text`
        self._prefix_text: str | None = None  # their decode from _prefix_offset, where kept from a step
        self.text = ""
        self.pending = ""

    def _tokens(self, ids: list[int], start: int, end: int | None = None) -> list[int]:
        """(context + ids)[start:end], without building the whole list."""
        skip = len(self._context)
        head = self._context[start:end] if start < skip else []
        return head + ids[max(0, start - skip) : None if end is None else max(0, end - skip)]

    def step(self, ids: list[int]) -> int | None:
        """Advance to the output `ids` (the previous ones plus new tokens). Returns None when the text
        `text + pending` is as before (the new tokens end inside a character), else how many of its
        leading characters this step left as they were (those past them are new or rewritten)."""
        if len(self._context) + len(ids) <= self._read_offset:
            return None
        start, read = self._prefix_offset, self._read_offset
        tokens = self._tokens(ids, start)
        prefix = self._prefix(tokens, start, read)
        window = self._decode(tokens)
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            return None
        piece = window[len(prefix) :]
        unchanged = len(self.text) + _common_prefix(self.pending, piece)
        if self._final.is_final(self._decode, tokens, window):
            # A cleanup of tokenization spaces matches its patterns left to right through the spaces the
            # decoder puts between tokens: a window from inside the text may match where the whole text
            # does not (" ' ' the" cleans up to "''the" alone, "' the" after "a"), so those windows
            # start where the text does (a decode of the whole output per step, for those tokenizers only;
            # the prefix's decode is this window's).
            start = 0 if self._final.tails else read
            self._prefix_offset, self._read_offset = start, len(self._context) + len(ids)
            self._prefix_text = window if self._final.tails else None
            self.text += piece
            self.pending = ""
        else:
            self.pending = piece
        return unchanged

    def _prefix(self, tokens: list[int], start: int, read: int) -> str:
        """The decode of tokens[: read - start], the window's tokens already in `text`."""
        if self._prefix_text is not None:
            return self._prefix_text
        return self._decode(tokens[: read - start]) if read > start else ""

    def unchanged(self, later: str) -> int:
        """How many leading characters of `text + pending` stay in `later`, a later decode of the output
        (which begins with `text`)."""
        done = len(self.text)
        return done + _common_prefix(self.pending, later[done : done + len(self.pending)])

    def held_chars_kept(self, ids: list[int], next_id: int) -> int:
        """Of the text held back after `ids` (past `text`), the characters that stay as they are with
        `next_id` after them, as far as is known then: not those of a character next_id completes or
        still leaves unfinished (bytes that can no longer make a character stay U+FFFD), nor, with a
        byte-run probe or cleanup tails, those that next_id leaves open to change (a run of byte tokens it
        continues)."""
        start, read = self._prefix_offset, self._read_offset
        if len(self._context) + len(ids) <= read:
            return 0
        tokens = self._tokens(ids, start)
        prefix = self._prefix(tokens, start, read)
        before = self._decode(tokens)
        after = self._final_part([*tokens, next_id], prefix)
        return max(0, _common_prefix(before, after) - len(prefix))

    def _final_part(self, tokens: list[int], known_text: str) -> str:
        """The start of the decode of `tokens` (the window and one more token) that no later token changes,
        as far as can be told: all of it where final, else `known_text`, the decode of the window's tokens
        already in `text` (every longer prefix of the window was found not final as it arrived)."""
        text = self._decode(tokens)
        if self._final == NO_RULES:
            # Only an unfinished last character can change; bytes that can no longer make one stay.
            return text[:-1] if text.endswith("\ufffd") else text
        return text if self._final.is_final(self._decode, tokens, text) else known_text


# The prompt tokens an output's text is decoded after (IncrementalDetokenizer): vLLM's number.
DECODE_CONTEXT_TOKENS = 5
# How far back from the prompt's end decode_context looks for them, past tokens whose text may change.
DECODE_CONTEXT_SEARCH = 64


def decode_context(
    decode: Callable[[list[int]], str], prompt: Sequence[int], finality: TextFinality = NO_RULES
) -> list[int]:
    """The prompt tokens an output is decoded after: the last DECODE_CONTEXT_TOKENS before any at the end
    whose text the output could change (TextFinality: a character they begin, U+FFFD now; with a
    byte-run probe, a run of byte tokens the output could continue, whose characters the decoder turns
    into U+FFFDs if the output's bytes spoil it); none when no such place is near the end."""
    for end in range(len(prompt), max(0, len(prompt) - DECODE_CONTEXT_SEARCH), -1):
        context = list(prompt[max(0, end - DECODE_CONTEXT_TOKENS) : end])
        if finality.is_final(decode, context, decode(context)):
            return context
    return []


def output_text(decode: Callable[[list[int]], str], context: list[int], ids: list[int]) -> str:
    """The text of output `ids` after `context` (decode_context): decoded with it and cut after its text, as
    IncrementalDetokenizer does."""
    return decode(context + ids)[len(decode(context)) :] if context else decode(ids)


@dataclass
class _TextState:
    """Kept for a request that streams or has stop strings."""

    detok: IncrementalDetokenizer
    stream: bool
    stop_strings: list[str] = field(default_factory=list)
    # Characters a streamed request holds back while unfinished: the start of a stop string may be there.
    hold: int = 0
    sent_chars: int = 0  # text reported so far (stream)
    sent_tokens: int = 0  # token ids and logprobs reported so far (stream)
    cumulative_logprob: float = 0.0


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of an n > 1 (or best_of > 1) request, as one engine request: seed + index (as vLLM),
    wrapped into the int64 range so that any seed the user may pass works; prompt logprobs come from the
    first sample only. A best_of sample computes its tokens' logprobs: they rank it."""
    if params.samples == 1:
        return replace(params, best_of=None) if params.best_of is not None else params
    seed = params.seed
    if seed is not None:
        seed = (seed + index + 2**63) % 2**64 - 2**63
    logprobs = params.logprobs
    if params.best_of is not None and logprobs is None:
        logprobs = 0
    child = replace(
        params,
        seed=seed,
        n=1,
        best_of=None,
        logprobs=logprobs,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
    )
    if seed == -1:  # a child's seed -1 is the seed -1: replace() read it as SamplingParams(seed=-1), unseeded
        object.__setattr__(child, "seed", seed)
    return child


def best_samples(params: SamplingParams, samples: list[CompletionOutput]) -> list[CompletionOutput]:
    """What a prompt returns of its samples (in sample order): all of them, or for best_of the n with the
    highest cumulative logprob, best first (the first drawn first among equals), numbered 0..n-1; their
    token logprobs only when the request asked for them."""
    if params.best_of is None:
        return samples
    ranked = sorted(samples, key=lambda c: -(c.cumulative_logprob or 0.0))[: params.n]
    for index, completion in enumerate(ranked):
        completion.index = index
        if params.logprobs is None:
            completion.logprobs = None
    return ranked


def _decode_only(so: SchedulerOutput) -> bool:
    """Every request of the step computes one token (no prompt chunk)."""
    return all(n == 1 for n in so.num_scheduled_tokens)


def _make_decode(
    tokenizer: Any, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
) -> Callable[[list[int]], str]:
    """How the engine turns output ids into text: the tokenizer's decode, with or without special tokens
    (its Rust backend directly when that gives the same text, a few times faster: streaming decodes every
    token; a fast tokenizer's decode puts no spaces between special tokens either way)."""
    if tokenizer is None:  # tests drive the engine with token ids only
        return lambda ids: ""
    skip = skip_special_tokens
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: str(backend.decode(ids, skip_special_tokens=skip))
    # A slow tokenizer's option, True by default: given only when False.
    options = {} if spaces_between_special_tokens else {"spaces_between_special_tokens": False}
    return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=skip, **options))


@dataclass(frozen=True)
class _TextCodec:
    """How a request's output becomes text: the decode (SamplingParams.skip_special_tokens picks one) and
    how to tell that its decode of some tokens is final."""

    decode: Callable[[list[int]], str]
    finality: TextFinality

    @classmethod
    def of(cls, tokenizer: Any, params: SamplingParams) -> _TextCodec:
        if not params.detokenize:
            return cls(_make_decode(None), NO_RULES)
        decode = _make_decode(tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens)
        return cls(decode, TextFinality.of(tokenizer, decode))


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Any, executor: Executor | None = None) -> None:
        """`executor`: how the engine reaches its workers, not yet initialized (default: the one
        make_executor picks for the config)."""
        start = time.perf_counter()
        self.config = config
        self.tokenizer = tokenizer
        self.executor = executor if executor is not None else make_executor(config)
        self.num_kv_blocks = self.executor.initialize()
        try:
            self._set_up(start)
        except BaseException:
            # The workers are running: an error (or a Ctrl-C) from here on would leave them, their
            # sockets and the watchdog behind with no engine to shut them down.
            self.executor.shutdown()
            raise

    def _set_up(self, start: float) -> None:
        """What follows the workers' start: the scheduler, the text codecs, the grammar compiler."""
        config, tokenizer = self.config, self.tokenizer
        if config.device == "cuda":  # with the workers' phase lines (worker.py, model_runner.py)
            print(f"tp-runtime: engine started in {time.perf_counter() - start:.1f} s", file=sys.stderr,
                  flush=True)  # fmt: skip
        max_blocks = -(-config.model.max_model_len // config.cache.block_size)
        if self.num_kv_blocks < max_blocks:
            # num_kv_blocks, when given, is the cache's size: the memory settings would change nothing.
            remedy = (
                f"raise num_kv_blocks to at least {max_blocks}"
                if config.cache.num_kv_blocks is not None
                else "give the cache more memory (gpu_memory_utilization, cpu_kv_cache_gib)"
            )
            raise ConfigError(
                f"the KV cache holds {self.num_kv_blocks} blocks of {config.cache.block_size} tokens but one "
                f"sequence of max_model_len={config.model.max_model_len} needs {max_blocks}; lower "
                f"max_model_len or {remedy}"
            )
        self.scheduler = Scheduler(config, self.num_kv_blocks)
        self.eos_token_ids = set(config.model.eos_token_ids)
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
        if not self.eos_token_ids and not config.model.no_eos and isinstance(tokenizer_eos, int):
            # A checkpoint whose configs name no EOS: the tokenizer's ends generation (as in vLLM). Not
            # where they say there is none (eos_token_id: []), as in transformers' generate.
            self.eos_token_ids.add(tokenizer_eos)
        # As vLLM: an output ended by the tokenizer's EOS has no stop_reason, even where stop_token_ids
        # name it too (or only they do); the generation config's other EOS ids are reported like stop
        # tokens.
        self._primary_eos = tokenizer_eos if isinstance(tokenizer_eos, int) else None
        self._next_req_id = 0
        # By (detokenize, skip_special_tokens, spaces_between_special_tokens); the default's made now, any
        # other when a request first asks for it.
        self._text_codecs: dict[tuple[bool, bool, bool], _TextCodec] = {}
        self._text_codec(SamplingParams())
        self._text_states: dict[int, _TextState] = {}
        self.num_output_tokens = 0  # generated so far, over the engine's life (progress bars read it)
        # Per-step timings (seconds) of the driver's own phases, when enabled (benchmarks).
        self.step_timings: list[dict[str, float]] | None = None
        self.async_scheduling = config.async_scheduling
        # Structured outputs: grammars compiled for this tokenizer, and the constrained requests not yet
        # known to have finished (engine/structured_output.py).
        self.grammars = GrammarCompiler(tokenizer, config.model.vocab_size, sorted(self.eos_token_ids))
        # bad_words as token sequences, encoded once: the server's checks (off the engine thread) encode
        # them, add_request finds them here.
        vocab = config.model.vocab_size
        self._bad_word_ids = functools.lru_cache(maxsize=32)(
            lambda words: bad_word_ids(tokenizer, list(words), vocab)
        )
        self._constrained: set[int] = set()
        # Async scheduling: the step sent last, whose output is read in the next step() call.
        self._in_flight: SchedulerOutput | None = None
        # Timings: when the interval that produces the next output began (the last output's arrival).
        self._interval_start: float | None = None
        # How long a streaming driver may hold the next step for new requests (engine/pacing.py).
        self._pacer = StepPacer()
        if config.device == "cuda":
            # The driver's start-up heap (tokenizer, executor, an in-process worker's model and graphs) out
            # of the cyclic collector's sight, as the workers do (worker.freeze_start_up_objects says why).
            gc.collect()
            gc.freeze()

    # ----------------------------------------------------------------- requests
    def _validate_prompt(self, prompt_ids: Any) -> list[int]:
        vocab = self.config.model.vocab_size
        if not isinstance(prompt_ids, (list, tuple)):
            raise InvalidRequestError(
                f"prompt_token_ids must be a list of ints, got {type(prompt_ids).__name__}", "prompt"
            )
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty; give at least one token", "prompt")
        plain_ints = set(map(type, prompt_ids)) == {int}
        if plain_ints:
            # Plain ints (bool is a subclass, not this type), their range checked in C: a long prompt's ids
            # one at a time in Python would hold up the step that follows by milliseconds.
            in_vocab = min(prompt_ids) >= 0 and max(prompt_ids) < vocab
            suspects: Sequence[Any] = () if in_vocab else [next(t for t in prompt_ids if not 0 <= t < vocab)]
        else:
            suspects = prompt_ids
        for t in suspects:  # the first bad id, whatever is wrong with it
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):  # numpy ints are Integral
                raise InvalidRequestError(f"prompt token ids must be ints, got {t!r}", "prompt")
            if not 0 <= int(t) < vocab:
                outside = f"prompt token id {t} is outside the vocabulary [0, {vocab})"
                raise InvalidRequestError(outside, "prompt")
        max_len = self.config.model.max_model_len
        if len(prompt_ids) >= max_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens but max_model_len is {max_len}; shorten the prompt "
                "or raise max_model_len (a prompt must leave room for at least one generated token)",
                "prompt",
            )
        return list(prompt_ids) if plain_ints else [int(t) for t in prompt_ids]

    def check_request(self, prompt_ids: Any, params: Any) -> list[int]:
        """The checks `add_request` makes, without adding anything (they read only the configuration, so
        any thread may call this); returns the prompt ids as a list, truncated as the request's
        truncate_prompt_tokens asks. Raises InvalidRequestError."""
        keep = getattr(params, "truncate_prompt_tokens", None)
        prompt_ids = truncated_prompt(prompt_ids, keep, self.config.model.max_model_len)
        prompt_ids = self._validate_prompt(prompt_ids)
        self.validate_params(params)
        if params.samples != 1:
            raise InvalidRequestError(
                f"an engine request is one sample, got n={params.n}, best_of={params.best_of}; add one "
                "request per sample "
                "(child_params(params, i))"
            )
        return prompt_ids

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        stream: bool = False,
        grammar: Any = None,
        cache_salt: str | None = None,
    ) -> int:
        """Queue a request; returns its id (`RequestOutput.request_id` is its str). `stream=True`: step()
        reports each new token of it, else only its finished output. `grammar`: its structured_outputs
        compiled already (`self.grammars.compile`, which any thread may call: the server compiles off the
        engine's thread); else it is compiled here. `cache_salt` (vLLM's): its prompt's prefix-cache
        blocks are shared only with requests given the same salt."""
        check_cache_salt(cache_salt)
        params = copy.copy(params)  # what the request runs with: a caller's later changes are not seen
        prompt_ids = self.check_request(prompt_ids, params)
        if params.structured_outputs is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        vocab = self.config.model.vocab_size
        bias = params.logit_bias or {}
        sampling = RequestSampling(
            temperature=float(params.temperature),
            top_p=float(params.top_p),
            # top_k at or above the vocabulary size keeps every token: capped to what workers hold.
            top_k=min(max(int(params.top_k), 0), vocab),
            min_p=float(params.min_p),
            seed=params.seed,
            # No request outlives max_model_len, so a larger min_tokens means the same (and fits int64).
            min_tokens=min(params.min_tokens, self.config.model.max_model_len),
            # As vLLM (and HF's min_new_tokens): EOS is held back too where ignore_eos lets it through.
            stop_token_ids=sorted(stop_ids | self.eos_token_ids) if params.min_tokens else [],
            num_logprobs=-1 if params.logprobs is None else int(params.logprobs),
            repetition_penalty=float(params.repetition_penalty),
            presence_penalty=float(params.presence_penalty),
            frequency_penalty=float(params.frequency_penalty),
            num_prompt_logprobs=-1 if params.prompt_logprobs is None else int(params.prompt_logprobs),
            logit_bias_ids=sorted(bias),
            logit_bias_values=[float(bias[t]) for t in sorted(bias)],
            allowed_token_ids=sorted(set(params.allowed_token_ids or ())),
            bad_words=self._usable_bad_words(params, len(prompt_ids)),
        )
        req_id = self._next_req_id
        self._next_req_id += 1
        request = Request(req_id, prompt_ids, params, sampling)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * (len(prompt_ids) - 1)
        request.stop_ids = frozenset(stop_ids)
        request.masks = TokenMasks.of(sampling)
        request.cache_salt = cache_salt
        codec = self._text_codec(params)
        request.decode_context = decode_context(codec.decode, prompt_ids, codec.finality)
        if params.structured_outputs is not None:
            request.grammar = self.grammars.matcher(grammar)
        text_state = None
        if stream or params.stop_strings:
            stops = params.stop_strings
            text_state = _TextState(
                IncrementalDetokenizer(codec.decode, request.decode_context, codec.finality),
                stream=stream,
                stop_strings=stops,
                hold=max(map(len, stops)) - 1 if stops else 0,
            )
        # Registered only once all of it is built: a request that failed on the way is nowhere.
        self.scheduler.add(request)
        if request.grammar is not None:
            self._constrained.add(req_id)
        if text_state is not None:
            self._text_states[req_id] = text_state
        return req_id

    def _usable_bad_words(self, params: SamplingParams, prompt_len: int) -> list[list[int]]:
        """The request's bad_words sequences that could ever match: those no longer than the most tokens it
        may generate (a longer one's prefix never fits in its output)."""
        if not params.bad_words:
            return []
        room = self.config.model.max_model_len - prompt_len
        most = room if params.max_tokens is None else min(params.max_tokens, room)
        return [ids for ids in self._bad_word_ids(tuple(params.bad_words)) if len(ids) <= most]

    def validate_params(self, params: Any) -> None:
        """Checks of SamplingParams that need the model (its own fields are checked on construction)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"expected SamplingParams, got {type(params).__name__}")
        vocab = self.config.model.vocab_size
        limit = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > min(vocab, limit):
                raise InvalidRequestError(
                    f"{name}={value} exceeds "
                    + (f"the vocabulary size {vocab}" if value > vocab else f"max_logprobs={limit}")
                    + "; ask for fewer (or raise LLM(max_logprobs=...))"
                )
        # Checked again in full: SamplingParams checks what is assigned to it, but the lists and dicts it
        # holds may change in place, and an in-process rank runs no step check.
        if params.stop is not None and not isinstance(params.stop, str):
            stops = params.stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
                raise InvalidRequestError(
                    f"stop must be a non-empty string or a list of them, got {stops!r:.100}", "stop"
                )
        for name, what in (
            ("stop_token_ids", "stop token id"), ("logit_bias", "logit_bias token id"),
            ("allowed_token_ids", "allowed token id"),
        ):  # fmt: skip
            for t in getattr(params, name) or ():
                if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab):
                    # The field named, so that the server's 400 names it as its param.
                    raise InvalidRequestError(f"{what} {t!r} is outside the vocabulary [0, {vocab})", name)
        for value in (params.logit_bias or {}).values():
            if not (isinstance(value, (int, float)) and -100 <= value <= 100):
                raise InvalidRequestError(
                    f"logit_bias values must be in [-100, 100], got {value!r}", "logit_bias"
                )
        bad_ids = 0
        if params.bad_words:
            words = params.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
                raise InvalidRequestError("bad_words must be a list of words (strings)", "bad_words")
            # Encoded here, off the engine thread where a server checks.
            bad_ids = sum(len(ids) + 1 for ids in self._bad_word_ids(tuple(words)))
        # What the request's lists send to every worker, at most (messages.sampling_ids): beyond the
        # limit a step could outgrow the workers' message size.
        parts = {
            "stop_token_ids": len(set(params.stop_token_ids or ())) + len(self.eos_token_ids),
            "logit_bias": 2 * len(params.logit_bias or {}),
            "allowed_token_ids": len(set(params.allowed_token_ids or ())),
            "bad_words": bad_ids,
        }
        limit = sampling_ids_limit(vocab)
        if sum(parts.values()) > limit:
            raise InvalidRequestError(
                f"stop_token_ids, logit_bias, allowed_token_ids and bad_words hold {sum(parts.values())} "
                f"token ids together (bad_words: its words' tokens; logit_bias: two a token), over the "
                f"{limit} a request may send; use fewer",
                max(parts, key=lambda name: parts[name]),
            )
        allowed = params.allowed_token_ids
        if allowed is not None and params.structured_outputs is not None:
            raise InvalidRequestError(
                "allowed_token_ids cannot be combined with structured_outputs: the grammar decides which "
                "tokens may come next", "allowed_token_ids",
            )  # fmt: skip
        if allowed is not None and params.bad_words:
            # A one-token bad word is banned at every step.
            banned = {ids[0] for ids in self._bad_word_ids(tuple(params.bad_words)) if len(ids) == 1}
            if banned.issuperset(allowed):
                raise InvalidRequestError(
                    "bad_words ban every token of allowed_token_ids: no token could be sampled; allow "
                    "others, or drop those words", "bad_words",
                )  # fmt: skip
            allowed = [t for t in allowed if t not in banned]
        if allowed is not None and params.min_tokens:
            held_back = set(params.stop_token_ids or ()) | self.eos_token_ids
            if held_back.issuperset(allowed):
                besides = " besides those bad_words ban" if params.bad_words else ""
                raise InvalidRequestError(
                    f"allowed_token_ids holds only stop tokens (EOS, stop_token_ids){besides}, which "
                    f"min_tokens={params.min_tokens} holds back: no token could be sampled; allow others, "
                    "or drop min_tokens", "allowed_token_ids",
                )  # fmt: skip

    # ----------------------------------------------------------------- stepping
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def step_hold_s(self) -> float:
        """How long the next `step()` may wait for new requests without leaving the device idle: with async
        scheduling, nothing waiting and a decode-only step running, until shortly before that step ends
        (engine/pacing.py); else 0. Streaming front ends wait that long for requests (AsyncLLMEngine)."""
        running = self._in_flight
        if running is None or self.scheduler.waiting or not _decode_only(running):
            return 0.0
        return self._pacer.hold_s(time.perf_counter())

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs it gave: for each streamed request that got a token, its
        delta, and for each other request that finished, its whole output.

        With async scheduling the step sent here is only queued: this call then reads the output of the
        step sent by the previous call, so the workers already hold their next step while the driver
        handles this output. Without it, the step's own output is awaited."""
        t0 = time.perf_counter()
        if self._interval_start is None:
            self._interval_start = t0
        so = self.scheduler.schedule()
        pipelined = self.async_scheduling
        # Structured outputs: without async scheduling the previous step's tokens are in, so the mask goes
        # with the step; with it, the step's forward runs while the in-flight step's tokens advance the
        # grammars, and the mask follows (GrammarMask) before the ranks sample.
        try:
            grammar_rows = self._grammar_rows(so)
            if grammar_rows:
                so.structured_req_ids = [req.req_id for req in grammar_rows]
                if pipelined:
                    so.grammar_mask_follows = True
                else:
                    so.grammar_bitmask = self._grammar_bitmask(grammar_rows)
            t1 = time.perf_counter()
            if so.scheduled_req_ids or not pipelined:
                self.executor.submit(so)  # an in-process rank runs the forward here
                sent: SchedulerOutput | None = so
            else:
                sent = None  # nothing can run before the in-flight step's tokens are in
                self.scheduler.return_freed(so.freed_req_ids)
        except BaseException:
            # The step was not sent, or its forward stopped part-way (Ctrl-C, out of memory): the prefix
            # cache must not offer the blocks it registered, whose keys and values may never be written,
            # and the ranks must still hear of the requests it freed.
            self.scheduler.step_failed(so)
            raise
        t2 = time.perf_counter()
        if pipelined:
            done, self._in_flight = self._in_flight, sent
        else:
            done = sent
        try:
            outputs = [] if done is None else self._take_output(done, t0, t1, t2, sent is None)
            # Inside the try: a failure while the mask is made (a Ctrl-C) must still release the ranks.
            bitmask = self._grammar_bitmask(grammar_rows) if so.grammar_mask_follows else b""
        except BaseException:
            if so.grammar_mask_follows:
                # The ranks wait for this step's mask: let them finish it (every token allowed; the requests'
                # tokens are dropped or refused by their grammars), so the engine can go on after the error.
                with contextlib.suppress(Exception):
                    every = pack_bitmasks([None] * len(grammar_rows), self.config.model.vocab_size)
                    self.executor.submit_grammar_mask(GrammarMask(so.step_id, every))
            raise
        if so.grammar_mask_follows:
            self.executor.submit_grammar_mask(GrammarMask(so.step_id, bitmask))
        return outputs

    def _grammar_rows(self, so: SchedulerOutput) -> list[Request]:
        """The constrained requests that sample in `so` (each holds this step's placeholder by now)."""
        if not self._constrained:
            return []
        self._constrained &= self.scheduler.requests.keys()
        requests = self.scheduler.requests
        return [
            req
            for req in (requests[r] for r in so.scheduled_req_ids)
            if req.grammar is not None and req.num_placeholders > 0
        ]

    def _grammar_bitmask(self, rows: list[Request]) -> bytes:
        """The rows' allowed tokens now; a request that has ended since it was scheduled (its token will be
        dropped) may take any."""
        live = self.scheduler.requests
        states = [req.grammar if live.get(req.req_id) is req else None for req in rows]
        return pack_bitmasks(states, self.config.model.vocab_size)

    def _take_output(
        self, done: SchedulerOutput, t0: float, t1: float, t2: float, idle: bool
    ) -> list[RequestOutput]:
        """Wait for step `done`'s output and apply it: tokens, stops, the outputs to report."""
        output = self.executor.wait_output(done.step_id)
        t3 = time.perf_counter()
        if self.async_scheduling:
            self._pacer.output_arrived(t3, output.ready_before_asked, _decode_only(done))
        outputs = []
        updated = self.scheduler.update(output)
        self.num_output_tokens += len(updated)
        states = self._text_states
        for req in updated:
            grammar = req.grammar if req.req_id in self._constrained else None
            if (req.masks is not None and req.masks.broken_by(req.output_token_ids)) or (
                grammar is not None and not grammar.accept(req.output_token_ids[-1])
            ):
                # Its masks (grammar, allowed_token_ids, bad_words, min_tokens) left no token to sample,
                # and the one taken breaks them: it is taken back (with its logprobs), and the request
                # aborted.
                if len(req.logprobs) == len(req.output_token_ids):
                    req.logprobs.pop()
                req.output_token_ids.pop()
                req.num_tokens -= 1
                self.num_output_tokens -= 1
                reason: str | None = "abort"
                # Its output ends here: text held back may complete a stop string, which then ends it.
                state = self._text_states.get(req.req_id)
                if (
                    state is not None and state.stop_strings
                    and len(req.output_token_ids) > req.params.min_tokens
                    and self._final_stop_search(req, state, req.output_token_ids)
                ):  # fmt: skip
                    reason = "stop"
            else:
                reason = self._check_stop(req)
                if grammar is not None and grammar.finished:
                    # The grammar's end token completed the output: a stop, also when that token reached
                    # max_tokens or max_model_len too (as a stop token there stops; ignore_eos lets EOS
                    # pass _check_stop, but not the grammar's end).
                    reason = "stop" if reason in (None, "length") else reason
            if reason is not None:
                self.scheduler.finish(req, reason)
            state = states.get(req.req_id)
            if state is not None and state.stream:
                outputs.append(self._delta_output(req, state))
            elif reason is not None:
                outputs.append(self._final_output(req))
            if reason is not None:
                states.pop(req.req_id, None)
        t4 = time.perf_counter()
        if self.step_timings is not None:
            started = t0 if self._interval_start is None else self._interval_start
            self._record_timings(done, output, t0, t1, t2, t3, t4, started, idle)
        self._interval_start = t4 if self.scheduler.has_unfinished else None
        if self._in_flight is None or not self.scheduler.has_unfinished:
            self._pacer.reset()  # the device will idle until the next request
        return outputs

    # ----------------------------------------------------------------- outputs
    def _text_codec(self, params: SamplingParams) -> _TextCodec:
        key = (params.detokenize, params.skip_special_tokens, params.spaces_between_special_tokens)
        codec = self._text_codecs.get(key)
        if codec is None:
            codec = self._text_codecs[key] = _TextCodec.of(self.tokenizer, params)
        return codec

    def _logprob_tokenizer(self, params: SamplingParams) -> Any:
        """What decodes the logprobs' tokens: None (no decoded tokens) with detokenize=False."""
        return self.tokenizer if params.detokenize else None

    def _final_text(self, req: Request) -> str:
        if req.stop_text is not None:
            return req.stop_text
        ids = req.output_token_ids
        if req.finish_reason == "stop" and not req.params.include_stop_str_in_output:
            ids = ids[:-1]  # a stop token (EOS or stop_token_ids): its text is left out, as vLLM does
        return output_text(self._text_codec(req.params).decode, req.decode_context, ids)

    def _final_output(self, req: Request) -> RequestOutput:
        """A finished request's whole output (the request was not streamed)."""
        logprobs = None
        cumulative = None
        if req.params.logprobs is not None:
            logprobs = [decode_logprobs(self._logprob_tokenizer(req.params), e) for e in req.logprobs]
            cumulative = sum(lp[1][0] for lp in req.logprobs)
        completion = CompletionOutput(
            index=0,
            text=self._final_text(req),
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            cumulative_logprob=cumulative,
            logprobs=logprobs,
        )
        return RequestOutput(
            request_id=str(req.req_id),
            prompt=None,
            prompt_token_ids=list(req.prompt_token_ids),
            outputs=[completion],
            finished=True,
            prompt_logprobs=self._prompt_logprobs(req),
            num_cached_tokens=req.num_cached_tokens,
            metrics=req.metrics,
        )

    def _delta_output(self, req: Request, state: _TextState) -> RequestOutput:
        """What a streamed request gained since its last output: the new token ids, their logprobs and
        the text they add. While unfinished the text lags behind the tokens where a character is still
        incomplete or a stop string may be starting; the last output adds the rest, so the pieces join
        into the text a non-streamed request gets."""
        finished = req.finish_reason is not None
        if finished:
            text = self._final_text(req)
            delta = text[state.sent_chars :]
            state.sent_chars = len(text)
        else:
            if not state.stop_strings:  # else _check_stop has advanced it
                state.detok.step(req.output_token_ids)
            visible = len(state.detok.text) - state.hold
            delta = state.detok.text[state.sent_chars : visible] if visible > state.sent_chars else ""
            state.sent_chars = max(state.sent_chars, visible)
        first = state.sent_tokens == 0
        new_ids = req.output_token_ids[state.sent_tokens :]
        logprobs = None
        cumulative = None
        if req.params.logprobs is not None:
            entries = req.logprobs[state.sent_tokens :]
            logprobs = [decode_logprobs(self._logprob_tokenizer(req.params), e) for e in entries]
            state.cumulative_logprob += sum(e[1][0] for e in entries)
            cumulative = state.cumulative_logprob
        state.sent_tokens = len(req.output_token_ids)
        completion = CompletionOutput(
            index=0,
            text=delta,
            token_ids=new_ids,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            cumulative_logprob=cumulative,
            logprobs=logprobs,
        )
        return RequestOutput(
            request_id=str(req.req_id),
            prompt=None,
            prompt_token_ids=req.prompt_token_ids,  # not copied: a stream's outputs share it
            outputs=[completion],
            finished=finished,
            prompt_logprobs=self._prompt_logprobs(req) if first else None,
            num_cached_tokens=req.num_cached_tokens,
            metrics=req.metrics,
        )

    def _prompt_logprobs(self, req: Request) -> list[dict[int, Logprob] | None] | None:
        if req.prompt_logprobs is None:
            return None
        tokenizer = self._logprob_tokenizer(req.params)
        return [None, *(e and decode_logprobs(tokenizer, e) for e in req.prompt_logprobs)]

    def _record_timings(
        self,
        so: SchedulerOutput,
        output: ModelRunnerOutput,
        t0: float,
        t1: float,
        t2: float,
        t3: float,
        t4: float,
        interval_start: float,
        drain: bool,
    ) -> None:
        """`so` is the step whose output was read; with async scheduling the phases before the wait
        belong to the next step, which is how the driver's work overlaps the device's. step_total is the
        time since the previous output was handled (or since the first step began), so step totals add up
        to the wall time in either mode."""
        assert self.step_timings is not None
        entry = {
            "schedule": t1 - t0,
            "wait_output": t3 - t2,
            "execute_roundtrip": t3 - t1,
            "engine_update": t4 - t3,
            "step_total": t4 - interval_start,
        }
        entry["num_scheduled_tokens"] = float(sum(so.num_scheduled_tokens))
        entry["decode_only"] = float(_decode_only(so))
        entry["async_scheduling"] = float(self.async_scheduling)
        # Async scheduling's last call of a batch sends nothing and only reads the last output: not a step.
        entry["drain"] = float(drain and self.async_scheduling)
        if not drain:
            entry.update(self.executor.last_step_timings)  # a drain step sent nothing
        if output.timings:
            entry.update({f"worker_{k}": v for k, v in output.timings.items()})
            # With async scheduling a forward can begin before the previous output was handled, so it
            # may outlast this step's interval: that overlap is no overhead.
            entry["overhead"] = max(0.0, entry["step_total"] - output.timings.get("forward_device", 0.0))
        self.step_timings.append(entry)

    def _check_stop(self, req: Request) -> str | None:
        params = req.params
        ids = req.output_token_ids
        token = ids[-1]
        num_out = len(ids)
        num_known = len(req.prompt_token_ids) + num_out
        # As vLLM: nothing stops the first min_tokens tokens (their stop ids are masked when sampled), and
        # stop strings are looked for only where they end past the text those tokens had made (text held
        # back then, an unfinished character, counts as after it).
        searching = num_out > params.min_tokens
        state = self._text_states.get(req.req_id)
        if state is None or not state.stop_strings:
            state = None
        if token in req.stop_ids and searching:
            # A stop string that the incremental text held back (its last token also begins a character)
            # came first. The stop token's own text is searched too where the output keeps it
            # (include_stop_str_in_output), as vLLM searches it.
            if state is not None:
                kept = ids if params.include_stop_str_in_output else ids[:-1]
                if self._final_stop_search(req, state, kept):
                    return "stop"
            if token != self._primary_eos or params.ignore_eos:
                req.stop_reason = token
            return "stop"
        # Stop strings are searched in the incremental text (text + pending) where earlier steps left it
        # as it is, past what they searched.
        unchanged = state.detok.step(ids) if state is not None else None
        if state is not None and unchanged is not None and searching:
            detok = state.detok
            text = detok.text + detok.pending if detok.pending else detok.text
            if self._find_stop_string(req, state, text, unchanged):
                return "stop"
        if num_out >= req.max_tokens or num_known >= self.config.model.max_model_len:
            if state is not None and searching and self._final_stop_search(req, state, ids):
                return "stop"
            return "length"
        return None

    def _final_stop_search(self, req: Request, state: _TextState, ids: list[int]) -> bool:
        """Look for a stop string in the whole text of the output `ids`, which is final: the text the
        detokenizer held back (an unfinished character) may complete one."""
        text = output_text(self._text_codec(req.params).decode, req.decode_context, ids)
        return self._find_stop_string(req, state, text, state.detok.unchanged(text))

    def _find_stop_string(self, req: Request, state: _TextState, text: str, searched: int) -> bool:
        """Look for the request's stop strings in `text` (the output's text so far, or all of it) where
        they may end past its first `searched` characters, which earlier steps searched. On a match set the
        request's stop reason and final text. The match that ends first wins, the first listed where two
        end together: the one a text growing a character at a time completes first, however the text was
        cut into tokens. A match ending within the searched text was looked for already (or, within the
        first min_tokens tokens' text, is not one)."""
        stops = state.stop_strings
        found = []
        for i, stop in enumerate(stops):
            idx = text.find(stop, max(0, searched + 1 - len(stop)))
            if idx >= 0:
                found.append((idx + len(stop), i, idx))
        if not found:
            return False
        _, i, idx = min(found)
        stop = stops[i]
        req.stop_reason = stop
        if req.params.include_stop_str_in_output:
            idx += len(stop)
        req.stop_text = text[:idx]
        return True

    def abort_request(self, req_id: int | str) -> RequestOutput | None:
        """End a request wherever it is (waiting, running, in a step in flight) and free its KV blocks;
        tokens of it still in flight are dropped when they arrive. `req_id`: the id add_request returned, or
        its str (`RequestOutput.request_id`). Returns its last output (finish_reason "abort": for a streamed
        request the text not reported yet, else the whole output), or None when the request has already
        finished or never existed."""
        if isinstance(req_id, str):
            # The id the outputs carry: looked up as given it would name no request, and the request would
            # run on unaborted.
            # At most 20 digits (past int64): int() of over 4,300 would raise ValueError.
            decimal = req_id.isascii() and req_id.isdecimal() and len(req_id) <= 20
            if not decimal or str(int(req_id)) != req_id:
                return None  # (not an id the outputs carry: "07" is no request "7")
            req_id = int(req_id)
        req = self.scheduler.requests.get(req_id)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        state = self._text_states.pop(req_id, None)
        if state is not None and state.stream:
            return self._delta_output(req, state)
        return self._final_output(req)

    def abort_all(self) -> None:
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish(req, "abort")
        self._text_states.clear()

    def check_alive(self) -> None:
        """Raise if a worker is dead or stalled (the engine is then shut down); for an idle engine, whose
        workers are otherwise only checked while a step runs."""
        self.executor.check_alive()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix, so later requests compute theirs anew; refused (False, as
        vLLM's) while a request holds cache blocks (one that is running), which would be registered again;
        requests still waiting to be scheduled do not stop it."""
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.config.device == "cuda":
            # What start-up froze can be collected again, this engine's cycles among it (and, the freeze
            # being the process's, those of another engine still running, which only costs it pauses).
            gc.unfreeze()


@dataclass(frozen=True)
class TokenMasks:
    """A request's token masks that can leave no token to sample (allowed_token_ids, bad_words, the stop
    tokens min_tokens holds back), to tell on the host that a sampled token breaks them: taken only where
    they left none (the workers mask the others). Looked up per token in O(1) unless the token ends a
    bad word."""

    allowed: frozenset[int] | None
    held_back: frozenset[int]
    min_tokens: int
    words_by_last: dict[int, list[list[int]]]

    @classmethod
    def of(cls, sampling: RequestSampling) -> TokenMasks | None:
        if not sampling.allowed_token_ids and not sampling.bad_words and not sampling.min_tokens:
            return None
        words_by_last: dict[int, list[list[int]]] = {}
        for word in sampling.bad_words:
            words_by_last.setdefault(word[-1], []).append(word)
        allowed = frozenset(sampling.allowed_token_ids) if sampling.allowed_token_ids else None
        return cls(allowed, frozenset(sampling.stop_token_ids), sampling.min_tokens, words_by_last)

    def broken_by(self, ids: list[int]) -> bool:
        """Whether the last of the output `ids` is a token the masks forbade."""
        token = ids[-1]
        if len(ids) <= self.min_tokens and token in self.held_back:
            return True
        if self.allowed is not None and token not in self.allowed:
            return True
        words = self.words_by_last.get(token)
        return words is not None and any(
            len(word) <= len(ids) and ids[len(ids) - len(word) :] == word for word in words
        )


def check_cache_salt(salt: Any) -> None:
    """vLLM's cache_salt: None, or a non-empty string of valid Unicode text."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise InvalidRequestError(f"cache_salt must be a non-empty string, got {salt!r:.100}", "cache_salt")
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(
            "cache_salt is not valid Unicode text (a lone surrogate)", "cache_salt"
        ) from None


def bad_word_ids(tokenizer: Any, words: list[str], vocab: int) -> list[list[int]]:
    """vLLM's token sequences of `bad_words`: each word (its leading spaces dropped) as encoded alone, and
    with one space before it where that gives a sequence of the same length with another first token (a
    word-initial token: a word in mid-text)."""
    if tokenizer is None:
        raise InvalidRequestError("bad_words needs the model's tokenizer to encode them", "bad_words")
    sequences: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()  # a repeated word bans nothing more

    def add(ids: list[int]) -> None:
        if tuple(ids) not in seen:
            seen.add(tuple(ids))
            sequences.append(ids)

    encoded: set[str] = set()
    for word in words:
        if not isinstance(word, str) or not word.strip():  # (the list may have changed since it was checked)
            raise InvalidRequestError(f"bad_words must be words (strings), got {word!r:.100}", "bad_words")
        if word in encoded:
            continue
        encoded.add(word)
        try:
            word.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(
                f"bad word {word!r:.100}: {exc.object[exc.start : exc.end]!r} at index {exc.start} is not "
                "valid Unicode text (a lone surrogate); remove or replace it",
                "bad_words",
            ) from None
        alone = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not alone:
            raise InvalidRequestError(f"bad word {word!r:.100} encodes to no tokens", "bad_words")
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        add(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            add(spaced)
    for ids in sequences:
        if not all(0 <= t < vocab for t in ids):
            raise InvalidRequestError(
                f"bad_words encode to token ids outside the model's vocabulary [0, {vocab}): {ids[:16]}",
                "bad_words",
            )
    return sequences


def decode_logprobs(tokenizer: Any, entry: tuple[list[int], list[float], int]) -> dict[int, Logprob]:
    """One position: the chosen (sampled or prompt) token first, then the top-k by rank. A chosen token
    among the top k takes its place there, as in vLLM: its own rank counts every token it ties with, so
    with ties it could repeat a top-k entry's."""
    token_ids, logprobs, chosen_rank = entry
    out: dict[int, Logprob] = {}
    for pos, (tid, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        rank = chosen_rank if pos == 0 else pos
        if tid in out:
            out[tid].rank = rank
        else:
            text = None if tokenizer is None else tokenizer.decode([tid])
            out[tid] = Logprob(logprob=lp, rank=rank, decoded_token=text)
    return out
