"""The prompt forms `LLM.generate` takes, as vLLM names them: a str, a TextPrompt or a TokensPrompt."""

from __future__ import annotations

from typing import Any, TypedDict, Union


class TextPrompt(TypedDict):
    """A prompt given as text, which the engine's tokenizer encodes."""

    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    """A prompt given as token ids, used as they are; `prompt`, its text, only goes back in the output."""

    prompt: str


PromptType = Union[str, TextPrompt, TokensPrompt, dict[str, Any]]  # noqa: UP007 (an alias evaluated at import)
