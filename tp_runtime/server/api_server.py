"""`tp-runtime serve`'s app: OpenAI's API (FastAPI) over one AsyncLLMEngine.

Endpoints: POST /v1/completions and /v1/chat/completions (streamed as server-sent events when
`stream: true`), POST /tokenize (vLLM's: a text or a conversation tokenized as those two tokenize it) and
/detokenize, GET /v1/models, /v1/models/{id} (the model's card; 404 for another id), /version, /health
and /ping (vLLM's name, GET or POST: 200; 503 while shutting down; 500 once the engine died), /metrics
(Prometheus text). With an API key,
the /v1 endpoints, /tokenize and /detokenize need `Authorization: Bearer KEY`.

The front end runs on uvicorn's event loop. Per request it checks the key first, then reads the body (at
most `max_body_bytes`), and hands the rest of the work that grows with the request to a worker thread:
parsing the body, rendering the chat template, tokenizing (with a tokenizer of its own: the engine thread
decodes with the engine's) and checking every prompt and option. Back on the loop it adds one engine
request per prompt and sample to the engine thread and streams what comes back, so a huge prompt stalls
neither other streams nor /health. Errors have OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`: 400 for a bad request, 401 for a missing or wrong key, 404 for an unknown model, 413 for a
body over the limit, 415 for a POST under /v1 whose Content-Type is not application/json (decided from
the header, before anything else: `text/plain` is what a web page may send cross-origin without a CORS
preflight), 503 while shutting down, 500 after the engine died (its cause in one line; the full
traceback is only in the server's log). CORS headers are sent only for the `allowed_origins` given. A
client that disconnects, at any point of its response, has its requests aborted, which frees their KV
blocks.

`build_app` returns the app and `begin_drain(grace_s)`, which the runner (`server.runner`) calls when a
shutdown signal arrives: new requests get 503 and the engine drains, ending the requests still running
after `grace_s` with finish_reason "abort" (a stream still sends its last chunk and [DONE]).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import ipaddress
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from tp_runtime import __version__
from tp_runtime.engine.async_engine import AsyncLLMEngine, RequestStream
from tp_runtime.engine.llm import loops_over_content, template_variables
from tp_runtime.engine.llm_engine import check_cache_salt, child_params
from tp_runtime.errors import EngineClosedError, InvalidRequestError, TPRuntimeError
from tp_runtime.outputs import CompletionOutput, RequestMetrics
from tp_runtime.sampling_params import SamplingParams, StructuredOutputsParams, truncated_prompt
from tp_runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from tp_runtime.server.openai_format import (
    DONE,
    APIError,
    ChatFormat,
    CompletionFormat,
    Echo,
    Format,
    Piece,
    bad_request,
    error_body,
    error_event,
    failure,
    internal_error,
    sampling_params,
    sse,
    text_content,
    validation_message,
)
from tp_runtime.server.protocol import (
    ChatCompletionRequest,
    ChatTemplateFields,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingFields,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    VersionResponse,
    union_fields,
)
from tp_runtime.server.tool_calls import ToolPlan, template_tool_call

logger = logging.getLogger(__name__)

# Choices one request may ask for (prompts x n): each is an engine request.
MAX_CHOICES = 128
_MiB = 1 << 20
_Body = TypeVar("_Body", bound=pydantic.BaseModel)
_EngineRequests = list[tuple[list[int], SamplingParams]]
_GRAMMAR_COMPILE_THREADS = 2  # each compile spreads its token masks over xgrammar's own threads

# An engine output with more tokens than this (or with prompt logprobs) is formatted in a worker thread.
_PIECE_OFF_LOOP_TOKENS = 64
# The deepest nesting (objects and arrays) of a JSON schema a request may constrain its output with. The
# compile time of xgrammar grows with the cube of the depth (800 levels: about a minute of a CPU, in a
# thread the request holds), and a schema given as text is not bounded by the body parser's depth limit.
MAX_SCHEMA_DEPTH = 64
_TOKENIZE_REQUEST: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(TokenizeRequest)
# POSTs outside /v1 whose bodies are JSON too (and so refused as any other type, see _JSONBodiesOnly).
_JSON_POST_PATHS = frozenset({"/tokenize", "/detokenize"})


@dataclass(frozen=True)
class _Grammar:
    """A request's constraint, to compile before its engine requests are added, and the request's field
    that gave it (None: the constraint's own), for a 400's message."""

    spec: StructuredOutputsParams
    field: str | None


def json_depth(value: Any) -> int:
    """How deeply objects and arrays nest in `value` (parsed JSON): 0 for a scalar (no recursion)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in children)
    return deepest


