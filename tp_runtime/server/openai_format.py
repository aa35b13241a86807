"""OpenAI's wire format, for the server: errors in OpenAI's shape, a request's options as SamplingParams,
and the responses and stream chunks of /v1/completions and /v1/chat/completions built from the engine's
outputs (text, finish reasons, logprobs in each endpoint's shape).

Each endpoint has a `Format`; the server's loops (`api_server`) are the same for both: every engine output
becomes a `Piece` of one choice, which a stream sends as one chunk and a plain response joins into the
choice.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tp_runtime.engine.async_engine import describe_failure
from tp_runtime.engine.llm import chat_content_parts, chat_content_text
from tp_runtime.engine.llm_engine import IncrementalDetokenizer, TextFinality, decode_context
from tp_runtime.errors import InvalidRequestError, TPRuntimeError
from tp_runtime.outputs import CompletionOutput, Logprob
from tp_runtime.sampling_params import SamplingParams
from tp_runtime.server.protocol import (
    MAX_STOP_STRINGS,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorInfo,
    ErrorResponse,
    FunctionCall,
    PromptLogprob,
    PromptLogprobs,
    SamplingFields,
    ToolCall,
    TopLogprob,
    UsageInfo,
)
from tp_runtime.server.tool_calls import ToolPlan, call_id

# JSON has no -inf; OpenAI (and vLLM) send this instead.
MIN_LOGPROB = -9999.0

# ------------------------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: int | str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        # OpenAI's own code where it has one, else the status, as vLLM's
        self.info = ErrorInfo(message=message, type=type, param=param, code=status if code is None else code)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def failure(exc: BaseException) -> APIError:
    """500 for a request the engine could not serve. `exc`: what killed the engine, or (not an engine
    error) a bug. The message is one line, never a traceback: those are in the server's log."""
    if isinstance(exc, TPRuntimeError):
        return APIError(500, f"the engine failed: {describe_failure(exc)}", type="server_error", code=500)
    return internal_error(exc)


def internal_error(exc: BaseException) -> APIError:
    message = f"internal error ({type(exc).__name__}); see the server log"
    return APIError(500, message, type="server_error", code=500)


def error_body(info: ErrorInfo) -> dict[str, Any]:
    return ErrorResponse(error=info).model_dump()


# A validation message names at most this many problems, each value quoted to at most this many characters.
MAX_PROBLEMS = 5
MAX_QUOTED = 80


def _quoted(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_QUOTED else text[: MAX_QUOTED - 3] + "..."


def validation_message(
    errors: Sequence[Any], unions: frozenset[str] = frozenset()
) -> tuple[str, str | None]:
    """pydantic's errors about a request body (locations from the body's root) as one short message, and
    the first field named. `unions`: the fields whose type is a union (protocol.union_fields), whose
    failed branches are named together."""
    for e in errors:
        if e.get("type") == "json_invalid":  # where and why ("number out of range at line 1 column 4318")
            detail = (e.get("ctx") or {}).get("error")
            return "the request body is not valid JSON" + (f": {detail}" if detail else ""), None
    by_field: dict[str, list[Any]] = {}
    for e in errors:
        loc = [str(x) for x in e.get("loc", ())]
        by_field.setdefault(loc[0] if loc else "body", []).append((loc, e))
    problems = []
    for name, found in by_field.items():
        branches = [loc[1] for loc, _ in found if len(loc) >= 2]
        if name in unions and len(found) > 1 and len(branches) == len(found) == len(set(branches)):
            # Every branch of a union failed (each at the field or at its first bad element).
            value = _quoted(found[0][1].get("input"))
            problems.append(f"{name}: {value} is none of the types it takes ({', '.join(branches)})")
        else:
            problems += [f"{'.'.join(loc) or 'body'}: {e.get('msg')}" for loc, e in found]
    more = len(problems) - MAX_PROBLEMS
    message = "; ".join(problems[:MAX_PROBLEMS]) + (f"; and {more} more" if more > 0 else "")
    return message, next((n for n in by_field if n != "body"), None)


# ------------------------------------------------------------------------------------------ requests


def text_content(content: Any, index: int, parts: bool = False) -> str | list[dict[str, str]]:
    """A chat message's content as the template gets it (LLM.chat's rule): text, a string or text content
    parts one per line; with `parts` (a template that loops over them) its text parts."""
    try:
        return chat_content_parts(content, index) if parts else chat_content_text(content, index)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), "messages") from None


