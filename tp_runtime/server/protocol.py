"""Request and response bodies of the OpenAI API (completions, chat completions, models, errors), as
pydantic models. Requests take OpenAI's fields plus vLLM's sampling extensions (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, prompt_logprobs,
allowed_token_ids, skip_special_tokens, structured_outputs);
unknown fields are ignored, as OpenAI does. Fields the server cannot honour are declared so that it can
refuse them with a 400 rather than ignore them (see `unsupported`)."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    model_serializer,
    model_validator,
)

from tp_runtime.errors import InvalidRequestError
from tp_runtime.sampling_params import StructuredOutputsParams

# ------------------------------------------------------------------------------------------ requests

_T = TypeVar("_T")
# A request's lists stop at their first bad element: one error, however long the list (a million bad ids
# would otherwise make a million errors per branch of a union, seconds of work and a huge message).
Items = Annotated[list[_T], Field(fail_fast=True)]
# Stop strings are looked for in every new token's text on the engine's thread: a request of 80,000 of
# them (n=128) held every other stream for seconds a step. vLLM sets no bound; OpenAI allows 4.
MAX_STOP_STRINGS = 256


def _whole_number(value: Any) -> Any:
    """16.0 for 16, as vLLM's lax models take it (JSON has one number type; a client that computes a
    count in floating point sends one); 16.5, true and "16" stay refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# A request's scalar integer option (token-id lists stay strict: one Python call per element is slow).
Int = Annotated[int, BeforeValidator(_whole_number)]


class _Request(BaseModel):
    # Strict: a JSON true is not the integer 1, nor "3" the integer 3 (an int is still a valid float).
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's optional fields are nullable ("boolean or null"): a null where the field holds no None
        (n, stream, echo, ...) means its default, as clients that send every field unset write them."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in _non_null_defaults(cls)}


@functools.cache
def union_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields of a request model whose type is a union of several (None aside): a failed validation
    reports one error per branch, which a message names together."""
    unions = set()
    for name, f in model.model_fields.items():
        if typing.get_origin(f.annotation) in (typing.Union, types.UnionType):
            branches = [a for a in typing.get_args(f.annotation) if a is not type(None)]
            if len(branches) > 1:
                unions.add(name)
    return frozenset(unions)


@functools.cache
def _non_null_defaults(model: type[BaseModel]) -> frozenset[str]:
    """The optional fields of a request model that do not take None (a null there means the default)."""
    return frozenset(
        name for name, f in model.model_fields.items()
        if not f.is_required() and f.annotation is not Any and type(None) not in typing.get_args(f.annotation)
    )  # fmt: skip


class StreamOptions(_Request):
    # vLLM's default: stream_options given means usage unless it says false (or null, as vLLM reads it)
    include_usage: bool | None = True
    # vLLM's: with include_usage, every chunk also carries the usage of its choice so far.
    continuous_usage_stats: bool = False


_REFUSED_EXTENSIONS = ("guided_whitespace_pattern",)
# vLLM's older names of the structured_outputs fields.
_GUIDED = {
    "guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
}  # fmt: skip
_STRUCTURED_KEYS = frozenset(f.name for f in dataclasses.fields(StructuredOutputsParams))


class SamplingFields(_Request):
    """What completions and chat completions share. None means the engine's default."""

    model: str | None = None
    n: Int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    seed: Int | None = None
    stop: str | Items[str] | None = None
    stop_token_ids: Items[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # vLLM's: the prompt's prefix-cache blocks are shared only with requests that give the same salt
    cache_salt: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids (as JSON keys) -> [-100, 100]
    allowed_token_ids: Items[int] | None = None  # vLLM's: only these may be sampled
    # vLLM's: per prompt token, its logprob and the top ones (the first token's null); not with stream.
    prompt_logprobs: Int | None = None
    # Structured outputs: vLLM's field ({"json": schema} or regex, choice, grammar, json_object), its
    # older guided_* names, and OpenAI's response_format (json_schema, json_object or text).
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None  # refused: xgrammar takes no whitespace pattern
    response_format: dict[str, Any] | None = None
    skip_special_tokens: bool = True  # the text leaves special tokens out, unless false
    spaces_between_special_tokens: bool = True  # vLLM's (only slow tokenizers' decode reads it)
    # vLLM's: keep only the prompt's last k tokens (-1: max_model_len of them).
    truncate_prompt_tokens: Int | None = None
    bad_words: Items[str] | None = None  # vLLM's: words never generated (SamplingParams.bad_words)
    # vLLM extensions this server does not serve: refused when given, rather than silently ignored.
    use_beam_search: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM's "token_id:N" logprob tokens: refused when true

    def constraint_field(self) -> str | None:
        """The request's field that gives its output constraint (for error messages), else None."""
        for name in ("structured_outputs", *_GUIDED):
            if getattr(self, name) is not None:
                return name
        fmt = self.response_format
        return "response_format" if fmt is not None and fmt.get("type") != "text" else None

    def structured(self) -> StructuredOutputsParams | None:
        """The request's one output constraint, from whichever field gives it; InvalidRequestError naming
        the field for a bad one or for more than one."""
        given: list[tuple[str, dict[str, Any]]] = []
        if self.structured_outputs is not None:
            unknown = sorted(set(self.structured_outputs) - _STRUCTURED_KEYS)
            if unknown:
                raise InvalidRequestError(
                    f"structured_outputs has unknown fields {unknown}; it takes {sorted(_STRUCTURED_KEYS)}",
                    "structured_outputs",
                )
            given.append(("structured_outputs", dict(self.structured_outputs)))
        for name, key in _GUIDED.items():
            if getattr(self, name) is not None:
                given.append((name, {key: getattr(self, name)}))
        fmt = self.response_format
        if fmt is not None and "type" not in fmt:  # as OpenAI: the type is required
            raise InvalidRequestError(
                "response_format needs a type: text, json_object, json_schema or structural_tag",
                "response_format",
            )
        if fmt is not None and fmt["type"] != "text":
            kind = fmt["type"]
            if kind == "json_object":
                given.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise InvalidRequestError(
                        'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                        "response_format",
                    )
                given.append(("response_format", {"json": schema}))
            elif kind == "structural_tag":  # vLLM's: its structures and triggers, or xgrammar's format
                given.append(("response_format", {"structural_tag": dict(fmt)}))
            else:
                raise InvalidRequestError(
                    f"response_format type {kind!r} is not supported (text, json_object, json_schema, "
                    "structural_tag)",
                    "response_format",
                )
        if not given:
            return None
        if len(given) > 1:
            raise InvalidRequestError(
                f"give one output constraint, got {', '.join(name for name, _ in given)}", given[1][0]
            )
        name, fields = given[0]
        try:
            return StructuredOutputsParams(**fields)
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc), name) from None

    def unsupported(self) -> str | None:
        """The first field set that the server cannot honour, as `name`, else None."""
        for name in _REFUSED_EXTENSIONS:
            if getattr(self, name) is not None:
                return name
        if self.use_beam_search:
            return "use_beam_search"
        if self.return_tokens_as_token_ids:
            return "return_tokens_as_token_ids"
        return None


