"""`tp-runtime bench serve`: a load generator for a running OpenAI-compatible server (`tp-runtime serve`, or
any server with the same API), in the spirit of vLLM's benchmark_serving.

It sends --num-prompts streaming requests to --base-url + --endpoint, arriving as a Poisson process at
--request-rate requests/s (inf: all at once), with at most --max-concurrency in flight when given (so
`--max-concurrency C` alone runs a fixed concurrency of C). Each request streams (`stream: true`,
`stream_options.include_usage`) and is timed chunk by chunk.

Prompts (/v1/completions) are lists of random token ids drawn uniformly from [3, --vocab-size), so the
prompt is exactly --input-len tokens; /v1/chat/completions takes text, so there the prompt is --input-len
random words and its token count is what the server reports in `usage`. With --range-ratio r each
request's input and output length is drawn uniformly from [len·(1-r), len·(1+r)]. Every request asks
for `max_tokens` = its output length and, unless --no-ignore-eos, also sends `"ignore_eos": true` and
`"min_tokens"` = its output length (vLLM's extra fields): the output has exactly that length only when
the server honors them. The benchmark never assumes it: the output tokens counted are `usage`'s
completion_tokens (else the number of chunks that carried a token), and the report says how many requests
came back shorter or longer than asked.

Arrivals: request 0 is sent at t=0 and the gaps between requests are
`numpy.random.default_rng(seed).exponential(1 / request_rate, num_prompts - 1)`; the prompts and lengths
come from `numpy.random.default_rng([seed, 1])`.

Metrics, per successful request (times from the moment the request is sent, after any wait for a concurrency
slot): TTFT, the first chunk that carries a token; E2E latency, the last such chunk (as vLLM's benchmark);
ITL, the gaps between consecutive such chunks. A chunk carries a token when it has text, or when its text is
empty before the end (a server that streams every token, as vLLM's and this project's do, while it holds
back an incomplete character); chat's opening role chunk carries none, and a last chunk with no text one
only when `usage` counts exactly one token more than the chunks before it (a last token whose text is empty,
such as a stop token, in a stream of a chunk a token); else it is OpenAI's end mark (a server that sends
several tokens a chunk cannot say which chunk carried one). TPOT = (E2E - TTFT) / (output tokens - 1),
undefined for a one-token output. Throughputs divide by the benchmark's duration, from the first request
sent to the last one finished. A request fails on an HTTP error status, a connection error or timeout, an
`error` object in the stream, a stream that ends without `data: [DONE]`, or no token at all; failures are
counted with their messages and left out of every latency figure.

--output-json writes one object: `config` (every setting, the resolved model and URL), `summary`
(completed, failed, duration_s, total_input_tokens, total_output_tokens, request_throughput,
output_throughput, total_token_throughput, output_len_mismatch, and mean/median/p90/p99 of ttft, tpot,
itl and e2el in ms: mean_ttft_ms, median_ttft_ms, p90_ttft_ms, p99_ttft_ms, ...; null where there is no
sample), `errors` (distinct messages with counts) and `requests` (one record per request: index,
prompt_len, output_len, scheduled_s, sent_s, end_s, success, error, http_status, output_tokens,
output_tokens_source ("usage" or "chunks"), prompt_tokens, token_times_s, ttft_ms, tpot_ms, e2el_ms,
itl_ms; times in s from the benchmark's start).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, NoReturn
from urllib.parse import urlsplit

import numpy as np

from tp_runtime.bench import write_json
from tp_runtime.bench.serve_metrics import RequestRecord, error_counts, format_report, record_json, summarize
from tp_runtime.errors import ConfigError, TPRuntimeError

PROG = "tp-runtime"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
COMPLETIONS = "completions"
CHAT = "chat"
FIRST_TOKEN_ID = 3  # prompt ids come from [3, vocab): the usual pad/BOS/EOS ids stay out, as in bench latency
_WORDS = (
    "time", "person", "year", "way", "day", "thing", "world", "life", "hand", "part", "child", "eye",
    "place", "work", "week", "case", "point", "number", "group", "problem", "fact", "water", "room",
    "area", "money", "story", "month", "right", "study", "book", "word", "business", "issue", "side",
    "kind", "head", "house", "service", "friend", "power", "hour", "game", "line", "end", "member", "law",
    "car", "city", "name", "team", "minute", "idea", "body", "back", "face", "level", "office", "door",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", default=None,
        help=f"the server: http(s)://host:port, no path (default: {DEFAULT_BASE_URL})",
    )  # fmt: skip
    parser.add_argument(
        "--host", default=None,
        help="vLLM's way to name the server: http://HOST:PORT, with --port (default: 127.0.0.1)",
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=None, help="the server's port (default: 8000)")
    parser.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="path of the API to load: /v1/completions (token-id prompts) or /v1/chat/completions",
    )
    parser.add_argument(
        "--api-key", default=None, help="sent as `Authorization: Bearer KEY` (default: no header)"
    )
    parser.add_argument(
        "--model",
        dest="served_model",  # not `model`: the CLI treats args.model as an engine to load
        metavar="MODEL",
        default=None,
        help="model name sent in each request (default: the first id that GET /v1/models lists)",
    )
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, arriving as a Poisson process; inf sends them all at once",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most this many requests in flight; alone (with the default --request-rate inf) it runs "
        "a fixed concurrency (default: no limit)",
    )
    add_dataset_argument(parser)
    parser.add_argument(
        "--input-len", "--random-input-len", type=int, default=128, help="prompt tokens per request"
    )
    add_prefix_arguments(parser)
    parser.add_argument(
        "--output-len", "--random-output-len", type=int, default=128, help="output tokens asked per request"
    )
    parser.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="draw each length uniformly from [len*(1-r), len*(1+r)]; 0 keeps them fixed",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=1000,
        help="prompt token ids are drawn from [3, vocab-size); keep it at most the model's vocabulary "
        "(tiny-llama-tp: 1000)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths and arrivals")
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help='send "ignore_eos": true and "min_tokens" = output length, so a server that honors them '
        "returns exactly the asked length",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument(
        "--num-warmups", type=int, default=0, help="requests sent one by one first, not measured"
    )
    parser.add_argument(
        "--multi-turn",
        type=int,
        default=1,
        metavar="TURNS",
        help="chat conversations of this many turns: each of --num-prompts conversations starts at its "
        "arrival time and sends its turns one after another, each a new user message of --input-len words "
        "after the conversation so far (its earlier messages and the replies); the report gives each "
        "turn's TTFT and prefix-cache share (chat endpoint only)",
    )
    parser.add_argument(
        "--passes",
        type=int,
        default=1,
        help="send the workload this many times back to back, each pass measured and reported on its own: "
        "on a fresh server the first pass is its cold start, the later ones its steady state (each pass has "
        "the same lengths, arrivals and shared prefixes, and prompts of its own, so no pass is served "
        "from the prefix cache of another)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds to wait to connect, and between two chunks of a stream, before failing a request",
    )
    parser.add_argument(
        "--output-json",
        default=None,
        help="also write the config, the summary and every request's record here (default: no file)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def add_dataset_argument(parser: argparse.ArgumentParser) -> None:
    """vLLM's --dataset-name, for its commands to run as written: the one workload here is its `random`
    (random token ids of the lengths the flags give; vLLM's --random-* names are aliases of them)."""
    parser.add_argument(
        "--dataset-name", choices=("random",), default="random",
        help="the workload: random token ids of --input-len/--output-len tokens (vLLM's random dataset)",
    )  # fmt: skip


def add_prefix_arguments(parser: argparse.ArgumentParser) -> None:
    """The shared-prefix workload's flags (bench serve and bench throughput)."""
    parser.add_argument(
        "--prefix-len", "--random-prefix-len", type=int, default=0,
        help="tokens of a prefix shared by requests, before each one's --input-len own tokens (0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--num-prefixes", type=int, default=1, help="distinct shared prefixes, request i taking prefix i %% N"
    )


def check_prefix_arguments(args: argparse.Namespace) -> None:
    if args.prefix_len < 0:
        _bad("--prefix-len", "at least 0", args.prefix_len)
    if args.num_prefixes < 1:
        _bad("--num-prefixes", "at least 1", args.num_prefixes)


def _bad(flag: str, want: str, value: Any) -> NoReturn:
    raise ConfigError(f"argument {flag}: must be {want}, got {value}")


def check(args: argparse.Namespace) -> None:
    """Every flag's check, before anything is sent; raises ConfigError naming the flag (the CLI prints it
    as one line, `tp-runtime: error: ...`)."""
    if args.num_prompts < 1:
        _bad("--num-prompts", "at least 1", args.num_prompts)
    rate = args.request_rate
    if not rate > 0:  # NaN fails too; inf is allowed
        _bad("--request-rate", "more than 0 requests/s (or inf: all at once)", rate)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        _bad("--max-concurrency", "at least 1 (or left out: no limit)", args.max_concurrency)
    if args.input_len < 1:
        _bad("--input-len", "at least 1", args.input_len)
    if args.output_len < 1:
        _bad("--output-len", "at least 1", args.output_len)
    check_prefix_arguments(args)
    if not 0.0 <= args.range_ratio < 1.0:
        _bad("--range-ratio", "in [0, 1)", args.range_ratio)
    if args.vocab_size <= FIRST_TOKEN_ID:
        _bad("--vocab-size", f"at least {FIRST_TOKEN_ID + 1} (ids are drawn from [3, vocab-size))",
             args.vocab_size)  # fmt: skip
    if args.seed < 0:
        _bad("--seed", "at least 0", args.seed)
    if not args.temperature >= 0.0 or math.isinf(args.temperature):
        _bad("--temperature", "a finite number at least 0", args.temperature)
    if args.num_warmups < 0:
        _bad("--num-warmups", "at least 0", args.num_warmups)
    if args.passes < 1:
        _bad("--passes", "at least 1", args.passes)
    if args.multi_turn < 1:
        _bad("--multi-turn", "at least 1", args.multi_turn)
    if args.multi_turn > 1 and endpoint_kind(args.endpoint) != CHAT:
        _bad("--multi-turn", "1 unless --endpoint is /v1/chat/completions (a conversation is chat)",
             args.multi_turn)  # fmt: skip
    if not 0.0 < args.request_timeout < math.inf:
        _bad("--request-timeout", "a finite number of seconds more than 0", args.request_timeout)
    if args.api_key is not None and not args.api_key.strip():
        _bad("--api-key", "a non-empty key (or left out)", repr(args.api_key))
    if args.served_model is not None and not args.served_model.strip():
        _bad("--model", "a non-empty name (or left out: the first model the server lists)",
             repr(args.served_model))  # fmt: skip
    if args.host is not None or args.port is not None:
        if args.base_url is not None:
            flag, value = ("--host", args.host) if args.host is not None else ("--port", args.port)
            _bad(flag, "left out beside --base-url (name the server one way)", value)
        if args.host is not None and not args.host.strip():
            _bad("--host", "a host name or address", repr(args.host))
        if args.port is not None and not 0 <= args.port <= 65535:
            _bad("--port", "in [0, 65535]", args.port)
        host = "127.0.0.1" if args.host is None else args.host
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # an IPv6 address
        args.base_url = f"http://{host}:{8000 if args.port is None else args.port}"
    elif args.base_url is None:
        args.base_url = DEFAULT_BASE_URL
    try:
        parts = urlsplit(args.base_url)
    except ValueError:  # an unclosed "[" of an IPv6 host: urlsplit raises rather than returning parts
        _bad("--base-url", "http(s)://host[:port] with no path, e.g. http://127.0.0.1:8000", args.base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") or parts.query:
        _bad("--base-url", "http(s)://host[:port] with no path, e.g. http://127.0.0.1:8000", args.base_url)
    try:
        parts.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError:
        _bad("--base-url", "http(s)://host[:port] with a port in [0, 65535]", args.base_url)
    endpoint_kind(args.endpoint)
    if args.output_json:
        from tp_runtime.cli import check_output_json

        check_output_json(args.output_json)


def endpoint_kind(endpoint: str) -> str:
    """`completions` or `chat` for an --endpoint path; ConfigError otherwise."""
    if endpoint.startswith("/") and "?" not in endpoint:
        path = endpoint.rstrip("/")
        if path.endswith("/chat/completions"):
            return CHAT
        if path.endswith("/completions"):
            return COMPLETIONS
    _bad("--endpoint", "a path ending in /completions or /chat/completions, e.g. /v1/completions", endpoint)


# ---------------------------------------------------------------------------------------------------------
# Workload: lengths, prompts, arrivals (pure)
# ---------------------------------------------------------------------------------------------------------


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive range a length is drawn from: [len·(1-r), len·(1+r)], at least 1."""
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.floor(length * (1.0 + range_ratio)))
    return low, high


@dataclass
class Workload:
    prompts: list[list[int] | str]  # token ids (completions) or text (chat)
    prompt_lens: list[int]  # tokens asked for (words, for chat)
    output_lens: list[int]


def make_workload(
    num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int, kind: str,
    prefix_len: int = 0, num_prefixes: int = 1, pass_number: int = 1, output_range_ratio: float | None = None,
) -> Workload:  # fmt: skip
    """`num` requests of random tokens (or words, for chat). With `prefix_len`, request i starts with shared
    prefix i % num_prefixes (each `prefix_len` tokens) before its own `input_len` (vLLM's prefix-repetition
    workload); prompt_lens count both. Every `pass_number` has the same lengths and shared prefixes, and
    prompts of its own (a repeated prompt would be served from the prefix cache: a later pass would
    measure cache hits, not a steady state). `output_range_ratio` (default: `range_ratio`) draws the output
    lengths alone; the prompts do not depend on it."""
    rng = np.random.default_rng([seed, 1])
    in_low, in_high = length_bounds(input_len, range_ratio)
    out_low, out_high = length_bounds(output_len, range_ratio)
    input_lens = rng.integers(in_low, in_high + 1, size=num)
    output_lens = rng.integers(out_low, out_high + 1, size=num)
    if output_range_ratio is not None and output_range_ratio != range_ratio:
        # From a generator of their own, after the shared draw: the prompts stay those of range_ratio.
        out_low, out_high = length_bounds(output_len, output_range_ratio)
        output_lens = np.random.default_rng([seed, 2]).integers(out_low, out_high + 1, size=num)

    def draw(n: int, source: np.random.Generator = rng) -> list[int] | str:
        if kind == CHAT:
            return " ".join(_WORDS[i] for i in source.integers(0, len(_WORDS), size=n))
        return source.integers(FIRST_TOKEN_ID, vocab_size, size=n).tolist()

    prefixes = [draw(prefix_len) for _ in range(num_prefixes)] if prefix_len else []
    own_rng = rng if pass_number == 1 else np.random.default_rng([seed, 1, pass_number])
    prompts: list[list[int] | str] = []
    for i, n in enumerate(input_lens):
        own = draw(int(n), own_rng)
        if prefixes:
            prefix = prefixes[i % num_prefixes]
            own = f"{prefix} {own}" if isinstance(own, str) else [*prefix, *own]
        prompts.append(own)
    lens = [int(n) + prefix_len for n in input_lens]
    return Workload(prompts, lens, [int(n) for n in output_lens])


def arrival_schedule(num: int, request_rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of `num` requests: the first at 0, then Poisson arrivals at
    `request_rate` per second (exponential gaps from numpy.random.default_rng(seed)); all 0 for inf."""
    if math.isinf(request_rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


# ---------------------------------------------------------------------------------------------------------
# Sending
# ---------------------------------------------------------------------------------------------------------


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _exc_text(exc: BaseException) -> str:
    text = " ".join(str(exc).split())  # one line (aiohttp's messages span several)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _body_message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    text = body.decode("utf-8", "replace")
    try:
        data = json.loads(text)
        error = data.get("error", data) if isinstance(data, dict) else data
        message = error.get("message") if isinstance(error, dict) else None
        if message is None and isinstance(data, dict):
            message = data.get("detail")
        if message is not None:
            return str(message)
    except ValueError:
        pass
    text = " ".join(text.split())
    return text[:300] or "(empty body)"


def build_payload(
    kind: str, model: str, prompt: list[int] | str, output_len: int, temperature: float, ignore_eos: bool,
    history: list[dict[str, str]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One request's body; `history`: a chat's earlier messages, before this user message."""
    payload: dict[str, Any] = {"model": model}
    if kind == CHAT:
        payload["messages"] = [*(history or []), {"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    payload.update(
        max_tokens=output_len,
        temperature=temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    if ignore_eos:
        payload.update(ignore_eos=True, min_tokens=output_len)
    return payload


def _carries_token(choice: Any, kind: str, text: str) -> bool:
    """Whether a stream chunk's choice stands for generated tokens (see the module's doc)."""
    if not isinstance(choice, dict):
        return False
    if text:
        return True
    if kind == CHAT:
        delta = choice.get("delta")
        if not isinstance(delta, dict) or "role" in delta:
            return False
    elif "text" not in choice:
        return False
    return choice.get("finish_reason") is None


def _chunk_text(choice: Any, kind: str) -> str:
    if not isinstance(choice, dict):
        return ""
    if kind == CHAT:
        delta = choice.get("delta") or {}
        text = delta.get("content") if isinstance(delta, dict) else None
    else:
        text = choice.get("text")
    return text if isinstance(text, str) else ""


_LINE_END = re.compile(rb"\r\n|\r|\n")  # the three line ends server-sent events allow


async def _sse_data(resp: Any, t0: float) -> AsyncIterator[tuple[float, bytes]]:
    """The `data:` fields of a server-sent event stream, each with the time (from t0) its read arrived.
    Lines are split from the raw bytes, so a line (or a character) cut between two reads is read whole; a
    last line without its line end counts too."""
    pending = b""
    now = time.perf_counter() - t0
    async for piece in resp.content.iter_any():
        now = time.perf_counter() - t0
        *lines, pending = _LINE_END.split(pending + piece)
        for raw in lines:
            line = raw.strip()
            if line.startswith(b"data:"):  # not blank lines, comments, event:/id:/retry: fields
                yield now, line[len(b"data:") :].strip()
    last = pending.strip()
    if last.startswith(b"data:"):
        yield now, last[len(b"data:") :].strip()


async def send_request(
    session: Any, url: str, headers: dict[str, str], payload: dict[str, Any], kind: str,
    rec: RequestRecord, t0: float, request_timeout: float,
) -> None:  # fmt: skip
    """POST one streaming request and fill `rec` (never raises, but for cancellation). `request_timeout`
    bounds the sending and the wait for the response's headers, then each wait for a chunk."""
    import aiohttp

    rec.sent_s = time.perf_counter() - t0
    try:
        # Redirects are not followed (a redirect is an answer to report, not part of the request); aiohttp's
        # read timeout only starts once the body is sent, so the sending is bounded here.
        request = session.post(url, json=payload, headers=headers, allow_redirects=False)
        resp = await asyncio.wait_for(request, request_timeout)
        async with resp:
            rec.http_status = resp.status
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {_body_message(await resp.read())}"
                return
            done = False
            finish_s: float | None = None
            async for now, data in _sse_data(resp, t0):
                if data == b"[DONE]":
                    done = True
                    break
                # As a browser reads a stream: a byte that is not UTF-8 becomes U+FFFD.
                chunk = json.loads(data.decode("utf-8", "replace"))
                if not isinstance(chunk, dict):
                    raise ValueError(f"a chunk that is not a JSON object: {data[:100]!r}")
                if chunk.get("error") is not None:
                    rec.error = f"error in the stream: {_body_message(data)}"
                    return
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    if isinstance(usage.get("completion_tokens"), int):
                        rec.usage_output_tokens = usage["completion_tokens"]
                    if isinstance(usage.get("prompt_tokens"), int):
                        rec.prompt_tokens = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                        rec.cached_tokens = details["cached_tokens"]
                choices = chunk.get("choices") or []
                text = _chunk_text(choices[0], kind) if choices else ""
                if choices and _carries_token(choices[0], kind, text):
                    rec.token_times_s.append(now)
                elif choices and isinstance(choices[0], dict) and choices[0].get("finish_reason") is not None:
                    finish_s = now  # a last chunk with no text: a token (usage tells), or OpenAI's end mark
                if text:
                    rec.text_parts.append(text)
            # The last token's text may be empty (an EOS or stop token, a stop string cut off): when usage
            # counts one token more than the chunks did, the finish chunk carried it. (With several tokens
            # a chunk usage counts more: an end mark after them is no token's arrival.)
            usage_tokens = rec.usage_output_tokens
            if finish_s is not None and usage_tokens == len(rec.token_times_s) + 1:
                rec.token_times_s.append(finish_s)
            if not done:
                rec.error = "broken stream: it ended without `data: [DONE]`"
            elif not rec.token_times_s:
                rec.error = "the stream carried no token"
            else:
                rec.success = True
    except asyncio.TimeoutError as exc:  # aiohttp's connect and read timeouts are TimeoutErrors
        rec.error = f"timed out (--request-timeout): {_exc_text(exc)}"
    except aiohttp.ClientError as exc:
        rec.error = f"broken stream or connection: {_exc_text(exc)}"
    except ValueError as exc:  # json.JSONDecodeError
        rec.error = f"bad chunk: {_exc_text(exc)}"
    finally:
        rec.end_s = time.perf_counter() - t0


def _session(args: argparse.Namespace, *, max_connections: int | None = None) -> Any:
    """aiohttp, as vLLM's benchmark: its per-chunk cost is a fraction of httpx's, and a load generator's
    own latency lands in every figure it reports (httpx added ~3 ms to the mean TTFT of 24 streams a
    second on the development machine)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, connect=args.request_timeout, sock_read=args.request_timeout)
    # trust_env=False: no proxy from the environment between the benchmark and the server.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections or 0), timeout=timeout, trust_env=False
    )


async def _models(args: argparse.Namespace, url: str) -> tuple[int, bytes]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=min(args.request_timeout, 30.0))
    async with (
        aiohttp.ClientSession(timeout=timeout, trust_env=False) as session,
        session.get(url, headers=_headers(args.api_key), allow_redirects=False) as resp,
    ):
        return resp.status, await resp.read()


def resolve_model(args: argparse.Namespace) -> str:
    """Check that the server answers, and return --model or the first model it lists. One-line
    ConfigError when it cannot be reached, refuses the key, or lists no model."""
    import aiohttp

    base = args.base_url.rstrip("/")
    url = base + "/v1/models"
    try:
        status, content = asyncio.run(_models(args, url))
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise ConfigError(
            f"cannot reach the server at {base} ({_exc_text(exc)}); start it (`tp-runtime serve --port "
            f"{urlsplit(base).port or 80} ...`) or pass its address with --base-url"
        ) from None
    if status in (401, 403):
        raise ConfigError(
            f"the server at {base} refused GET /v1/models (HTTP {status}: "
            f"{_body_message(content)}); pass its key with --api-key"
        )
    if args.served_model:
        return str(args.served_model)
    try:
        if status != 200:
            raise ValueError(f"HTTP {status}: {_body_message(content)}")
        models = json.loads(content)["data"]
        return str(models[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ConfigError(
            f"GET {url} gave no model id ({_exc_text(exc)}); name the model with --model"
        ) from None


async def run_benchmark(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """Send the workload (`--passes` times) and return {config, summary, errors, requests, pass_results}."""
    kind = endpoint_kind(args.endpoint)
    url = args.base_url.rstrip("/") + args.endpoint
    headers = _headers(args.api_key)
    turns = args.multi_turn

    def workload(pass_number: int) -> Workload:  # pass 0: the warm-up requests' prompts
        # With --multi-turn, request c * turns + t is conversation c's turn t.
        return make_workload(
            args.num_prompts * turns, args.input_len, args.output_len, args.range_ratio, args.vocab_size,
            args.seed, kind, args.prefix_len, args.num_prefixes, pass_number,
        )  # fmt: skip

    work = workload(0)
    schedule = arrival_schedule(args.num_prompts, args.request_rate, args.seed)
    passes: list[tuple[list[RequestRecord], float, str]] = []
    async with _session(args, max_connections=args.max_concurrency) as session:
        for i in range(args.num_warmups):
            payload = build_payload(
                kind, model, work.prompts[i % len(work.prompts)], work.output_lens[i % len(work.prompts)],
                args.temperature, args.ignore_eos,
            )  # fmt: skip
            warm = RequestRecord(index=-1, prompt_len=0, output_len=0, scheduled_s=0.0)
            await send_request(
                session, url, headers, payload, kind, warm, time.perf_counter(), args.request_timeout
            )
            if not warm.success:
                raise ConfigError(
                    f"warmup request {i + 1} to {url} failed: {warm.error}; check --model, --endpoint "
                    "and the lengths"
                )
        for number in range(1, args.passes + 1):
            work = workload(number)
            records = [
                RequestRecord(index=i, prompt_len=work.prompt_lens[i], output_len=work.output_lens[i],
                              scheduled_s=schedule[i // turns], turn=i % turns)
                for i in range(args.num_prompts * turns)
            ]  # fmt: skip
            desc = "requests" if args.passes == 1 else f"pass {number}/{args.passes}"
            started_at = datetime.now(timezone.utc).isoformat()
            duration = await _timed_pass(args, session, url, headers, kind, model, work, records, desc)
            passes.append((records, duration, started_at))
    config = {
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "url": url,
        "endpoint_kind": kind,
        "model": model,
        "num_prompts": args.num_prompts,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "input_len": args.input_len,
        "prefix_len": args.prefix_len,
        "num_prefixes": args.num_prefixes,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "vocab_size": args.vocab_size,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "num_warmups": args.num_warmups,
        "passes": args.passes,
        "multi_turn": turns,
        "request_timeout": args.request_timeout,
        "api_key_set": args.api_key is not None,
        "started_at": passes[0][2],
    }
    measured = [
        {"pass": number, "started_at": started_at, "summary": summarize(records, duration),
         "errors": error_counts(records), "requests": [record_json(rec) for rec in records]}
        for number, (records, duration, started_at) in enumerate(passes, 1)
    ]  # fmt: skip
    return {
        "config": config,
        # The first pass's, as with one pass; every pass's are in "pass_results".
        "summary": measured[0]["summary"],
        "errors": measured[0]["errors"],
        "requests": measured[0]["requests"],
        "pass_results": measured,
    }


async def _timed_pass(
    args: argparse.Namespace, session: Any, url: str, headers: dict[str, str], kind: str, model: str,
    work: Any, records: list[RequestRecord], desc: str,
) -> float:  # fmt: skip
    """Send every request of `records` at its scheduled time; returns the pass's duration in seconds."""
    from tqdm.auto import tqdm

    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    progress = tqdm(total=len(records), desc=desc, disable=args.no_progress)

    async def one(rec: RequestRecord, history: list[dict[str, str]] | None = None) -> None:
        prompt = work.prompts[rec.index]
        payload = build_payload(
            kind, model, prompt, rec.output_len, args.temperature, args.ignore_eos, history
        )
        if limit is None:
            await send_request(session, url, headers, payload, kind, rec, t0, args.request_timeout)
        else:
            async with limit:
                await send_request(session, url, headers, payload, kind, rec, t0, args.request_timeout)
        progress.update(1)

    async def conversation(turns: list[RequestRecord]) -> None:
        """A conversation's turns in order, each after the last one's reply (a failed turn ends it)."""
        history: list[dict[str, str]] = []
        for rec in turns:
            rec.scheduled_s = time.perf_counter() - t0
            await one(rec, history)
            if not rec.success:
                for skipped in turns[rec.turn + 1 :]:
                    skipped.error = "not sent: an earlier turn of its conversation failed"
                progress.update(len(turns) - 1 - rec.turn)
                return
            history += [{"role": "user", "content": str(work.prompts[rec.index])},
                        {"role": "assistant", "content": "".join(rec.text_parts)}]  # fmt: skip

    per_conversation = max(rec.turn for rec in records) + 1 if records else 1
    t0 = time.perf_counter()
    tasks = []
    try:
        if per_conversation > 1:
            for start in range(0, len(records), per_conversation):
                first = records[start]
                while (delay := first.scheduled_s - (time.perf_counter() - t0)) > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(conversation(records[start : start + per_conversation])))
            await asyncio.gather(*tasks)
            return time.perf_counter() - t0
        for rec in records:
            # Re-check after waking: the event loop may wake a hair early; never send before schedule.
            while (delay := rec.scheduled_s - (time.perf_counter() - t0)) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(rec)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        progress.close()
    return time.perf_counter() - t0


def main(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed arguments: print the report, write --output-json. Returns 0; raises
    ConfigError on a bad argument or a server out of reach, TPRuntimeError when every request failed."""
    check(args)
    model = resolve_model(args)
    result = asyncio.run(run_benchmark(args, model))
    print(format_report(result), flush=True)
    if args.output_json:
        write_json(args.output_json, result)
    for measured in result["pass_results"]:
        if measured["summary"]["completed"] == 0:
            first = measured["errors"][0]
            which = "" if args.passes == 1 else f" of pass {measured['pass']}"
            raise TPRuntimeError(
                f"all {args.num_prompts} requests{which} failed; most common error ({first['count']}x): "
                f"{first['error']}"
            )
    return 0


# ---------------------------------------------------------------------------------------------------------
# python -m tp_runtime.bench.serve
# ---------------------------------------------------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.required:
            return action.help
        return super()._get_help_string(action)


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{PROG}: error: {message}; see `{self.prog} --help`", file=sys.stderr, flush=True)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog=f"{PROG} bench serve", description=__doc__, formatter_class=_HelpFormatter)
    add_arguments(parser)
    return parser


def cli(argv: list[str] | None = None) -> int:
    """Standalone entry point: errors are one line `tp-runtime: error: ...` with status 2, as in the CLI."""
    args = build_parser().parse_args(argv)
    try:
        return main(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        return 130
    except (ConfigError, TPRuntimeError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(cli())
