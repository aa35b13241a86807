"""`tp-runtime serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over one AsyncLLMEngine.

Endpoints: POST /v1/completions and /v1/chat/completions (streamed as server-sent events when
`stream: true`), GET /v1/models, /health (200; 503 while shutting down; 500 once the engine died),
/metrics (Prometheus text). With an API key, the /v1 endpoints need `Authorization: Bearer KEY`.

The front end runs on uvicorn's event loop in the main thread: it parses, tokenizes (with a tokenizer
of its own: the engine thread decodes with the engine's) and checks each request, then hands one engine
request per prompt and sample to the engine thread and streams what comes back. Errors have OpenAI's
shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request, 401 for a missing or
wrong key, 404 for an unknown model, 503 while shutting down, 500 after the engine died. A client that
disconnects has its requests aborted, which frees their KV blocks.

One uvicorn worker: the engine, its thread and its worker processes live in this process. SIGTERM (or
Ctrl-C) drains: the server stops accepting connections, requests in flight run to their end for up to
the grace period (--shutdown-grace), then the rest are aborted and the workers shut down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tp_runtime.engine.async_engine import AsyncLLMEngine, RequestStream
from tp_runtime.engine.llm_engine import child_params
from tp_runtime.errors import ConfigError, EngineClosedError, InvalidRequestError, TPRuntimeError
from tp_runtime.outputs import CompletionOutput, Logprob
from tp_runtime.sampling_params import SamplingParams
from tp_runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from tp_runtime.server.protocol import (
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
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    TopLogprob,
    UsageInfo,
)

logger = logging.getLogger(__name__)

# JSON has no -inf; OpenAI (and vLLM) send this instead.
_MIN_LOGPROB = -9999.0
# Choices one request may ask for (prompts x n): each is an engine request.
MAX_CHOICES = 128


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
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)


def _error_json(status: int, info: ErrorInfo) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status)


def _bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _failure(exc: BaseException) -> APIError:
    """A request the engine could not finish: it died under it, or (not an engine error) a bug."""
    if isinstance(exc, TPRuntimeError):
        return APIError(500, f"the engine failed: {type(exc).__name__}: {exc}", type="server_error", code=500)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error", code=500)


@dataclass
class _Context:
    """What the routes of one app share (no module state: two apps in one process stay apart)."""

    engine: AsyncLLMEngine
    tokenizer: Any
    model_name: str
    max_model_len: int
    api_key: str | None
    metrics: ServerMetrics
    draining: bool = False

    def check_available(self) -> None:
        """500 once the engine died, 503 while the server drains."""
        if self.engine.error is not None:
            raise _failure(self.engine.error)
        if self.draining or not self.engine.accepting:
            raise APIError(
                503, "the server is shutting down and takes no new requests", type="server_error", code=503
            )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                param="model", code="model_not_found",
            )  # fmt: skip

    # -------------------------------------------------------------------------------- tokenization
    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if not text:
            raise _bad_request(f"{param} is empty; give at least one character", param)
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        except Exception as exc:
            message = f"the tokenizer cannot encode the {param}: {type(exc).__name__}: {exc}"
            raise _bad_request(message, param) from None

    def completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.encode(prompt, True, "prompt")]
        if not prompt:
            raise _bad_request("prompt is empty; give a string, a list of strings or token ids", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return [self.encode(p, True, "prompt") if isinstance(p, str) else list(p) for p in prompt]

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The conversation rendered by the chat template and tokenized, as LLM.chat does."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise _bad_request(
                f"the model {self.model_name} has no chat template, so it cannot serve chat completions; "
                "use /v1/completions", "messages",
            )  # fmt: skip
        if not body.messages:
            raise _bad_request("messages is empty; give at least one message", "messages")
        messages = []
        for i, m in enumerate(body.messages):
            message: dict[str, Any] = {"role": m.role, "content": _text_content(m.content, i)}
            if m.name is not None:
                message["name"] = m.name
            messages.append(message)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
            )  # fmt: skip
        except Exception as exc:
            problem = f"the chat template failed: {type(exc).__name__}: {exc}"
            raise _bad_request(problem, "messages") from None
        # The template writes the special tokens (BOS...) itself.
        return self.encode(str(text), False, "messages")

    # ---------------------------------------------------------------------------------- admission
    def max_tokens(self, requested: int | None, prompt_len: int, param: str) -> int:
        """The output budget, with vLLM's messages for a request that does not fit the context."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise _bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt_len} input tokens. Please reduce the length of the input messages.", param,
            )  # fmt: skip
        if requested is None:
            return limit - prompt_len
        if requested >= 1 and prompt_len + requested > limit:
            raise _bad_request(
                f"'{param}' is too large: {requested}. This model's maximum context length is {limit} tokens "
                f"and your request has {prompt_len} input tokens ({requested} > {limit} - {prompt_len}).",
                param,
            )
        return requested

    def submit(
        self,
        body: SamplingFields,
        prompts: list[list[int]],
        max_tokens: int | None,
        param: str,
        logprobs: int | None,
    ) -> RequestStream:
        """Check every prompt and the sampling options, then add one engine request per prompt and sample
        (choice index = prompt index * n + sample index)."""
        unsupported = body.unsupported()
        if unsupported:
            raise _bad_request(f"{unsupported} is not supported by this server", unsupported)
        if len(prompts) * body.n > MAX_CHOICES:
            raise _bad_request(
                f"the request asks for {len(prompts) * body.n} choices (prompts x n); at most {MAX_CHOICES}",
                "n",
            )
        requests = []
        for ids in prompts:
            params = _sampling_params(body, self.max_tokens(max_tokens, len(ids), param), logprobs)
            try:
                ids = self.engine.engine.check_request(ids, child_params(params, 0))
            except InvalidRequestError as exc:
                raise _bad_request(str(exc)) from None
            requests += [(ids, child_params(params, j)) for j in range(params.n)]
        self.check_available()
        try:
            stream = self.engine.add(requests)
        except EngineClosedError:  # it died or began to drain since the check above
            self.check_available()
            raise
        self.metrics.prompt_tokens.inc(sum(map(len, prompts)))
        return stream