def sampling_params(
    body: SamplingFields, max_tokens: int, logprobs: int | None, names: dict[str, str] | None = None,
    prompt_logprobs: int | None = None, defaults: Mapping[str, Any] | None = None,
) -> SamplingParams:  # fmt: skip
    """The request's options; one left out (None) takes the model's default in `defaults` (SamplingParams
    options by name: the generation config's, GenerationDefaults.overrides()), else SamplingParams' own,
    as vLLM's order is: the request, the server's default, OpenAI's. `max_tokens`: the budget, already
    decided (see `_Context.max_tokens`). `names`: the request's own name of an option that SamplingParams
    names otherwise (chat's top_logprobs, max_completion_tokens), for the error message and its param."""
    model_defaults = defaults or {}

    def given(value: Any, default: Any, name: str | None = None) -> Any:
        if value is not None:
            return value
        return model_defaults.get(name, default) if name is not None else default

    try:
        structured = body.structured()
    except InvalidRequestError as exc:
        raise bad_request(str(exc), exc.field) from None
    if isinstance(body.stop, list) and len(body.stop) > MAX_STOP_STRINGS:
        raise bad_request(
            f"stop holds {len(body.stop)} strings; at most {MAX_STOP_STRINGS} a request are taken", "stop"
        )
    bias = None
    if body.logit_bias:  # JSON object keys are strings: OpenAI's token ids, in decimal digits
        # At most 18 digits: any vocabulary's id, and short of int()'s 4,300-digit limit (a ValueError).
        wrong = next(
            (t for t in body.logit_bias if not t.isascii() or not t.isdigit() or len(t) > 18), None
        )
        if wrong is not None:
            raise bad_request(f"logit_bias keys must be token ids, got {wrong[:40]!r}", "logit_bias")
        # Clamped to OpenAI's [-100, 100], as vLLM's server does (clients ban a token with -1e9); NaN is
        # left for SamplingParams to refuse.
        bias = {int(t): v if v != v else min(100.0, max(-100.0, v)) for t, v in body.logit_bias.items()}
    try:
        return SamplingParams(
            structured_outputs=structured,
            n=body.n,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            temperature=given(body.temperature, 1.0, "temperature"),
            top_p=given(body.top_p, 1.0, "top_p"),
            top_k=given(body.top_k, -1, "top_k"),
            min_p=given(body.min_p, 0.0, "min_p"),
            seed=body.seed,
            stop=body.stop,  # "" is refused as [""] is (an empty list: no stop strings)
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=given(body.presence_penalty, 0.0),
            frequency_penalty=given(body.frequency_penalty, 0.0),
            repetition_penalty=given(body.repetition_penalty, 1.0, "repetition_penalty"),
            logit_bias=bias,
            allowed_token_ids=list(body.allowed_token_ids) if body.allowed_token_ids is not None else None,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            bad_words=list(body.bad_words) if body.bad_words is not None else None,
        )
    except InvalidRequestError as exc:
        message = str(exc).removeprefix("invalid SamplingParams: ")
        field, rest = message.split(" ", 1)  # the message names the option first
        field = (names or {}).get(field, field)
        raise bad_request(f"{field} {rest}", field if field in type(body).model_fields else None) from None


# ------------------------------------------------------------------------------------- server-sent events


