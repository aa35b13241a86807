"""The prompt forms `LLM.generate` takes, as vLLM names them: a str, a TextPrompt or a TokensPrompt."""

from __future__ import annotations

from typing import Any, TypedDict, Union


class _Text(TypedDict):
    prompt: str


class TextPrompt(_Text, total=False):
    """A prompt given as text, which the engine's tokenizer encodes. `cache_salt` (vLLM's): its
    prefix-cache blocks are shared only with prompts given the same salt."""

    cache_salt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    """A prompt given as token ids, used as they are; `prompt`, its text, only goes back in the output;
    `cache_salt` as TextPrompt's."""

    prompt: str
    cache_salt: str


PromptType = Union[str, TextPrompt, TokensPrompt, dict[str, Any]]  # noqa: UP007 (an alias evaluated at import)