def check_schema_depth(schema: Any, field: str) -> None:
    """400 naming `field` for a JSON schema (a dict, or its text) nested past MAX_SCHEMA_DEPTH; text that
    is not JSON is left to the compiler's message."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:  # past Python's own limit (about 1000 levels): deeper than ours
            depth = MAX_SCHEMA_DEPTH + 1
        except ValueError:
            return
        else:
            depth = json_depth(schema)
    else:
        depth = json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise bad_request(
            f"the JSON schema nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep; this server "
            "takes no deeper schema", field,
        )  # fmt: skip


def check_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise bad_request(
            f"the request asks for {num_prompts * n} choices (prompts x n); at most {MAX_CHOICES}",
            "n" if n > 1 else "prompt",
        )


def default_max_body_bytes(max_model_len: int) -> int:
    """The largest request body taken: room for a prompt of max_model_len tokens many times over (as
    escaped JSON text or as token ids), within [1, 8] MiB."""
    return min(8 * _MiB, max(_MiB, 64 * max_model_len))


@dataclass
class _Context:
    """What the routes of one app share (no module state: two apps in one process stay apart)."""

    engine: AsyncLLMEngine
    tokenizer: Any
    model_name: str
    max_model_len: int
    api_key: str | None
    metrics: ServerMetrics
    max_body_bytes: int
    tool_call_parser: str | None = None  # --tool-call-parser: reads tool_choice "auto"'s calls
    trust_request_chat_template: bool = False  # --trust-request-chat-template: a request's own template
    # The model's default sampling parameters (SamplingParams options by name, from its generation config:
    # GenerationDefaults.overrides()), for the options a request leaves out.
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    draining: bool = False
    # Grammars compile in threads of their own (made on first use, dropped with the app's lifespan), not
    # in those that parse every request and build every response: a schema with a large enum compiles for
    # seconds to minutes, and requests without one must not wait.
    grammar_compiles: ThreadPoolExecutor | None = None

    def failure(self, exc: BaseException) -> APIError:
        """A request the engine could not finish: it died (named by what killed it), or a bug (logged)."""
        if isinstance(exc, TPRuntimeError):
            return failure(self.engine.error or exc)
        logger.error("internal error", exc_info=exc)
        return internal_error(exc)

    def check_available(self) -> None:
        """500 once the engine died, 503 while the server drains."""
        if self.engine.error is not None:
            raise failure(self.engine.error)
        if self.draining or not self.engine.accepting:
            raise APIError(
                503, "the server is shutting down and takes no new requests", type="server_error", code=503
            )

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # The header's own bytes (the server decodes headers as latin-1) against the key's UTF-8, which
        # clients send a non-ASCII key as; only spaces and tabs are stripped (str.strip would also take
        # the bytes 0x85 and 0xA0 that end some UTF-8 characters: "à" is C3 A0).
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.encode("latin-1").strip(b" \t"), self.api_key.encode()
        ):
            raise APIError(
                401, "Incorrect or missing API key: send `Authorization: Bearer <key>` with the server's "
                "--api-key", code="invalid_api_key",
            )  # fmt: skip

    async def read_body(self, request: Request) -> bytes:
        """The request's body, refused (413) past max_body_bytes, before it is all read when it says so."""
        limit = self.max_body_bytes
        too_large = APIError(
            413, f"the request body is larger than this server takes ({limit} bytes)", code=413
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        return bytes(body)

    # ------------------------------------- the work a request's size drives, in worker threads (several at
    # once: the tokenizer is only read, never reconfigured, so concurrent encodes are safe)
    def parse(self, model: type[_Body], raw: bytes) -> _Body:
        try:
            body = model.model_validate_json(raw)
        except pydantic.ValidationError as exc:
            message, param = validation_message(exc.errors(), union_fields(model))
            raise bad_request(message, param) from None
        if isinstance(body, SamplingFields):
            options = body.stream_options
            if options is not None and options.model_fields_set and not body.stream:
                raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        self.check_model(getattr(body, "model", None))
        return body

    def check_model(self, name: str | None) -> None:
        """404 for a model name other than the served one. An empty name, like a missing one, means the
        served model (vLLM's rule: clients left unconfigured send "")."""
        if name and name != self.model_name:
            raise self.model_not_found(name)

    def model_not_found(self, name: str) -> APIError:
        return APIError(
            404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
            param="model", code="model_not_found",
        )  # fmt: skip

    def tokenize(self, raw: bytes) -> JSONResponse:
        """/tokenize: a text as /v1/completions tokenizes a string prompt, or a conversation as
        /v1/chat/completions renders and tokenizes it (the same code); the response encoded here too."""
        try:
            body = _TOKENIZE_REQUEST.validate_json(raw)
        except pydantic.ValidationError as exc:
            # Each error's location begins with the form's tag ("chat" or "completion"): leave it out.
            errors = [{**e, "loc": tuple(e.get("loc", ()))[1:]} for e in exc.errors()]
            message, param = validation_message(errors)
            raise bad_request(message, param) from None
        self.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            ids = self.chat_prompt(body, body.tools)
        elif body.prompt:
            ids = self.encode(body.prompt, body.add_special_tokens, "prompt")
        else:  # nothing to generate from, but a text to tokenize all the same
            ids = list(self.tokenizer("", add_special_tokens=body.add_special_tokens)["input_ids"])
        strs = list(self.tokenizer.convert_ids_to_tokens(ids)) if body.return_token_strs else None
        answer = TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs
        )
        return JSONResponse(answer.model_dump())

    def detokenize(self, raw: bytes) -> JSONResponse:
        """/detokenize: the ids' text with their special tokens (as echo decodes a token-id prompt), the
        response encoded here too; an id the tokenizer does not hold is a 400 naming tokens."""
        body = self.parse(DetokenizeRequest, raw)
        size = len(self.tokenizer)
        outside = next((t for t in body.tokens if not 0 <= t < size), None)
        if outside is not None:
            raise bad_request(f"token id {outside} is outside the vocabulary [0, {size})", "tokens")
        text = self.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if not text:
            raise bad_request(f"{param} is empty; give at least one character", param)
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        except Exception as exc:
            message = f"the tokenizer cannot encode the {param}: {type(exc).__name__}: {exc}"
            raise bad_request(message, param) from None

    def completion_prompts(self, prompt: Any, add_special_tokens: bool = True) -> list[list[int]]:
        """Each prompt's token ids: a string tokenized (with the tokenizer's special tokens, a BOS, unless
        `add_special_tokens` is false), token ids as given."""
        special = add_special_tokens
        if isinstance(prompt, str):
            return [self.encode(prompt, special, "prompt")]
        if not prompt:
            raise bad_request("prompt is empty; give a string, a list of strings or token ids", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return [self.encode(p, special, "prompt") if isinstance(p, str) else list(p) for p in prompt]

    def chat_prompt(self, body: ChatTemplateFields, tools: list[dict[str, Any]] | None) -> list[int]:
        """The conversation rendered by the chat template (the request's own, from a server that trusts
        them, else the server's) and tokenized, as LLM.chat does; `tools`: those the template shows."""
        template = body.chat_template
        if template is not None and not self.trust_request_chat_template:
            raise bad_request(
                "this server takes no chat_template in a request (a template is code the server runs); "
                "start it with --trust-request-chat-template to allow them, or with --chat-template to set "
                "its own", "chat_template",
            )  # fmt: skip
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(
                f"the model {self.model_name} has no chat template, so it cannot serve chat completions; "
                "use /v1/completions, or start the server with --chat-template", "messages",
            )  # fmt: skip
        if not body.messages:
            raise bad_request("messages is empty; give at least one message", "messages")
        messages = []
        try:
            parts = loops_over_content(self.tokenizer.get_chat_template(template, tools))
        except Exception as exc:  # a tokenizer's named templates without a default, say
            raise bad_request(f"the chat template: {type(exc).__name__}: {exc}", "messages") from None
        for i, m in enumerate(body.messages):
            message: dict[str, Any] = {"role": m.role, "content": text_content(m.content, i, parts)}
            if m.name is not None:
                message["name"] = m.name
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                try:
                    message["tool_calls"] = [template_tool_call(call) for call in m.tool_calls]
                except InvalidRequestError as exc:
                    raise bad_request(f"message {i}: {exc}", "messages") from None
            messages.append(message)
        variables_extra: dict[str, Any] = {"tools": tools} if tools is not None else {}
        if body.documents is not None:
            variables_extra["documents"] = list(body.documents)
        try:
            variables = template_variables(body.chat_template_kwargs)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), "chat_template_kwargs") from None
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, **variables_extra, **variables,
            )  # fmt: skip
        except Exception as exc:
            problem = f"the chat template failed: {type(exc).__name__}: {exc}"
            raise bad_request(problem, "chat_template" if template is not None else "messages") from None
        # The template writes the special tokens (BOS...) itself; add_special_tokens adds the tokenizer's too.
        return self.encode(str(text), body.add_special_tokens, "messages")

    def tool_plan(self, body: ChatCompletionRequest) -> ToolPlan | None:
        try:
            parallel = body.parallel_tool_calls is not False
            return ToolPlan.of(body.tools, body.tool_choice, self.tool_call_parser, parallel)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), exc.field) from None

    def truncated(self, body: SamplingFields, ids: list[int]) -> list[int]:
        """The prompt as the request's truncate_prompt_tokens (vLLM's) leaves it: its last tokens."""
        keep = body.truncate_prompt_tokens
        if keep is not None and not (keep >= 1 or keep == -1):
            raise bad_request(
                f"truncate_prompt_tokens must be -1 (max_model_len) or an int >= 1, got {keep}",
                "truncate_prompt_tokens",
            )
        try:
            return list(truncated_prompt(ids, keep, self.max_model_len))
        except InvalidRequestError as exc:
            raise bad_request(str(exc), "truncate_prompt_tokens") from None

    def max_tokens(self, requested: int | None, prompt_len: int, param: str, prompt_param: str) -> int:
        """The output budget, with vLLM's messages for a request that does not fit the context: the request's
        (None: the rest of the context), at most the model's default max_tokens (its generation config's
        max_new_tokens) where it has one, as vLLM's smallest of the two."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt_len} input tokens. Please reduce the length of the input messages.", prompt_param,
            )  # fmt: skip
        if requested is not None and requested >= 1 and prompt_len + requested > limit:
            raise bad_request(
                f"'{param}' is too large: {requested}. This model's maximum context length is {limit} tokens "
                f"and your request has {prompt_len} input tokens ({requested} > {limit} - {prompt_len}).",
                param,
            )
        budget = limit - prompt_len if requested is None else requested
        cap = self.sampling_defaults.get("max_tokens")
        return budget if cap is None else min(budget, cap)

    def engine_requests(
        self, body: SamplingFields, prompts: list[list[int]], max_tokens: int | None, param: str,
        logprobs: int | None, logprobs_param: str, prompt_param: str, prompt_logprobs: int | None = None,
        prompt_logprobs_per_sample: bool = False, constraint: StructuredOutputsParams | None = None,
    ) -> tuple[_EngineRequests, _Grammar | None]:  # fmt: skip
        """Check every prompt and the sampling options; one engine request per prompt and sample (choice
        index = prompt index * n + sample index), and the grammar they share, to compile (compile_grammar)
        before they are added. `param`, `logprobs_param`, `prompt_param`: the request's names of the
        output budget, the number of top logprobs and the prompt, for error messages; `prompt_logprobs`:
        the top logprobs per prompt position that a prompt's first sample computes (or every sample, with
        `prompt_logprobs_per_sample`); None: none."""
        try:
            check_cache_salt(body.cache_salt)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), "cache_salt") from None
        limit = self.engine.engine.config.max_logprobs
        for name, count in ((logprobs_param, logprobs), ("prompt_logprobs", body.prompt_logprobs)):
            if count is not None and count < 0:
                raise bad_request(f"{name} must be None or an int >= 0, got {count}", name)
            if count is not None and count > limit:
                raise bad_request(
                    f"{name}={count} exceeds this server's maximum of {limit}; ask for fewer (the server's "
                    "--max-logprobs sets the maximum)", name,
                )  # fmt: skip
        if body.prompt_logprobs and body.stream:  # 0 passes, as vLLM's check lets it (a stream shows none)
            raise bad_request(
                "prompt_logprobs is not available with stream; leave it out or give 0", "prompt_logprobs"
            )
        unsupported = body.unsupported()
        if unsupported:
            raise bad_request(f"{unsupported} is not supported by this server", unsupported)
        check_choices(len(prompts), body.n)
        requests = []
        grammar = None
        names = {"max_tokens": param, "logprobs": logprobs_param}
        for ids in prompts:
            budget = self.max_tokens(max_tokens, len(ids), param, prompt_param)
            params = sampling_params(body, budget, logprobs, names, prompt_logprobs, self.sampling_defaults)
            if constraint is not None:
                params = replace(params, structured_outputs=constraint)
            spec = params.structured_outputs
            if spec is not None and grammar is not None:  # every prompt's is the same: the one compiled
                params = replace(params, structured_outputs=grammar.spec)
            elif spec is not None:
                given = "tools" if constraint is not None else body.constraint_field()
                schema = spec.json if spec.json is not None else spec.structural_tag  # (one holding schemas)
                if schema is not None:
                    check_schema_depth(schema, given or "structured_outputs")
                grammar = _Grammar(spec, given)
            try:
                ids = self.engine.engine.check_request(ids, child_params(params, 0))
            except InvalidRequestError as exc:
                raise bad_request(str(exc), prompt_param if exc.field == "prompt" else exc.field) from None
            for j in range(params.n):
                child = child_params(params, j)
                # Assigned, not replace()d: a child's seed -1 stays the seed -1 (replace reads it as none).
                child.prompt_logprobs = prompt_logprobs if j == 0 or prompt_logprobs_per_sample else None
                requests.append((ids, child))
        return requests, grammar

    async def compile_grammar(self, grammar: _Grammar | None) -> None:
        """Compile a request's grammar (a 400 naming the field for a bad one) in the grammar threads, off
        the engine's thread: the engine's own compile, when the request is added, is then a cache hit."""
        if grammar is None:
            return
        if self.grammar_compiles is None:  # (only the event loop's thread comes here)
            self.grammar_compiles = ThreadPoolExecutor(_GRAMMAR_COMPILE_THREADS, "tp-runtime-grammar")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(
                self.grammar_compiles, self.engine.engine.grammars.compile, grammar.spec
            )
        except InvalidRequestError as exc:
            raise bad_request(str(exc), grammar.field or exc.field) from None

    def prepare_completion(
        self, raw: bytes
    ) -> tuple[CompletionRequest, _EngineRequests, _Grammar | None, int, list[Echo] | None]:
        """The request, its engine requests, their grammar to compile, its prompt tokens and, with echo,
        each choice's prompt text (as given, or its token ids decoded)."""
        body = self.parse(CompletionRequest, raw)
        # Before any prompt is tokenized: a request for too many choices is refused at no cost.
        many = isinstance(body.prompt, list) and not all(isinstance(p, int) for p in body.prompt)
        check_choices(len(body.prompt) if many else 1, body.n)
        whole = self.completion_prompts(body.prompt, body.add_special_tokens)
        prompts = [self.truncated(body, ids) for ids in whole]
        # echo with max_tokens 0 (the prompt alone, as vLLM serves it): the engine makes one token that the
        # response leaves out (CompletionFormat.prompt_only).
        prompt_only = body.echo and body.max_tokens == 0
        if prompt_only and body.min_tokens != 0:
            raise bad_request(f"min_tokens must be 0 with max_tokens=0, got {body.min_tokens}", "min_tokens")
        # Echo with logprobs shows the prompt tokens' too; a stream, in every choice's first chunk, so there
        # each sample computes them (else the prompt's first sample does, for all its choices).
        echo_logprobs = body.logprobs if body.echo else None
        prompt_top = None if body.stream else body.prompt_logprobs  # a stream's chunks carry none
        wanted = [k for k in (prompt_top, echo_logprobs) if k is not None]
        per_sample = echo_logprobs is not None and body.stream
        requests, grammar = self.engine_requests(
            body, prompts, 1 if prompt_only else body.max_tokens, "max_tokens", body.logprobs, "logprobs",
            "prompt", max(wanted, default=None), prompt_logprobs_per_sample=per_sample,
        )  # fmt: skip
        if prompt_only:  # the one token made is left out: nothing may end it but its count
            requests = [
                (ids, replace(params, ignore_eos=True, stop=None, stop_token_ids=None))
                for ids, params in requests
            ]
        echoes = None
        if body.echo:
            given = body.prompt if isinstance(body.prompt, list) else [body.prompt]
            # A text prompt echoes as given (unless truncate_prompt_tokens cut it: then as the model read it).
            per_prompt = [
                Echo(text, self.added_in_front if body.add_special_tokens else 0)
                if isinstance(text, str) and len(ids) == len(full)
                else Echo(self.tokenizer.decode(ids, skip_special_tokens=False), 0)
                for text, ids, full in zip(
                    given if len(given) == len(prompts) else [None], prompts, whole, strict=True
                )
            ]  # fmt: skip
            echoes = [per_prompt[k // body.n] for k in range(len(requests))]
        return body, requests, grammar, sum(map(len, prompts)), echoes

    @functools.cached_property
    def added_in_front(self) -> int:
        """How many tokens (a BOS) the tokenizer puts in front of a text it encodes."""
        bare = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        full = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        return len(full) - len(bare) if bare and full[-len(bare) :] == bare else 0

    def prepare_chat(
        self, raw: bytes
    ) -> tuple[ChatCompletionRequest, _EngineRequests, _Grammar | None, int, ToolPlan | None]:
        """The request, its engine requests, their grammar to compile, its prompt tokens and what its tools
        ask for."""
        body = self.parse(ChatCompletionRequest, raw)
        check_choices(1, body.n)  # before the template and the tokenizer run
        plan = self.tool_plan(body)
        if plan is not None and plan.keeps_special_tokens:
            body = body.model_copy(update={"skip_special_tokens": False})
        # No plan (no tools, or `tools: []`): the tools as given, as /tokenize and vLLM pass them.
        ids = self.chat_prompt(body, body.tools if plan is None else plan.template_tools(body.tools or []))
        ids = self.truncated(body, ids)
        if body.top_logprobs not in (None, 0) and not body.logprobs:  # 0 is the field's default in vLLM's
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        constraint = plan.constraint() if plan is not None else None
        try:
            other = body.structured() if constraint is not None else None
        except InvalidRequestError as exc:  # a bad constraint beside the tools': the same 400 as alone
            raise bad_request(str(exc), exc.field) from None
        if other is not None:
            raise bad_request(
                f"tool_choice {body.tool_choice!r} constrains the output already; leave out response_format "
                "and structured_outputs", "tool_choice",
            )  # fmt: skip
        requests, grammar = self.engine_requests(
            body, [ids], max_tokens, param, logprobs, "top_logprobs", "messages",
            None if body.stream else body.prompt_logprobs, constraint=constraint,
        )  # fmt: skip
        return body, requests, grammar, len(ids), plan

    # --------------------------------------------------------------------------------- the event loop's
    def submit(
        self, requests: _EngineRequests, num_prompt_tokens: int, cache_salt: str | None = None
    ) -> RequestStream:
        self.check_available()
        try:
            stream = self.engine.add(requests, cache_salt)
        except EngineClosedError:  # it died or began to drain since the check above
            self.check_available()
            raise
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        return stream


# ---------------------------------------------------------------------------------------- one request


class _Run:
    """One HTTP request's engine requests: their stream, its endpoint's format, what each choice produced
    so far, and the metrics."""

    def __init__(
        self, ctx: _Context, stream: RequestStream, fmt: Format, num_choices: int, num_prompt_tokens: int,
        arrival: float, samples_per_prompt: int = 1, prompt_lengths: list[int] | None = None,
    ) -> None:  # fmt: skip
        """`prompt_lengths`: each choice's prompt tokens (for continuous usage stats)."""
        self.ctx = ctx
        self.prompt_lengths = prompt_lengths or [0] * num_choices
        self.stream = stream
        self.fmt = fmt
        self.ident = f"{fmt.id_prefix}{uuid.uuid4().hex}"
        self.arrival = arrival  # time.monotonic() when the request came in, before it was tokenized
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.tokens = [0] * num_choices
        self.cached_tokens = [0] * num_choices  # prompt tokens each choice found in the prefix cache
        self._last = [self.arrival] * num_choices
        self._queue_observed = [False] * num_choices
        self.samples_per_prompt = max(1, samples_per_prompt)

    @property
    def num_choices(self) -> int:
        return len(self.tokens)

    async def pieces(self) -> AsyncIterator[Piece]:
        """The engine's outputs as they come, each as a piece of its choice (and counted in the metrics)."""
        async for index, out in self.stream:
            c = out.outputs[0]
            if self.fmt.prompt_only:
                # Its one token ends it ("length"), whatever it was; an abort (a drain) stays one.
                finish = c.finish_reason if c.finish_reason in (None, "abort") else "length"
                c = replace(c, text="", token_ids=[], logprobs=None, finish_reason=finish, stop_reason=None)
            self.observe(index, c, out.finished, out.metrics)
            self.cached_tokens[index] = out.num_cached_tokens
            if out.prompt_logprobs is not None or len(c.token_ids) > _PIECE_OFF_LOOP_TOKENS:
                # Much to format (a prompt's logprobs, a long output's): off the event loop.
                yield await asyncio.to_thread(self.fmt.piece, index, c, out.finished, out.prompt_logprobs)
            else:
                yield self.fmt.piece(index, c, out.finished, out.prompt_logprobs)

    def observe(
        self, index: int, out: CompletionOutput, finished: bool, times: RequestMetrics | None = None
    ) -> None:
        now = time.monotonic()
        metrics = self.ctx.metrics
        count = len(out.token_ids)
        scheduled = None if times is None else times.first_scheduled_time
        if times is not None and scheduled is not None and not self._queue_observed[index]:
            # Once per choice, also for one aborted before its first token (as vLLM counts it).
            self._queue_observed[index] = True
            metrics.request_queue_time.observe(scheduled - times.arrival_time)
        if count:
            metrics.generation_tokens.inc(count)
            if self.tokens[index] == 0:
                metrics.time_to_first_token.observe(now - self.arrival)
                if times is not None and scheduled is not None and times.first_token_time is not None:
                    metrics.request_prefill_time.observe(times.first_token_time - scheduled)
            else:
                metrics.inter_token_latency.observe(now - self._last[index])
            self.tokens[index] += count
            self._last[index] = now
        if finished:
            metrics.e2e_request_latency.observe(now - self.arrival)

    def choice_usage(self, index: int) -> UsageInfo:
        """Choice `index`'s usage so far: its prompt's tokens and its own (continuous_usage_stats, as vLLM
        counts them)."""
        prompt, completion = self.prompt_lengths[index], self.tokens[index]
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens[index]),
        )  # fmt: skip

    def usage(self) -> UsageInfo:
        completion = sum(self.tokens)
        # Each prompt counts once, as in prompt_tokens: what its first sample (which computes it) found.
        cached = sum(self.cached_tokens[:: self.samples_per_prompt])
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
            total_tokens=self.num_prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )  # fmt: skip

    def close(self) -> None:
        """The reader is done (or gone): abort what has not finished, freeing its KV blocks."""
        if not self.stream.finished:
            self.ctx.engine.abort(self.stream)