def _validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """pydantic's errors about a request body as one message, and the first field named."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return "the request body is not valid JSON", None
    by_field: dict[str, list[Any]] = {}
    for e in errors:
        loc = [str(x) for x in e.get("loc", ())[1:]]  # after "body"
        by_field.setdefault(loc[0] if loc else "body", []).append((loc, e))
    problems = []
    for name, found in by_field.items():
        if len(found) > 1 and all(len(loc) == 2 for loc, _ in found):  # every branch of a union failed
            kinds = ", ".join(loc[1] for loc, _ in found)
            value = found[0][1].get("input")
            problems.append(f"{name}: {value!r} is none of the types it takes ({kinds})")
        else:
            problems += [f"{'.'.join(loc) or 'body'}: {e.get('msg')}" for loc, e in found]
    return "; ".join(problems), next((n for n in by_field if n != "body"), None)


def _text_content(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _bad_request(
                f"message {index}: only text content parts ({{'type': 'text', 'text': ...}}) are supported, "
                f"got type {part.get('type')!r}", "messages",
            )  # fmt: skip
        parts.append(part["text"])
    return "".join(parts)


def _sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The request's options; one left out (None) takes the engine's default."""

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    try:
        return SamplingParams(
            n=body.n,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            temperature=given(body.temperature, 1.0),
            top_p=given(body.top_p, 1.0),
            top_k=given(body.top_k, -1),
            min_p=given(body.min_p, 0.0),
            seed=body.seed,
            stop=body.stop or None,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logprobs=logprobs,
            presence_penalty=given(body.presence_penalty, 0.0),
            frequency_penalty=given(body.frequency_penalty, 0.0),
            repetition_penalty=given(body.repetition_penalty, 1.0),
        )
    except InvalidRequestError as exc:
        message = str(exc).removeprefix("invalid SamplingParams: ")
        field = message.split(" ", 1)[0]  # the message names the option first
        raise _bad_request(message, field if field in type(body).model_fields else None) from None