class CompletionRequest(SamplingFields):
    # A string, a list of strings, a list of token ids, or a list of such lists (one choice per prompt).
    prompt: str | Items[str] | Items[int] | Items[Items[int]]
    max_tokens: Int | None = 16  # OpenAI's default for completions; a null: up to the context length (vLLM's)
    logprobs: Int | None = None  # the top tokens to return per position, besides the sampled one
    echo: bool = False  # each choice's text (and logprobs) begins with its prompt's
    add_special_tokens: bool = True  # vLLM's: a string prompt gets the tokenizer's special tokens (BOS)
    suffix: str | None = None
    best_of: Int | None = None

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return super().unsupported()


class ChatMessage(_Request):
    role: str
    # A string, or content parts of which only text ones are supported (llm.chat_content_text).
    content: str | Items[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: Items[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's: the call it answers


class ChatTemplateFields(_Request):
    """What renders a conversation into a prompt: shared by chat completions and /tokenize's chat form."""

    messages: Items[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (vLLM's)
    # vLLM's: the request's own Jinja chat template, taken only from a server started with
    # --trust-request-chat-template (a template is code the server runs).
    chat_template: str | None = None
    # vLLM's: the tokenizer's special tokens on top of the rendered text (the template writes its own BOS).
    add_special_tokens: bool = False
    tools: Items[dict[str, Any]] | None = None  # shown to the chat template
    documents: Items[dict[str, Any]] | None = None  # vLLM's: retrieved documents a RAG template shows


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    max_tokens: Int | None = None  # None: up to the context length
    max_completion_tokens: Int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool = False
    top_logprobs: Int | None = None  # with logprobs: the top tokens to return per position
    # Functions the model may call (server/tool_calls.py): "auto" (the default with tools) reads calls
    # from its text with --tool-call-parser, "required" and a named function constrain it to calls.
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # False: one call at most ("auto" keeps the first)
    # Refused when given, rather than silently ignored: vLLM's echo of the last message, OpenAI's legacy
    # functions / function_call (tools / tool_choice replace them).
    echo: bool = False
    functions: Any = None
    function_call: Any = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                return name
        return super().unsupported()


class TokenizeCompletionRequest(_Request):
    """/tokenize of a text, as /v1/completions tokenizes a string prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    """/tokenize of a conversation, as /v1/chat/completions renders and tokenizes it."""

    model: str | None = None
    return_token_strs: bool = False


def _tokenize_kind(value: Any) -> str:
    return "chat" if isinstance(value, dict) and "messages" in value else "completion"


# A body with "messages" is a conversation, any other a text (as vLLM tells them apart).
TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("chat")] | Annotated[TokenizeCompletionRequest, Tag("completion")],
    Discriminator(_tokenize_kind),
]


class DetokenizeRequest(_Request):
    """/detokenize: token ids to text, special tokens included (as /v1/completions echoes token ids)."""

    model: str | None = None
    tokens: Items[int]


# ----------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # of the prompt tokens, those whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: per generated token its text, logprob, offset in the choice's text,
    and the top tokens (with the sampled one) by text."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry of one token at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (the first None), token id -> its entry: the prompt's token and the top ones.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


def _without(name: str, data: dict[str, Any]) -> dict[str, Any]:
    """`data` without field `name` when it is null (an extension field only present when asked for)."""
    if data.get(name, 0) is None:
        del data[name]
    return data


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string that ended it
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked for

    @model_serializer(mode="wrap")
    def _without_unasked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without("prompt_logprobs", handler(self))


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI's


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A stream's piece of a tool call: its first has the id, type and name; later ones add arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked for

    @model_serializer(mode="wrap")
    def _without_unasked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without("prompt_logprobs", handler(self))


class DeltaMessage(BaseModel):
    """What a chunk adds to a choice's message: the role in a choice's first chunk, then content."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tp_runtime"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