def sse(data: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    body = data.model_dump_json(exclude=exclude) if isinstance(data, BaseModel) else json.dumps(data)
    return f"data: {body}\n\n"


DONE = "data: [DONE]\n\n"


def error_event(error: APIError) -> str:
    """A failure after the stream began (the status line is sent): an event with OpenAI's error body,
    which the openai client raises as an APIError."""
    return sse(error_body(error.info))


# ------------------------------------------------------------------------------------------- logprobs


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character each byte is written as, mapped back."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


class TokenBytes:
    """A token's own UTF-8 bytes, for chat logprobs' `bytes` (clients join them to rebuild the text, with
    characters split across tokens), read from its vocabulary entry: a byte-level BPE piece, a
    SentencePiece byte token (<0xCF>) or word ("▁Paris" is " Paris", which decoded alone loses its
    space); otherwise the bytes of its text."""

    _BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        byte_level = backend is not None and "ByteLevel" in repr(backend.decoder)
        self._alphabet = _byte_level_alphabet() if byte_level else None

    def __call__(self, token_id: int, text: str) -> list[int]:
        """The bytes of `token_id`, whose text (decoded alone) is `text`."""
        piece = None if self._tokenizer is None else self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str) or not piece:
            return list(text.encode("utf-8"))
        byte_token = self._BYTE_TOKEN.fullmatch(piece)
        if byte_token:
            return [int(byte_token[1], 16)]
        if self._alphabet is not None:
            if all(char in self._alphabet for char in piece):
                return [self._alphabet[char] for char in piece]
        elif "▁" in piece:  # SentencePiece's word start: a space the token's text alone loses
            return list(piece.replace("▁", " ").encode("utf-8"))
        return list(text.encode("utf-8"))


def _ranked(position: dict[int, Logprob], top: int) -> list[tuple[int, Logprob]]:
    """The `top` likeliest tokens at a position with their ids, by rank (the sampled one among them when
    it is)."""
    ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= top]
    return sorted(ranked, key=lambda entry: entry[1].rank or 0)


class TextOffsets:
    """Where each generated token's text starts in its choice's text, for the completions `text_offset`:
    the length of the text the tokens before it decode to, as the engine's incremental detokenizer makes
    it (not the sum of the tokens decoded one by one: the bytes of a character split across tokens make
    one character, though each such token alone decodes to U+FFFD; special tokens add nothing unless
    `with_special_tokens`, as for an echoed prompt; a SentencePiece word's leading space counts). Text the
    engine holds back (a possible stop string) counts where it will appear; offsets past the end of the
    choice's final text (a stop string cut it) are clamped by the caller."""

    def __init__(self, tokenizer: Any, with_special_tokens: bool = False, prompt: Sequence[int] = ()) -> None:
        """`prompt`: what the tokens follow (a completion's prompt), decoded before them as in the engine."""
        skip = not with_special_tokens

        def decode(ids: list[int]) -> str:
            return str(tokenizer.decode(ids, skip_special_tokens=skip))

        finality = TextFinality.of(tokenizer, decode)
        self._detok = IncrementalDetokenizer(decode, decode_context(decode, prompt, finality), finality)
        self._ids: list[int] = []

    def next(self, token_id: int) -> int:
        # Complete characters only: a split one counts once complete, a byte-fallback run of byte tokens
        # once a token that is not a byte ends it (until then a byte may turn its text into U+FFFDs).
        # Held-back text that this token does not complete (bytes that never make a character, U+FFFD in
        # the text) counts as it stands.
        offset = len(self._detok.text) + self._detok.held_chars_kept(self._ids, token_id)
        self._ids.append(token_id)
        self._detok.step(self._ids)
        return offset


# -------------------------------------------------------------------------------------------- formats


@dataclass
class Piece:
    """What one engine output adds to one choice: its new text, logprobs in the endpoint's shape (None
    when the request asked for none; `num_logprobs` tokens' worth), and on the choice's last piece
    (`finished`) why it ended."""

    index: int
    text: str
    logprobs: Any
    num_logprobs: int
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, on a choice's first piece when asked for
    num_tokens: int = 0  # tokens the output brings

    def worth_sending(self) -> bool:
        """Whether a stream sends it: each output that brings a token, as vLLM's streams do, also while
        its text is held back (an incomplete character, a possible stop string: the chunk's text is then
        empty, and the client still sees the token come), and the last one."""
        return bool(self.text) or self.finished or self.num_logprobs > 0 or self.num_tokens > 0