# ---------------------------------------------------------------------------------------- one request


class _Run:
    """One HTTP request's engine requests: their stream, what each choice produced, and the metrics."""

    def __init__(
        self, ctx: _Context, stream: RequestStream, num_choices: int, num_prompt_tokens: int, arrival: float
    ) -> None:
        self.ctx = ctx
        self.stream = stream
        self.arrival = arrival  # time.monotonic() when the request came in, before it was tokenized
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.tokens = [0] * num_choices
        self._last = [self.arrival] * num_choices

    def observe(self, index: int, out: CompletionOutput, finished: bool) -> None:
        now = time.monotonic()
        metrics = self.ctx.metrics
        count = len(out.token_ids)
        if count:
            metrics.generation_tokens.inc(count)
            if self.tokens[index] == 0:
                metrics.time_to_first_token.observe(now - self.arrival)
            else:
                metrics.inter_token_latency.observe(now - self._last[index])
            self.tokens[index] += count
            self._last[index] = now
        if finished:
            metrics.e2e_request_latency.observe(now - self.arrival)

    def usage(self) -> UsageInfo:
        completion = sum(self.tokens)
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
            total_tokens=self.num_prompt_tokens + completion,
        )  # fmt: skip

    def close(self) -> None:
        """The reader is done (or gone): abort what has not finished, freeing its KV blocks."""
        if not self.stream.finished:
            self.ctx.engine.abort(self.stream)


async def _until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, run: _Run, work: Callable[[], Any]) -> Any:
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


def _sse(data: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    body = data.model_dump_json(exclude=exclude) if isinstance(data, BaseModel) else _json(data)
    return f"data: {body}\n\n"


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, ensure_ascii=False)


_DONE = "data: [DONE]\n\n"


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _ranked(position: dict[int, Logprob], top: int) -> list[Logprob]:
    """The `top` likeliest tokens at a position, by rank (the sampled one among them when it is)."""
    return sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= top),
                  key=lambda lp: lp.rank or 0)  # fmt: skip


def _completion_logprobs(out: CompletionOutput, top: int, offset: int) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for token_id, position in zip(out.token_ids, out.logprobs or [], strict=True):
        chosen = position[token_id]
        text = chosen.decoded_token or ""
        result.tokens.append(text)
        result.token_logprobs.append(_clamp(chosen.logprob))
        result.text_offset.append(offset)
        offset += len(text)
        entries = [chosen, *(lp for lp in _ranked(position, top) if lp is not chosen)]
        result.top_logprobs.append({lp.decoded_token or "": _clamp(lp.logprob) for lp in entries})
    return result


def _chat_logprobs(out: CompletionOutput, top: int) -> ChatLogprobs:
    def entry(lp: Logprob) -> TopLogprob:
        text = lp.decoded_token or ""
        return TopLogprob(token=text, logprob=_clamp(lp.logprob), bytes=list(text.encode("utf-8")))

    content = []
    for token_id, position in zip(out.token_ids, out.logprobs or [], strict=True):
        chosen = entry(position[token_id])
        ranked = [entry(lp) for lp in _ranked(position, top)]
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=ranked))
    return ChatLogprobs(content=content)


def _error_event(exc: BaseException) -> str:
    """A failure after the stream began (the status line is sent): an event with OpenAI's error body,
    which the openai client raises as an APIError."""
    return _sse(ErrorResponse(error=_failure(exc).info).model_dump())


# ------------------------------------------------------------------------------------------- the app