async def _response(run: _Run) -> Response:
    """The whole response, once every choice has finished; assembled and encoded off the event loop (a
    response with logprobs or echoed prompts can be megabytes)."""
    pieces: list[list[Piece]] = [[] for _ in range(run.num_choices)]
    try:
        async for piece in run.pieces():
            pieces[piece.index].append(piece)
    except TPRuntimeError as exc:  # the engine died under the request
        raise run.ctx.failure(exc) from None

    def assemble() -> Response:
        choices = [run.fmt.choice(i, p) for i, p in enumerate(pieces)]
        response = run.fmt.response(run.ident, run.created, run.ctx.model_name, choices, run.usage())
        return JSONResponse(response.model_dump())

    return await asyncio.to_thread(assemble)


async def _events(run: _Run, with_usage: bool, continuous: bool = False) -> AsyncGenerator[str, None]:
    """The response as server-sent events: a chunk per output worth sending, the usage if asked for, then
    [DONE]. `continuous` (vLLM's continuous_usage_stats, with include_usage): each choice's chunk carries
    its choice's usage so far. A failure after the first event (the status line is out) is an error
    event, then [DONE]."""
    fmt = run.fmt

    def chunk(choices: list[Any], usage: UsageInfo | None = None) -> str:
        # With include_usage every chunk carries "usage" (null but in the last, unless continuous), else
        # none does.
        response = fmt.chunk(run.ident, run.created, run.ctx.model_name, choices, usage)
        return sse(response, exclude=None if with_usage else {"usage"})

    def choice_usage(index: int) -> UsageInfo | None:
        return run.choice_usage(index) if continuous else None

    try:
        for index, opening in enumerate(fmt.opening(run.num_choices)):
            yield chunk([opening], choice_usage(index))
        async for piece in run.pieces():
            if piece.worth_sending():
                yield chunk([fmt.delta(piece)], choice_usage(piece.index))
        if with_usage:
            yield chunk([], run.usage())
    except Exception as exc:  # the engine died mid-stream (or a bug): say so in the stream
        yield error_event(run.ctx.failure(exc))
    yield DONE