class Format:
    """One endpoint's shapes: the response id's prefix, its choices, chunks and responses."""

    id_prefix = ""
    prompt_only = False  # the choices are their echoed prompts alone: the engine's output is left out
    prompt_top: int | None = None  # the request's prompt_logprobs (vLLM's), None when not asked for

    def piece(
        self, index: int, out: CompletionOutput, finished: bool,
        prompt_logprobs: list[dict[int, Logprob] | None] | None = None,
    ) -> Piece:  # fmt: skip
        """`prompt_logprobs`: the engine request's, on its first output when it computed them."""
        logprobs, count = self.logprobs(index, out, finished)
        return Piece(
            index=index, text=out.text, logprobs=logprobs, num_logprobs=count, finished=finished,
            finish_reason=out.finish_reason if finished else None,
            stop_reason=out.stop_reason if finished else None,
            prompt_logprobs=self._prompt_entries(prompt_logprobs), num_tokens=len(out.token_ids),
        )  # fmt: skip

    def _prompt_entries(
        self, prompt_logprobs: list[dict[int, Logprob] | None] | None
    ) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs: per position the prompt's token (the engine's first entry) and those
        ranked within the request's count (the engine may have computed more, for echo)."""
        top = self.prompt_top
        if top is None or prompt_logprobs is None:
            return None

        def entry(lp: Logprob) -> PromptLogprob:
            return PromptLogprob(logprob=_clamp(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)

        return [
            None if position is None else {
                token_id: entry(lp) for i, (token_id, lp) in enumerate(position.items())
                if i == 0 or (lp.rank is not None and lp.rank <= top)
            }
            for position in prompt_logprobs
        ]  # fmt: skip

    def logprobs(self, index: int, out: CompletionOutput, finished: bool) -> tuple[Any, int]:
        """The logprobs the output brings (maybe none: empty) and for how many tokens; (None, 0) when the
        request asked for none."""
        raise NotImplementedError

    def opening(self, num_choices: int) -> list[BaseModel]:
        """What a stream sends before any output, one chunk per choice."""
        return []

    def delta(self, piece: Piece) -> BaseModel:
        """A piece as a stream chunk's choice."""
        raise NotImplementedError

    def choice(self, index: int, pieces: list[Piece]) -> BaseModel:
        """A choice of a plain response, from all its pieces."""
        raise NotImplementedError

    def response(
        self, ident: str, created: int, model: str, choices: list[Any], usage: UsageInfo | None
    ) -> BaseModel:
        """The plain response, or a stream's chunk (same fields)."""
        raise NotImplementedError

    def chunk(
        self, ident: str, created: int, model: str, choices: list[Any], usage: UsageInfo | None
    ) -> BaseModel:
        return self.response(ident, created, model, choices, usage)


def _joined(pieces: list[Piece]) -> tuple[str, str | None, int | str | None]:
    last = pieces[-1] if pieces else None
    finish = (last.finish_reason, last.stop_reason) if last is not None and last.finished else (None, None)
    return "".join(p.text for p in pieces), *finish


@dataclass(frozen=True)
class Echo:
    """A completions choice's echoed prompt: its text (a string prompt as given, token ids decoded with their
    special tokens) and how many of its tokens, in front, the text lacks (the BOS the tokenizer added to a
    string prompt)."""

    text: str
    added_in_front: int


# A completions logprobs entry: the token's text, its logprob, its text's offset, the top tokens' logprobs
# (logprob and top are None for a prompt's first token).
_Entry = tuple[str, float | None, int, dict[str, float] | None]


def _add_entries(logprobs: CompletionLogprobs, entries: list[_Entry], text_length: int) -> None:
    """Append entries to the legacy logprobs' columns, offsets clamped to the text's length."""
    for token, logprob, offset, top in entries:
        logprobs.tokens.append(token)
        logprobs.token_logprobs.append(logprob)
        logprobs.text_offset.append(min(offset, text_length))
        logprobs.top_logprobs.append(top)


class CompletionFormat(Format):
    """/v1/completions: choices with `text`, the legacy logprobs (`tokens`, `token_logprobs`,
    `top_logprobs` by token text, `text_offset`)."""

    id_prefix = "cmpl-"

    def __init__(
        self, body: CompletionRequest, prompts: list[list[int]], tokenizer: Any,
        echoes: list[Echo] | None = None,
    ) -> None:  # fmt: skip
        """`prompts`: each choice's prompt token ids; `echoes`: with echo, each choice's prompt, whose text
        its text begins with (and its logprobs with the prompt tokens', the first one's None)."""
        num_choices = len(prompts)
        self.prompt_only = echoes is not None and body.max_tokens == 0
        self.prompt_top = body.prompt_logprobs
        self._samples = body.n  # choice index = prompt index * n + sample index
        self._stream = body.stream
        # By prompt, what its first sample computed: vLLM's shape, and (echo, not streamed) the engine's.
        self._prompt_logprobs: dict[int, PromptLogprobs] = {}
        self._raw_prompt_logprobs: dict[int, list[dict[int, Logprob] | None]] = {}
        self._echo_entries: dict[int, list[_Entry]] = {}  # by prompt (not streamed): built once
        self.top = body.logprobs
        self._tokenizer = tokenizer
        self._prompts = prompts
        self._echoes = echoes
        self._echoed = [False] * num_choices
        asked = num_choices if body.logprobs is not None else 0
        special = not body.skip_special_tokens
        self._offsets = [
            TextOffsets(tokenizer, with_special_tokens=special, prompt=prompts[i]) for i in range(asked)
        ]
        # Per choice, its tokens' entries (token, logprob, offset, top) not sent yet.
        self._held: list[list[_Entry]] = [[] for _ in range(asked)]
        self._emitted = [0] * num_choices  # length of each choice's text so far
        self._base = [0] * num_choices  # where its generated text begins (after an echoed prompt)

    def piece(
        self, index: int, out: CompletionOutput, finished: bool,
        prompt_logprobs: list[dict[int, Logprob] | None] | None = None,
    ) -> Piece:  # fmt: skip
        echoed = ""
        if self._echoes is not None and not self._echoed[index]:  # the choice's first piece
            self._echoed[index] = True
            echoed = self._echoes[index].text
            self._emitted[index] = self._base[index] = len(echoed)
            if self.top is not None and self._stream:  # every sample computed them (else: in `choice`)
                self._held[index] += self._echoed_entries(index, prompt_logprobs)
        piece = super().piece(index, out, finished, prompt_logprobs)
        piece.text = echoed + piece.text
        if piece.prompt_logprobs is not None:
            self._prompt_logprobs[index // self._samples] = piece.prompt_logprobs
        if prompt_logprobs is not None:
            self._raw_prompt_logprobs[index // self._samples] = prompt_logprobs
        return piece

    def _echoed_entries(
        self, index: int, prompt_logprobs: list[dict[int, Logprob] | None] | None
    ) -> list[_Entry]:
        """The logprobs entries of choice `index`'s echoed prompt tokens."""
        assert self._echoes is not None, "internal: echo entries without echo"
        echoed, added = self._echoes[index].text, self._echoes[index].added_in_front
        # Offsets in the prompt's text with its special tokens (as its token ids echo), but for the tokens
        # in front that the echo lacks (a string prompt's BOS): they sit at 0, the rest count from there.
        tokenizer, ids = self._tokenizer, self._prompts[index]
        offsets = TextOffsets(tokenizer, with_special_tokens=True)
        entries: list[_Entry] = []
        for i, token_id in enumerate(ids):
            offset = 0 if i < added else min(offsets.next(token_id), len(echoed))
            position = None
            if prompt_logprobs is not None and i < len(prompt_logprobs):
                position = prompt_logprobs[i]
            if position is None:  # the first prompt token: nothing before it predicts it
                entries.append((str(tokenizer.decode([token_id])), None, offset, None))
            else:
                entries.append(self._entry(token_id, position, offset))
        return entries

    def _entry(self, token_id: int, position: dict[int, Logprob], offset: int) -> _Entry:
        chosen = position[token_id]
        entries = [chosen, *(lp for tid, lp in _ranked(position, self.top or 0) if tid != token_id)]
        top: dict[str, float] = {}
        for lp in entries:  # tokens whose texts are equal (byte pieces: U+FFFD) keep the likelier's value
            top.setdefault(lp.decoded_token or "", _clamp(lp.logprob))
        return chosen.decoded_token or "", _clamp(chosen.logprob), offset, top

    def logprobs(self, index: int, out: CompletionOutput, finished: bool) -> tuple[Any, int]:
        """A token's entry goes out once its text has begun to appear: held back with the text the engine
        holds back (so a stream's offsets never run past its text), all of them at the end."""
        self._emitted[index] += len(out.text)
        if self.top is None:
            return None, 0
        base = self._base[index]
        offsets = [base + self._offsets[index].next(token_id) for token_id in out.token_ids]
        held = self._held[index]
        for token_id, position, offset in zip(out.token_ids, out.logprobs or [], offsets, strict=False):
            held.append(self._entry(token_id, position, offset))
        emitted = self._emitted[index]
        ready = len(held) if finished else sum(1 for entry in held if entry[2] < emitted)
        result = CompletionLogprobs()
        _add_entries(result, held[:ready], emitted)  # a stop string may have cut the text short
        del held[:ready]
        return result, ready

    def delta(self, piece: Piece) -> CompletionChoice:
        return CompletionChoice(
            index=piece.index, text=piece.text, logprobs=piece.logprobs, finish_reason=piece.finish_reason,
            stop_reason=piece.stop_reason,
        )  # fmt: skip

    def choice(self, index: int, pieces: list[Piece]) -> CompletionChoice:
        text, finish_reason, stop_reason = _joined(pieces)
        logprobs = None
        if self.top is not None:
            logprobs = CompletionLogprobs()
            if self._echoes is not None and not self._stream:  # the prompt's first sample computed them
                prompt = index // self._samples
                if prompt not in self._echo_entries:
                    raw = self._raw_prompt_logprobs.get(prompt)
                    self._echo_entries[prompt] = self._echoed_entries(index, raw)
                _add_entries(logprobs, self._echo_entries[prompt], len(self._echoes[index].text))
            for piece in pieces:
                if piece.logprobs is not None:
                    for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                        getattr(logprobs, name).extend(getattr(piece.logprobs, name))
        prompt_logprobs = self._prompt_logprobs.get(index // self._samples)
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason,
            prompt_logprobs=prompt_logprobs,
        )  # fmt: skip

    def response(
        self, ident: str, created: int, model: str, choices: list[Any], usage: UsageInfo | None
    ) -> CompletionResponse:
        return CompletionResponse(id=ident, created=created, model=model, choices=choices, usage=usage)


class ChatFormat(Format):
    """/v1/chat/completions: choices with a `message` (a stream: a `delta`, opened by the role), logprobs
    as `content` entries with the top tokens and UTF-8 bytes."""

    id_prefix = "chatcmpl-"

    def __init__(self, body: ChatCompletionRequest, tokenizer: Any, tools: ToolPlan | None = None) -> None:
        self.top = (body.top_logprobs or 0) if body.logprobs else None
        self.prompt_top = body.prompt_logprobs
        self._prompt_logprobs: PromptLogprobs | None = None  # the prompt's (all choices share it)
        self._token_bytes = TokenBytes(tokenizer)
        # Tool calls: each choice's text so far, how much of it a stream sent as content, and the id of
        # a named function's call (streamed as the text comes).
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self._texts: dict[int, str] = {}
        self._sent: dict[int, int] = {}
        self._named_ids: dict[int, str] = {}

    def piece(
        self, index: int, out: CompletionOutput, finished: bool,
        prompt_logprobs: list[dict[int, Logprob] | None] | None = None,
    ) -> Piece:  # fmt: skip
        piece = super().piece(index, out, finished, prompt_logprobs)
        if piece.prompt_logprobs is not None:
            self._prompt_logprobs = piece.prompt_logprobs
        return piece

    def logprobs(self, index: int, out: CompletionOutput, finished: bool) -> tuple[Any, int]:
        if self.top is None:
            return None, 0

        def entry(token_id: int, lp: Logprob) -> TopLogprob:
            text = lp.decoded_token or ""
            return TopLogprob(token=text, logprob=_clamp(lp.logprob), bytes=self._token_bytes(token_id, text))

        content = []
        for token_id, position in zip(out.token_ids, out.logprobs or [], strict=bool(out.logprobs)):
            chosen = entry(token_id, position[token_id])
            ranked = [entry(tid, lp) for tid, lp in _ranked(position, self.top)]
            content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=ranked))
        return ChatLogprobs(content=content), len(content)

    def opening(self, num_choices: int) -> list[BaseModel]:
        # Each choice opens with the role, as OpenAI's streams do; a named function's call with its id and
        # name (its arguments follow as the text comes).
        openings: list[BaseModel] = []
        for i in range(num_choices):
            delta = DeltaMessage(role="assistant", content="")
            if self.tools is not None and self.tools.named is not None:
                self._named_ids[i] = call_id()
                function = DeltaFunctionCall(name=self.tools.named.name, arguments="")
                header = DeltaToolCall(index=0, id=self._named_ids[i], type="function", function=function)
                delta = DeltaMessage(role="assistant", tool_calls=[header])
            openings.append(ChatStreamChoice(index=i, delta=delta, logprobs=None, finish_reason=None))
        return openings

    def delta(self, piece: Piece) -> ChatStreamChoice:
        tools = self.tools
        finish = piece.finish_reason
        if tools is None:
            # A token whose text is held back goes out as empty content (vLLM's chunk), the end as {}.
            delta = DeltaMessage(content=piece.text) if piece.text or not piece.finished else DeltaMessage()
        elif tools.named is not None:
            arguments = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=piece.text))
            delta = DeltaMessage(tool_calls=[arguments]) if piece.text else DeltaMessage()
        else:
            # Content goes out as far as it cannot begin a call; the calls when the choice ends.
            i = piece.index
            text = self._texts[i] = self._texts.get(i, "") + piece.text
            sent = self._sent.get(i, 0)
            parsed = tools.parse(text) if piece.finished else None
            upto = len(text) if piece.finished and parsed is None else tools.streamed_content(text)
            content = text[sent:upto] if upto > sent else None
            self._sent[i] = max(sent, upto)
            calls = None
            if parsed is not None:
                # The text before the calls is text[sent:upto] above (upto: where the calls begin), so
                # parsed.content is not added again: that sent the unsent part of it twice.
                calls = [DeltaToolCall(index=k, id=call_id(), type="function",
                                       function=DeltaFunctionCall(name=name, arguments=arguments))
                         for k, (name, arguments) in enumerate(parsed.calls)]  # fmt: skip
                finish = "tool_calls"
            delta = DeltaMessage(content=content, tool_calls=calls)
        return ChatStreamChoice(
            index=piece.index, delta=delta, logprobs=piece.logprobs, finish_reason=finish,
            stop_reason=piece.stop_reason,
        )  # fmt: skip

    def choice(self, index: int, pieces: list[Piece]) -> ChatChoice:
        text, finish_reason, stop_reason = _joined(pieces)
        logprobs = None
        if self.top is not None:
            logprobs = ChatLogprobs(
                content=[e for p in pieces if p.logprobs for e in p.logprobs.content or []]
            )
        message = ChatResponseMessage(content=text)
        parsed = self.tools.parse(text) if self.tools is not None and finish_reason is not None else None
        if parsed is not None:
            calls = [ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=arguments))
                     for name, arguments in parsed.calls]  # fmt: skip
            message = ChatResponseMessage(content=parsed.content, tool_calls=calls)
            if self.tools is not None and self.tools.named is None:
                finish_reason = "tool_calls"
        return ChatChoice(
            index=index, message=message, logprobs=logprobs, finish_reason=finish_reason,
            stop_reason=stop_reason,
        )  # fmt: skip

    def response(
        self, ident: str, created: int, model: str, choices: list[Any], usage: UsageInfo | None
    ) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=ident, created=created, model=model, choices=choices, usage=usage,
            prompt_logprobs=self._prompt_logprobs,
        )  # fmt: skip

    def chunk(
        self, ident: str, created: int, model: str, choices: list[Any], usage: UsageInfo | None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=ident, created=created, model=model, choices=choices, usage=usage)
