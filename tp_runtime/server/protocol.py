"""Request and response bodies of the OpenAI API (completions, chat completions, models, errors), as
pydantic models. Requests take OpenAI's fields plus vLLM's sampling extensions (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, prompt_logprobs);
unknown fields are ignored, as OpenAI does. Fields the server cannot honour are declared so that it can
refuse them with a 400 rather than ignore them (see `unsupported`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

# ------------------------------------------------------------------------------------------ requests


class _Request(BaseModel):
    # Strict: a JSON true is not the integer 1, nor "3" the integer 3 (an int is still a valid float).
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


_REFUSED_EXTENSIONS = (
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
)  # fmt: skip


class SamplingFields(_Request):
    """What completions and chat completions share. None means the engine's default."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # refused unless empty
    # vLLM's: per prompt token, its logprob and the top ones (the first token's null); not with stream.
    prompt_logprobs: int | None = None
    # vLLM extensions this server does not serve: refused when given, rather than silently ignored.
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    use_beam_search: bool = False
    skip_special_tokens: bool = True  # the text always leaves special tokens out

    def unsupported(self) -> str | None:
        """The first field set that the server cannot honour, as `name`, else None."""
        if self.logit_bias:
            return "logit_bias"
        for name in _REFUSED_EXTENSIONS:
            if getattr(self, name) is not None:
                return name
        if self.use_beam_search:
            return "use_beam_search"
        return None if self.skip_special_tokens else "skip_special_tokens"


class CompletionRequest(SamplingFields):
    # A string, a list of strings, a list of token ids, or a list of such lists (one choice per prompt).
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions; None: up to the context length
    logprobs: int | None = None  # the top tokens to return per position, besides the sampled one
    echo: bool = False  # each choice's text (and logprobs) begins with its prompt's
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return super().unsupported()


class ChatMessage(_Request):
    role: str
    # A string, or content parts of which only {"type": "text", "text": ...} are supported.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool = False
    top_logprobs: int | None = None  # with logprobs: the top tokens to return per position
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None  # refused unless empty
    response_format: dict[str, Any] | None = None  # only {"type": "text"}
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (vLLM's)

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format"
        return super().unsupported()


# ----------------------------------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


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


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