class _EventStream(StreamingResponse):
    """A run's server-sent events, tied to the run for the response's whole life: however the response
    ends (every event sent, the client gone, even before the first event was made, or the task cancelled),
    the run's unfinished engine requests are aborted."""

    def __init__(self, run: _Run, with_usage: bool, continuous: bool = False) -> None:
        self._run = run
        self._events = _events(run, with_usage, continuous)
        # No proxy buffering: each event goes out as it is made.
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(self._events, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._run.close()
            with contextlib.suppress(Exception):
                await self._events.aclose()


async def _until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(
    request: Request, run: _Run, work: Callable[[], Coroutine[Any, Any, Any]]
) -> Any:
    """Run `work()` (a coroutine that reads the run's stream) unless the client goes away first, in which
    case its requests are aborted; returns work's result, or None when the client left."""
    task = asyncio.ensure_future(work())
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        left = not task.done()
        if left:
            task.cancel()
        run.close()
    return None if left else task.result()


async def _serve(
    ctx: _Context, request: Request, prepared: tuple[SamplingFields, _EngineRequests, int], fmt: Format,
    arrival: float,
) -> Response:  # fmt: skip
    """Add a prepared request's engine requests and answer with their outputs: as events, or whole."""
    body, requests, num_prompt_tokens = prepared
    stream = ctx.submit(requests, num_prompt_tokens, body.cache_salt)
    run = _Run(ctx, stream, fmt, len(requests), num_prompt_tokens, arrival,
               samples_per_prompt=getattr(body, "n", None) or 1,
               prompt_lengths=[len(ids) for ids, _ in requests])  # fmt: skip
    if body.stream:
        options = body.stream_options
        with_usage = options is not None and bool(options.include_usage)
        # As vLLM: continuous_usage_stats counts only with include_usage.
        continuous = with_usage and options is not None and options.continuous_usage_stats
        return _EventStream(run, with_usage=with_usage, continuous=continuous)
    response = await _unless_disconnected(request, run, lambda: _response(run))
    return Response(status_code=499) if response is None else response


# ------------------------------------------------------------------------------------------- the app


def _error_json(status: int, info: ErrorInfo, headers: Mapping[str, str] | None = None) -> JSONResponse:
    if info.code is None:
        info = info.model_copy(update={"code": status})
    return JSONResponse(error_body(info), status_code=status, headers=headers)


def unsupported_content_type(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The Content-Type of a request whose body is not declared JSON (415; "" when it has none), or None
    for `application/json` with any parameters (`; charset=utf-8`), in any case. A body with no
    Content-Type is refused too: a web page can send one cross-origin without a CORS preflight (a
    `fetch` of a Blob), as FastAPI's own strict_content_type check holds."""
    for name, value in headers:
        if name.lower() == b"content-type":
            text = value.decode("latin-1")
            return None if text.split(";", 1)[0].strip().lower() == "application/json" else text
    return ""


class _JSONBodiesOnly:
    """POST under /v1 (and /tokenize, /detokenize): a body that is not declared JSON gets 415, from its
    headers alone (the body is not read). The reason: a web page may send `text/plain` (or a form)
    cross-origin without a CORS preflight, so without this check any site the user visits could drive a
    local server."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            checked = path.startswith("/v1/") or path in _JSON_POST_PATHS
            given = unsupported_content_type(scope["headers"]) if checked else None
            if given is not None:
                what = f"unsupported Content-Type {given[:100]!r}" if given else "no Content-Type"
                message = f"{what}: send the request body as JSON, with `Content-Type: application/json`"
                info = ErrorInfo(message=message, type="invalid_request_error", code=415)
                await _error_json(415, info)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def host_name(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The name a request's Host header gives (its port and an IPv6 literal's brackets taken off, lower
    case, no trailing dot); None without one."""
    for name, value in headers:
        if name.lower() == b"host":
            text = value.decode("latin-1").strip().lower()
            if text.startswith("["):
                return text[1:].partition("]")[0]
            return text.rpartition(":")[0].rstrip(".") if ":" in text else text.rstrip(".")
    return None


def beyond_rebinding(host: str) -> bool:
    """Whether a Host name is one DNS rebinding cannot bring to this server: an IP address, a name under
    `.localhost` (browsers resolve those to loopback themselves), or one without a dot (`localhost`, a
    machine's own name: the rebinding page's name is a domain its author registered)."""
    if "." not in host or host.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class _KnownHostsOnly:
    """A request whose Host header names a domain (see beyond_rebinding) other than `names` gets 400
    before anything else runs. The defence of a server on loopback against DNS rebinding: a page of
    attacker.example whose name is re-pointed at 127.0.0.1 is the server's own origin to the browser (no
    CORS, JSON bodies sent, answers read), but its requests still say `Host: attacker.example`."""

    def __init__(self, app: ASGIApp, names: Sequence[str]) -> None:
        self.app = app
        self.names = frozenset(n.lower().rstrip(".") for n in names)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = host_name(scope["headers"])
            if host is not None and not beyond_rebinding(host) and host not in self.names:
                message = (
                    f"this server does not answer to the host name {host[:100]!r} (a web page reached "
                    "through DNS rebinding would send it); reach it by localhost or an IP address, or "
                    "start it with --allowed-hosts naming this host"
                )
                await _error_json(400, ErrorInfo(message=message, type="invalid_request_error"))(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)


def build_app(
    engine: AsyncLLMEngine,
    tokenizer: Any,
    *,
    model_name: str,
    api_key: str | None = None,
    on_ready: Callable[[], None] | None = None,
    max_body_bytes: int | None = None,
    allowed_origins: Sequence[str] | None = None,
    allowed_hosts: Sequence[str] | None = None,
    tool_call_parser: str | None = None,
    trust_request_chat_template: bool = False,
) -> tuple[FastAPI, Callable[[float], None]]:
    """The FastAPI app serving `engine` (started by the caller) under `model_name`. `tokenizer`: the front
    end's own (the engine thread decodes with the engine's). `max_body_bytes`: the largest request body
    taken (default `default_max_body_bytes`). `allowed_origins`: the web origins that get CORS headers
    ("*": any; default none: no CORS headers, and a preflight gets 405). `allowed_hosts`: the domain names
    that requests may carry in their Host header besides IP addresses and dotless names such as localhost
    (None: any; see _KnownHostsOnly). `trust_request_chat_template`:
    take a request's own chat_template (else it is a 400). Returns the app and
    `begin_drain(grace_s)`, to call on the event loop when the server begins to shut down: new requests get
    503 (and /health 503), and the engine lets the requests in flight run for up to `grace_s` seconds, then
    ends them with finish_reason "abort", so each stream still sends its last chunk and [DONE], and shuts
    down."""
    max_model_len = engine.engine.config.model.max_model_len
    ctx = _Context(
        engine=engine, tokenizer=tokenizer, model_name=model_name, max_model_len=max_model_len,
        api_key=api_key, metrics=ServerMetrics(model_name, lambda: engine.stats),
        max_body_bytes=max_body_bytes or default_max_body_bytes(max_model_len),
        tool_call_parser=tool_call_parser, trust_request_chat_template=trust_request_chat_template,
        sampling_defaults=engine.engine.config.model.generation_defaults.overrides(),
    )  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:  # none queued starts; one running ends on its own (the interpreter's exit waits for it)
            pool, ctx.grammar_compiles = ctx.grammar_compiles, None
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="tp_runtime", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # The last one added runs first: the Host check, CORS (its headers on every answer, 415s included),
    # then the Content-Type check.
    app.add_middleware(_JSONBodiesOnly)
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )  # fmt: skip
    if allowed_hosts is not None:
        app.add_middleware(_KnownHostsOnly, names=allowed_hosts)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_json(exc.status, exc.info)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{**e, "loc": tuple(e.get("loc", ()))[1:]} for e in exc.errors()]  # after "body", "query"
        message, param = validation_message(errors)
        return _error_json(400, ErrorInfo(message=message, type="invalid_request_error", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        # Starlette's own headers kept: a 405 names the allowed methods (Allow), as RFC 9110 requires.
        return _error_json(exc.status_code, ErrorInfo(message=str(exc.detail), type=kind), exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client closed the connection (or was closed for stalling) before its body was in: nobody is
        # left to answer, and nothing went wrong here. 499: nginx's "client closed request", for the log.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def unhandled_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error in %s", request.url.path, exc_info=exc)
        return _error_json(500, internal_error(exc).info)

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's name of it (SageMaker's health check)
    async def health() -> Response:
        ctx.check_available()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    # The one model's card, the same on every call (created: when the app was built).
    card = ModelCard(id=model_name, created=int(time.time()), max_model_len=max_model_len)

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        ctx.authorize(request)
        return ModelList(data=[card])

    @app.get("/v1/models/{model_id:path}")  # a served name may hold slashes (org/model)
    async def model(request: Request, model_id: str) -> ModelCard:
        ctx.authorize(request)
        if model_id != model_name:
            raise ctx.model_not_found(model_id)
        return card

    # The key is checked before the body is read; the body is parsed, tokenized and checked off the loop.
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        ctx.authorize(request)
        ctx.check_available()
        body, requests, grammar, num_prompt_tokens, echoes = await asyncio.to_thread(
            ctx.prepare_completion, await ctx.read_body(request)
        )
        await ctx.compile_grammar(grammar)
        fmt = CompletionFormat(body, [ids for ids, _ in requests], tokenizer, echoes)
        return await _serve(ctx, request, (body, requests, num_prompt_tokens), fmt, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        ctx.authorize(request)
        ctx.check_available()
        body, requests, grammar, num_prompt_tokens, plan = await asyncio.to_thread(
            ctx.prepare_chat, await ctx.read_body(request)
        )
        await ctx.compile_grammar(grammar)
        fmt = ChatFormat(body, ctx.tokenizer, plan)
        return await _serve(ctx, request, (body, requests, num_prompt_tokens), fmt, arrival)

    # vLLM's tokenizer API, under the same key as /v1: a text or a conversation tokenized exactly as the
    # completions and chat endpoints tokenize it, in a worker thread.
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        ctx.authorize(request)
        ctx.check_available()
        response: Response = await asyncio.to_thread(ctx.tokenize, await ctx.read_body(request))
        return response

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        ctx.authorize(request)
        ctx.check_available()
        response: Response = await asyncio.to_thread(ctx.detokenize, await ctx.read_body(request))
        return response

    def begin_drain(grace_s: float) -> None:
        ctx.draining = True
        engine.drain(grace_s)

    return app, begin_drain