def build_app(
    engine: AsyncLLMEngine,
    tokenizer: Any,
    *,
    model_name: str,
    api_key: str | None = None,
    on_ready: Callable[[], None] | None = None,
) -> tuple[FastAPI, Callable[[], None]]:
    """The FastAPI app serving `engine` (started by the caller) under `model_name`. `tokenizer`: the front
    end's own (the engine thread decodes with the engine's). Returns the app and a function that puts it
    in drain mode (new generation requests get 503, /health 503), for the SIGTERM handler."""
    max_model_len = engine.engine.config.model.max_model_len
    ctx = _Context(
        engine=engine, tokenizer=tokenizer, model_name=model_name, max_model_len=max_model_len,
        api_key=api_key, metrics=ServerMetrics(model_name, lambda: engine.stats),
    )  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if on_ready is not None:
            on_ready()
        yield

    app = FastAPI(title="tp_runtime", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_json(exc.status, exc.info)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors())
        return _error_json(400, ErrorInfo(message=message, type="invalid_request_error", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_json(exc.status_code, ErrorInfo(message=str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s", request.url.path)
        info = ErrorInfo(
            message=f"internal error: {type(exc).__name__}: {exc}", type="server_error", code=500
        )
        return _error_json(500, info)

    async def authorize(request: Request) -> None:
        if ctx.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), ctx.api_key.encode()
        ):
            raise APIError(
                401, "Incorrect or missing API key: send `Authorization: Bearer <key>` with the server's "
                "--api-key", code="invalid_api_key",
            )  # fmt: skip

    @app.get("/health")
    async def health() -> Response:
        ctx.check_available()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> ModelList:
        return ModelList(
            data=[ModelCard(id=model_name, created=int(time.time()), max_model_len=max_model_len)]
        )

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        ctx.check_available()
        ctx.check_model(body.model)
        prompts = ctx.completion_prompts(body.prompt)
        stream = ctx.submit(body, prompts, body.max_tokens, "max_tokens", body.logprobs)
        run = _Run(ctx, stream, len(prompts) * body.n, sum(map(len, prompts)), arrival)
        if body.stream:
            return _event_stream(_completion_events(run, body))
        response = await _unless_disconnected(request, run, lambda: _completion_response(run, body))
        return Response(status_code=499) if response is None else JSONResponse(response.model_dump())

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        ctx.check_available()
        ctx.check_model(body.model)
        ids = ctx.chat_prompt(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise _bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        stream = ctx.submit(body, [ids], max_tokens, param, logprobs)
        run = _Run(ctx, stream, body.n, len(ids), arrival)
        if body.stream:
            return _event_stream(_chat_events(run, body))
        response = await _unless_disconnected(request, run, lambda: _chat_response(run, body))
        return Response(status_code=499) if response is None else JSONResponse(response.model_dump())

    def begin_drain() -> None:
        ctx.draining = True

    return app, begin_drain


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    # No proxy buffering: each event goes out as it is made.
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


def _wants_usage(body: SamplingFields) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


async def _completion_response(run: _Run, body: CompletionRequest) -> CompletionResponse:
    num = len(run.tokens)
    texts = [""] * num
    logprobs = [CompletionLogprobs() if body.logprobs is not None else None for _ in range(num)]
    reasons: list[tuple[str | None, int | str | None]] = [(None, None)] * num
    try:
        async for index, out in run.stream:
            c = out.outputs[0]
            run.observe(index, c, out.finished)
            lp = logprobs[index]
            if lp is not None and c.logprobs:
                more = _completion_logprobs(c, body.logprobs or 0, len(texts[index]))
                for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                    getattr(lp, name).extend(getattr(more, name))
            texts[index] += c.text
            if out.finished:
                reasons[index] = (c.finish_reason, c.stop_reason)
    except TPRuntimeError as exc:  # the engine died under the request
        raise _failure(exc) from None
    choices = [
        CompletionChoice(index=i, text=texts[i], logprobs=logprobs[i], finish_reason=reasons[i][0],
                         stop_reason=reasons[i][1])
        for i in range(num)
    ]  # fmt: skip
    return CompletionResponse(
        id=f"cmpl-{uuid.uuid4().hex}", created=run.created, model=run.ctx.model_name, choices=choices,
        usage=run.usage(),
    )  # fmt: skip


async def _completion_events(run: _Run, body: CompletionRequest) -> AsyncIterator[str]:
    ident = f"cmpl-{uuid.uuid4().hex}"
    with_usage = _wants_usage(body)

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        # With include_usage every chunk carries "usage" (null but in the last), else none does.
        response = CompletionResponse(
            id=ident, created=run.created, model=run.ctx.model_name, choices=choices, usage=usage
        )
        return _sse(response, exclude=None if with_usage else {"usage"})

    offsets = [0] * len(run.tokens)
    try:
        async for index, out in run.stream:
            c = out.outputs[0]
            run.observe(index, c, out.finished)
            if not (c.text or out.finished or (c.logprobs and body.logprobs is not None)):
                continue  # the token's text is held back (an incomplete character, a possible stop string)
            logprobs = None
            if body.logprobs is not None:
                logprobs = _completion_logprobs(c, body.logprobs, offsets[index])
            offsets[index] += len(c.text)
            choice = CompletionChoice(
                index=index, text=c.text, logprobs=logprobs,
                finish_reason=c.finish_reason if out.finished else None,
                stop_reason=c.stop_reason if out.finished else None,
            )  # fmt: skip
            yield chunk([choice])
        if with_usage:
            yield chunk([], run.usage())
    except Exception as exc:  # the engine died mid-stream (or a bug): say so in the stream
        yield _error_event(exc)
    finally:
        run.close()
    yield _DONE


async def _chat_response(run: _Run, body: ChatCompletionRequest) -> ChatCompletionResponse:
    num = len(run.tokens)
    texts = [""] * num
    logprobs = [ChatLogprobs(content=[]) if body.logprobs else None for _ in range(num)]
    reasons: list[tuple[str | None, int | str | None]] = [(None, None)] * num
    try:
        async for index, out in run.stream:
            c = out.outputs[0]
            run.observe(index, c, out.finished)
            lp = logprobs[index]
            if lp is not None and lp.content is not None and c.logprobs:
                lp.content.extend(_chat_logprobs(c, body.top_logprobs or 0).content or [])
            texts[index] += c.text
            if out.finished:
                reasons[index] = (c.finish_reason, c.stop_reason)
    except TPRuntimeError as exc:  # the engine died under the request
        raise _failure(exc) from None
    choices = [
        ChatChoice(index=i, message=ChatResponseMessage(content=texts[i]), logprobs=logprobs[i],
                   finish_reason=reasons[i][0], stop_reason=reasons[i][1])
        for i in range(num)
    ]  # fmt: skip
    return ChatCompletionResponse(
        id=f"chatcmpl-{uuid.uuid4().hex}", created=run.created, model=run.ctx.model_name, choices=choices,
        usage=run.usage(),
    )  # fmt: skip


async def _chat_events(run: _Run, body: ChatCompletionRequest) -> AsyncIterator[str]:
    ident = f"chatcmpl-{uuid.uuid4().hex}"
    with_usage = _wants_usage(body)

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        # With include_usage every chunk carries "usage" (null but in the last), else none does.
        response = ChatCompletionChunk(
            id=ident, created=run.created, model=run.ctx.model_name, choices=choices, usage=usage
        )
        return _sse(response, exclude=None if with_usage else {"usage"})

    try:
        for index in range(len(run.tokens)):  # each choice opens with the role, as OpenAI's streams do
            opening = DeltaMessage(role="assistant", content="")
            yield chunk([ChatStreamChoice(index=index, delta=opening, logprobs=None, finish_reason=None)])
        async for index, out in run.stream:
            c = out.outputs[0]
            run.observe(index, c, out.finished)
            if not (c.text or out.finished or (c.logprobs and body.logprobs)):
                continue  # the token's text is held back (an incomplete character, a possible stop string)
            logprobs = _chat_logprobs(c, body.top_logprobs or 0) if body.logprobs else None
            delta = DeltaMessage(content=c.text) if c.text else DeltaMessage()
            yield chunk([ChatStreamChoice(
                index=index, delta=delta, logprobs=logprobs,
                finish_reason=c.finish_reason if out.finished else None,
                stop_reason=c.stop_reason if out.finished else None,
            )])  # fmt: skip
        if with_usage:
            yield chunk([], run.usage())
    except Exception as exc:  # the engine died mid-stream (or a bug): say so in the stream
        yield _error_event(exc)
    finally:
        run.close()
    yield _DONE


# ------------------------------------------------------------------------------------------- running


def _listen(host: str, port: int) -> socket.socket:
    """Bind and listen before the model loads, so a taken port fails at once; port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _DrainingServer(uvicorn.Server):
    """uvicorn's Server, which also puts the app in drain mode when a shutdown signal arrives (uvicorn
    itself stops accepting connections and waits for those open, up to timeout_graceful_shutdown)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._on_signal()
        super().handle_exit(sig, frame)


def run_server(args: argparse.Namespace) -> None:
    """Start the engine from the command line's engine options, serve until SIGTERM / Ctrl-C, drain, and
    shut the workers down. Under torchrun this is rank 0's part; the other ranks serve as its workers
    (`tp_runtime.cli.serve_torchrun_rank`)."""
    import transformers

    from tp_runtime.engine.args import build_llm
    from tp_runtime.server.cli import API_KEY_ENV

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None

    sock = _listen(args.host, args.port)
    try:
        llm = build_llm(args)
        engine = AsyncLLMEngine(llm.engine, shutdown_engine=llm.shutdown)
        try:
            config = llm.engine.config
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(config.model.path))
            model_name = args.served_model_name or _model_name(args.model)
            host, port = sock.getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            if api_key is None and not ipaddress.ip_address(host).is_loopback:
                print(
                    f"tp-runtime serve: warning: listening on {host}, reachable from other machines, without "
                    f"an API key; set --api-key (or ${API_KEY_ENV}) unless the network is yours alone",
                    file=sys.stderr, flush=True,
                )  # fmt: skip

            def ready() -> None:
                print(
                    f"tp-runtime serve: ready on http://{shown}:{port} (model {model_name}, TP "
                    f"{config.parallel.tensor_parallel_size}, max_model_len {config.model.max_model_len})",
                    flush=True,
                )

            app, begin_drain = build_app(engine, tokenizer, model_name=model_name, api_key=api_key,
                                         on_ready=ready)  # fmt: skip
            uv_config = uvicorn.Config(
                app, host=host, port=port, log_level=args.log_level, access_log=args.access_log,
                timeout_graceful_shutdown=args.shutdown_grace, ws="none", lifespan="on",
            )  # fmt: skip
            engine.start()
            with _sigterm_ends_cleanly():
                _DrainingServer(uv_config, begin_drain).run(sockets=[sock])
        finally:
            # What the grace period cut off is still in the engine: abort it, then stop the workers.
            engine.shutdown(grace_s=0.0)
        print("tp-runtime serve: shut down", flush=True)
    finally:
        sock.close()


def _model_name(model: str | None) -> str:
    """What --model names: the value given, else the default model (its fallback without its package)."""
    if model is not None:
        return str(model)
    from tp_runtime.models_catalog import DEFAULT_MODEL, FALLBACK_MODEL, smollm2_available

    return DEFAULT_MODEL if smollm2_available() else FALLBACK_MODEL


@contextlib.contextmanager
def _sigterm_ends_cleanly() -> Iterator[None]:
    """uvicorn handles SIGTERM by draining, then re-raises it to the handler it found, by default the one
    that kills the process; a drained server exits normally instead (status 0)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
