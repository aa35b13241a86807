"""`tp-runtime bench serve`: its metrics against a brute-force computation on synthetic timestamps, its
argument checks, and whole runs against a stub OpenAI-compatible streaming server (FastAPI + uvicorn in a
thread on a free loopback port) that counts the requests it has in flight.

No assertion here depends on how fast anything runs."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi import Request  # module level: the stub's handlers name it in string annotations

from tp_runtime.bench import serve, serve_metrics
from tp_runtime.bench.serve_metrics import RequestRecord
from tp_runtime.errors import ConfigError, TPRuntimeError

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------------------------


def _record(
    index: int, times: list[float], sent: float = 0.0, *, success: bool = True, usage: int | None = None,
    output_len: int | None = None, prompt_len: int = 4, prompt_tokens: int | None = None,
) -> RequestRecord:  # fmt: skip
    return RequestRecord(
        index=index, prompt_len=prompt_len,
        output_len=output_len if output_len is not None else (usage or len(times)),
        scheduled_s=sent, sent_s=sent, token_times_s=list(times), end_s=(times[-1] if times else sent),
        success=success, error=None if success else "boom", usage_output_tokens=usage,
        prompt_tokens=prompt_tokens,
    )  # fmt: skip


def _synthetic_records(seed: int) -> list[RequestRecord]:
    """Requests with random send times and chunk gaps: most succeed with one token per chunk, some have
    `usage` counts above their chunk counts, some one token, some failed (with chunk times anyway)."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(40):
        sent = float(rng.uniform(0, 5))
        n = int(rng.integers(1, 30)) if i % 7 else 1
        times = (sent + 0.05 + np.cumsum(rng.exponential(0.02, size=n))).tolist()
        kind = i % 5
        if kind == 0:
            records.append(_record(i, times, sent, success=False))
        elif kind == 1:
            records.append(_record(i, times, sent, usage=n + 3, prompt_tokens=11))
        elif kind == 2:
            records.append(_record(i, times, sent, output_len=n + 1))  # came back one token short
        else:
            records.append(_record(i, times, sent))
    return records


def test_request_metrics_brute_force() -> None:
    for rec in _synthetic_records(0):
        m = serve_metrics.request_metrics(rec)
        if not rec.success:
            assert m is None
            continue
        assert m is not None
        times, sent = rec.token_times_s, rec.sent_s
        assert sent is not None
        n = rec.usage_output_tokens if rec.usage_output_tokens is not None else len(times)
        assert m.ttft == pytest.approx(times[0] - sent)
        assert m.e2el == pytest.approx(times[-1] - sent)
        gaps = [times[k + 1] - times[k] for k in range(len(times) - 1)]
        assert m.itls == pytest.approx(gaps)
        if n == 1:
            assert m.tpot is None  # a one-token output has no TPOT
        else:
            # TPOT excludes the first token: the decode time after it, over the tokens after it.
            assert m.tpot == pytest.approx((times[-1] - times[0]) / (n - 1))
            if rec.usage_output_tokens is None:  # one token per chunk: TPOT is the mean ITL
                assert m.tpot == pytest.approx(float(np.mean(gaps)))


def test_request_metrics_one_token_and_failure() -> None:
    one = _record(0, [0.3], 0.1)
    m = serve_metrics.request_metrics(one)
    assert m is not None and m.tpot is None and m.itls == []
    assert m.ttft == pytest.approx(0.2) and m.e2el == pytest.approx(0.2)
    # One chunk that carried two tokens (usage says 2): TPOT = (E2E - TTFT) / 1 = 0, no ITL.
    m = serve_metrics.request_metrics(_record(1, [0.3], 0.1, usage=2))
    assert m is not None and m.tpot == pytest.approx(0.0) and m.itls == []
    assert serve_metrics.request_metrics(_record(2, [0.3, 0.4], 0.1, success=False)) is None


def _reference_stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(serve_metrics.STATS)
    ms = [v * 1e3 for v in values]
    return {
        "mean": sum(ms) / len(ms),
        "median": float(np.percentile(ms, 50)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
    }


def test_summarize_brute_force() -> None:
    records = _synthetic_records(1)
    duration = 7.5
    summary = serve_metrics.summarize(records, duration)
    ok = [r for r in records if r.success]
    ttft, tpot, itl, e2el = [], [], [], []
    total_in = total_out = mismatch = 0
    for r in ok:
        t, sent = r.token_times_s, r.sent_s
        assert sent is not None
        n = r.usage_output_tokens if r.usage_output_tokens is not None else len(t)
        ttft.append(t[0] - sent)
        e2el.append(t[-1] - sent)
        for k in range(1, len(t)):
            itl.append(t[k] - t[k - 1])
        if n > 1:
            tpot.append(((t[-1] - sent) - (t[0] - sent)) / (n - 1))
        total_in += r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len
        total_out += n
        mismatch += n != r.output_len
    assert summary["completed"] == len(ok) and summary["failed"] == len(records) - len(ok)
    assert summary["failed"] > 0 and mismatch > 0 and len(tpot) < len(ok)  # the cases are all there
    assert summary["total_input_tokens"] == total_in
    assert summary["total_output_tokens"] == total_out
    assert summary["output_len_mismatch"] == mismatch
    assert summary["request_throughput"] == pytest.approx(len(ok) / duration)
    assert summary["output_throughput"] == pytest.approx(total_out / duration)
    assert summary["total_token_throughput"] == pytest.approx((total_in + total_out) / duration)
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        for stat, want in _reference_stats(values).items():
            assert summary[f"{stat}_{name}_ms"] == pytest.approx(want), (stat, name)


def test_failed_requests_left_out_of_latency() -> None:
    good = _record(0, [0.1, 0.2, 0.3], 0.0)
    # A failed request with huge times must not move any figure.
    bad = _record(1, [50.0, 90.0, 200.0], 0.0, success=False)
    alone = serve_metrics.summarize([good], 1.0)
    both = serve_metrics.summarize([good, bad], 1.0)
    for metric in serve_metrics.METRICS:
        for stat in serve_metrics.STATS:
            key = f"{stat}_{metric}_ms"
            assert both[key] == alone[key], key
    assert both["failed"] == 1 and both["completed"] == 1
    assert both["total_output_tokens"] == alone["total_output_tokens"] == 3


def test_summary_without_samples() -> None:
    s = serve_metrics.summarize([_record(0, [0.5], 0.0)], 1.0)  # one token: no TPOT, no ITL
    assert s["mean_tpot_ms"] is None and s["p99_itl_ms"] is None
    assert s["mean_ttft_ms"] == pytest.approx(500.0)
    s = serve_metrics.summarize([_record(0, [0.5], 0.0, success=False)], 1.0)
    assert all(s[f"{st}_{m}_ms"] is None for st in serve_metrics.STATS for m in serve_metrics.METRICS)
    assert s["completed"] == 0 and s["request_throughput"] == 0.0
    text = serve_metrics.format_report({"config": _config(), "summary": s, "errors": [], "requests": []})
    assert "n/a" in text


def _config() -> dict[str, Any]:
    return {"model": "m", "endpoint": "/v1/completions", "request_rate": "inf", "max_concurrency": None}


def test_arrival_schedule_matches_numpy() -> None:
    for seed, rate, n in ((0, 4.0, 10), (123, 0.5, 50), (7, 1000.0, 2)):
        schedule = serve.arrival_schedule(n, rate, seed)
        want_gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n - 1)
        assert schedule[0] == 0.0 and len(schedule) == n
        np.testing.assert_allclose(np.diff(schedule), want_gaps, rtol=1e-12)
    assert serve.arrival_schedule(5, float("inf"), 0) == [0.0] * 5
    assert serve.arrival_schedule(1, 3.0, 0) == [0.0]


def test_workload_lengths_and_ids() -> None:
    fixed = serve.make_workload(20, 16, 8, 0.0, 50, 3, serve.COMPLETIONS)
    assert fixed.prompt_lens == [16] * 20 and fixed.output_lens == [8] * 20
    for prompt in fixed.prompts:
        assert isinstance(prompt, list) and len(prompt) == 16
        assert all(isinstance(t, int) and 3 <= t < 50 for t in prompt)
    ranged = serve.make_workload(200, 10, 20, 0.5, 1000, 3, serve.COMPLETIONS)
    assert set(ranged.prompt_lens) <= set(range(5, 16)) and len(set(ranged.prompt_lens)) > 3
    assert set(ranged.output_lens) <= set(range(10, 31)) and len(set(ranged.output_lens)) > 3
    assert [len(p) for p in ranged.prompts] == ranged.prompt_lens
    again = serve.make_workload(200, 10, 20, 0.5, 1000, 3, serve.COMPLETIONS)
    assert again.prompts == ranged.prompts and again.output_lens == ranged.output_lens
    other = serve.make_workload(200, 10, 20, 0.5, 1000, 4, serve.COMPLETIONS)
    assert other.prompts != ranged.prompts
    # A later pass: the same lengths and shared prefixes, prompts of its own (none a prefix-cache hit).
    first = serve.make_workload(50, 10, 20, 0.5, 1000, 3, serve.COMPLETIONS, 16, 2)
    second = serve.make_workload(50, 10, 20, 0.5, 1000, 3, serve.COMPLETIONS, 16, 2, pass_number=2)
    assert second.prompt_lens == first.prompt_lens and second.output_lens == first.output_lens
    for a, b in zip(first.prompts, second.prompts, strict=True):
        assert a[:16] == b[:16] and a[16:] != b[16:]
    # Output lengths drawn with a ratio of their own: the prompts are the same as with the shared ratio.
    fixed_out = serve.make_workload(200, 10, 20, 0.5, 1000, 3, serve.COMPLETIONS, output_range_ratio=0.0)
    assert fixed_out.output_lens == [20] * 200 and fixed_out.prompts == ranged.prompts
    wider = serve.make_workload(200, 10, 20, 0.0, 1000, 3, serve.COMPLETIONS, output_range_ratio=0.5)
    assert wider.prompt_lens == [10] * 200 and set(wider.output_lens) <= set(range(10, 31))
    assert len(set(wider.output_lens)) > 3
    chat = serve.make_workload(3, 12, 4, 0.0, 1000, 0, serve.CHAT)
    assert all(isinstance(p, str) and len(p.split()) == 12 for p in chat.prompts)
    assert serve.length_bounds(1, 0.9) == (1, 1)
    assert serve.length_bounds(100, 0.25) == (75, 125)


def test_payload() -> None:
    p = serve.build_payload(serve.COMPLETIONS, "m", [5, 6], 7, 0.0, True)
    assert p["prompt"] == [5, 6] and p["max_tokens"] == 7 and p["stream"] is True
    assert p["stream_options"] == {"include_usage": True}
    assert p["ignore_eos"] is True and p["min_tokens"] == 7
    p = serve.build_payload(serve.CHAT, "m", "hi there", 3, 0.5, False)
    assert p["messages"] == [{"role": "user", "content": "hi there"}]
    assert "ignore_eos" not in p and "min_tokens" not in p and p["temperature"] == 0.5


# ---------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    return serve.build_parser().parse_args(list(argv))


def test_defaults_pass_and_model_dest() -> None:
    args = _args()
    serve.check(args)
    assert args.base_url == "http://127.0.0.1:8000" and args.endpoint == "/v1/completions"
    assert args.request_rate == float("inf") and args.max_concurrency is None and args.ignore_eos
    # --model must not land in args.model: the tp-runtime CLI would load that as an engine model.
    assert not hasattr(_args("--model", "x"), "model") and _args("--model", "x").served_model == "x"
    for ok in (
        ["--request-rate", "2.5"], ["--max-concurrency", "1"], ["--range-ratio", "0.99"],
        ["--endpoint", "/v1/chat/completions"], ["--base-url", "https://example.com:8443/"],
        ["--no-ignore-eos"], ["--num-warmups", "0"], ["--vocab-size", "4"],
    ):  # fmt: skip
        serve.check(_args(*ok))


BAD = [
    (["--num-prompts", "0"], ["--num-prompts", "at least 1", "got 0"]),
    (["--request-rate", "0"], ["--request-rate", "more than 0"]),
    (["--request-rate", "-1"], ["--request-rate"]),
    (["--request-rate", "nan"], ["--request-rate", "nan"]),
    (["--max-concurrency", "0"], ["--max-concurrency", "at least 1"]),
    (["--input-len", "0"], ["--input-len", "at least 1"]),
    (["--output-len", "-3"], ["--output-len", "got -3"]),
    (["--range-ratio", "1"], ["--range-ratio", "[0, 1)"]),
    (["--range-ratio", "-0.1"], ["--range-ratio"]),
    (["--vocab-size", "3"], ["--vocab-size", "at least 4"]),
    (["--seed", "-1"], ["--seed", "at least 0"]),
    (["--temperature", "-0.5"], ["--temperature"]),
    (["--temperature", "inf"], ["--temperature"]),
    (["--num-warmups", "-1"], ["--num-warmups"]),
    (["--passes", "0"], ["--passes"]),
    (["--prefix-len", "-1"], ["--prefix-len"]),
    (["--num-prefixes", "0"], ["--num-prefixes"]),
    (["--request-timeout", "0"], ["--request-timeout"]),
    (["--request-timeout", "inf"], ["--request-timeout"]),
    (["--api-key", ""], ["--api-key"]),
    (["--model", " "], ["--model"]),
    (["--base-url", "127.0.0.1:8000"], ["--base-url", "http(s)://host"]),
    (["--base-url", "ftp://127.0.0.1"], ["--base-url"]),
    (["--base-url", "http://127.0.0.1:8000/v1"], ["--base-url", "no path"]),
    (["--base-url", "http://127.0.0.1:99999"], ["--base-url", "port"]),
    (["--endpoint", "v1/completions"], ["--endpoint", "/completions"]),
    (["--endpoint", "/v1/embeddings"], ["--endpoint"]),
    (["--output-json", "/no/such/folder/x.json"], ["--output-json", "does not exist"]),
    (["--host", "h", "--base-url", "http://h:1"], ["--host", "beside --base-url"]),
    (["--port", "99999"], ["--port", "[0, 65535]"]),
    (["--host", ""], ["--host", "host name"]),
]


def test_vllm_flag_spellings() -> None:
    """vLLM's `vllm bench serve` names: --host/--port, --dataset-name random and the --random-* lengths."""
    vllm = _args(
        "--host", "10.0.0.2", "--port", "8011", "--dataset-name", "random", "--random-input-len", "300",
        "--random-output-len", "40", "--random-range-ratio", "0.5", "--random-prefix-len", "64",
    )  # fmt: skip
    serve.check(vllm)
    ours = _args("--base-url", "http://10.0.0.2:8011", "--input-len", "300", "--output-len", "40",
                 "--range-ratio", "0.5", "--prefix-len", "64")  # fmt: skip
    serve.check(ours)
    assert vars(vllm) == {**vars(ours), "host": "10.0.0.2", "port": 8011}
    ipv6 = _args("--host", "::1")
    serve.check(ipv6)
    assert ipv6.base_url == "http://[::1]:8000"


@pytest.mark.parametrize(("argv", "fragments"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments(argv: list[str], fragments: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as info:
        serve.check(_args(*argv))
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    # The standalone entry point prints it as one line with status 2, before sending anything.
    assert serve.cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tp-runtime: error: argument ") and len(err.splitlines()) == 1, err


def test_argparse_error_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        serve.cli(["--num-prompts", "many"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tp-runtime: error: argument --num-prompts") and len(err.splitlines()) == 1


def _free_port() -> int:
    """A loopback port nothing listens on (bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_server_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()
    assert serve.cli(["--base-url", f"http://127.0.0.1:{port}", "--no-progress"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith(f"tp-runtime: error: cannot reach the server at http://127.0.0.1:{port}"), err
    assert len(err.splitlines()) == 1 and "--base-url" in err
    assert "Traceback" not in captured.out + captured.err


def test_module_entry_point_unreachable() -> None:
    """`python -m tp_runtime.bench.serve` on its own: one line, status 2, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    port = _free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "tp_runtime.bench.serve", "--base-url", f"http://127.0.0.1:{port}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2, output
    assert output.startswith("tp-runtime: error: cannot reach the server") and len(output.splitlines()) == 1


# ---------------------------------------------------------------------------------------------------------
# Whole runs against a stub server
# ---------------------------------------------------------------------------------------------------------


class Stub:
    """An OpenAI-compatible streaming server: one chunk per output token (`max_tokens` of them, or
    `tokens` when set: a server that ignores ignore_eos), then the usage chunk when asked (and
    `send_usage`), then `data: [DONE]`. Request k (in arrival order) answers HTTP 500 when
    `fail_every` divides k, breaks off after two chunks without [DONE] when `break_every` divides k, or
    raises mid-stream (the connection drops) when `crash_every` divides k. It records every request and
    the most requests it ever had streaming at once."""

    def __init__(self) -> None:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, StreamingResponse

        self.reset()
        app = FastAPI()

        @app.get("/v1/models")
        async def models(request: Request) -> Any:
            if not self._authorized(request):
                return JSONResponse({"error": {"message": "bad key", "type": "auth"}}, status_code=401)
            return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

        async def handle(request: Request, chat: bool) -> Any:
            if not self._authorized(request):
                return JSONResponse({"error": {"message": "bad key", "type": "auth"}}, status_code=401)
            body = await request.json()
            k = self.arrived
            self.arrived += 1
            self.payloads.append(body)
            self.headers.append(dict(request.headers))
            if self.fail_every and k % self.fail_every == 0:
                return JSONResponse(
                    {"error": {"message": "stub failure", "type": "server_error", "code": 500}},
                    status_code=500,
                )
            n = body["max_tokens"] if self.tokens is None else min(self.tokens, body["max_tokens"])
            broken = bool(self.break_every) and k % self.break_every == 0
            crash = bool(self.crash_every) and k % self.crash_every == 0 and not broken
            usage = body.get("stream_options", {}).get("include_usage") and self.send_usage
            prompt_len = (
                len(body["prompt"]) if not chat else sum(len(m["content"].split()) for m in body["messages"])
            )

            def chunk(i: int) -> str:
                # The first `held` tokens come with empty text (a server holding an incomplete character
                # back); the chunk after them brings their text. With `pairs`, chunk i holds tokens 2i, 2i+1.
                text = "" if i < self.held else "".join(f"t{j} " for j in range(self.held)) + f"t{i} " \
                    if i == self.held else f"t{i} "
                text = f"t{2 * i} t{2 * i + 1} " if self.pairs else text
                text += self.text_suffix if text else ""
                if chat:
                    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
                    obj = "chat.completion.chunk"
                else:
                    choice = {"index": 0, "text": text, "finish_reason": None}
                    obj = "text_completion"
                event = {"id": "x", "object": obj, "choices": [choice]}
                return "data: " + json.dumps(event, ensure_ascii=False) + "\n\n"  # raw UTF-8, as servers send

            async def stream() -> Any:
                self.active += 1
                self.max_active = max(self.max_active, self.active)
                try:
                    if chat:  # a role-only first chunk carries no text: it must not count as a token
                        role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                        yield "data: " + json.dumps({"choices": [role]}) + "\n\n"
                    chunks = (n + 1) // 2 if self.pairs else n - 1 if self.last_token_in_finish else n
                    for i in range(chunks):
                        await asyncio.sleep(self.delay)
                        yield chunk(i)
                        if (broken or crash) and i == 1:
                            break
                    if crash:
                        raise RuntimeError("stub crashed mid-stream")
                    if broken:
                        return
                    # The final chunk: no text, finish_reason set.
                    finish = {"index": 0, "text": "", "finish_reason": "length"}
                    if chat:
                        finish = {"index": 0, "delta": {}, "finish_reason": "length"}
                    yield "data: " + json.dumps({"choices": [finish]}) + "\n\n"
                finally:
                    # Before [DONE]: the client frees its slot only after [DONE], so the count seen here
                    # never exceeds the client's own count of requests in flight.
                    self.active -= 1
                if usage:
                    u: dict[str, Any] = {"prompt_tokens": prompt_len, "completion_tokens": n,
                                         "total_tokens": prompt_len + n}  # fmt: skip
                    if self.cached_share:  # a server with a prefix cache reports its hits
                        u["prompt_tokens_details"] = {"cached_tokens": int(prompt_len * self.cached_share)}
                    yield "data: " + json.dumps({"choices": [], "usage": u}) + "\n\n"
                yield "data: [DONE]\n\n"

            async def fragmented() -> Any:
                # What TCP may do to a stream: a line cut anywhere (a multi-byte character included), and
                # two events in one read.
                carried = b""
                async for event in stream():
                    data = carried + event.encode()
                    cut = 1 + len(data) // 3
                    yield data[:cut]
                    await asyncio.sleep(0.001)
                    yield data[cut:-5]
                    carried = data[-5:]
                yield carried

            async def line_ends() -> Any:
                async for event in stream():
                    if event == "data: [DONE]\n\n" and not self.final_line_end:
                        event = "data: [DONE]"
                    yield event.replace("\n", self.line_end)

            body_stream = fragmented() if self.fragment else line_ends()
            return StreamingResponse(body_stream, media_type="text/event-stream")

        @app.post("/moved")
        async def moved() -> Any:
            return JSONResponse({}, status_code=307, headers={"Location": "/v1/completions"})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Any:
            return await handle(request, chat=True)

        self.app = app

    def reset(self, **settings: Any) -> None:
        self.tokens: int | None = settings.get("tokens")
        self.fail_every: int = settings.get("fail_every", 0)
        self.break_every: int = settings.get("break_every", 0)
        self.crash_every: int = settings.get("crash_every", 0)
        self.send_usage: bool = settings.get("send_usage", True)
        self.cached_share: float = settings.get("cached_share", 0.0)
        self.api_key: str | None = settings.get("api_key")
        self.delay: float = settings.get("delay", 0.002)
        self.held: int = settings.get("held", 0)
        self.fragment: bool = settings.get("fragment", False)  # events cut and joined across body writes
        self.text_suffix: str = settings.get("text_suffix", "")  # appended to every token's text
        self.line_end: str = settings.get("line_end", "\n")  # SSE allows \n, \r\n and \r
        self.final_line_end: bool = settings.get("final_line_end", True)  # after `data: [DONE]`
        # The last token comes in the finish chunk, with empty text (a stop token), not before it.
        self.last_token_in_finish: bool = settings.get("last_token_in_finish", False)
        self.pairs: bool = settings.get("pairs", False)  # two tokens a chunk, then OpenAI's end mark
        self.arrived = 0
        self.active = 0
        self.max_active = 0
        self.payloads: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []

    def _authorized(self, request: Any) -> bool:
        return self.api_key is None or request.headers.get("authorization") == f"Bearer {self.api_key}"


@pytest.fixture(scope="module")
def stub_server() -> Iterator[tuple[Stub, str]]:
    import uvicorn

    stub = Stub()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(stub.app, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the stub server did not start"
        time.sleep(0.01)
    try:
        yield stub, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture
def stub(stub_server: tuple[Stub, str]) -> Iterator[tuple[Stub, str]]:
    stub_server[0].reset()
    yield stub_server


def _run(url: str, *argv: str, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / "result.json"
    args = _args("--base-url", url, "--no-progress", "--output-json", str(out), *argv)
    assert serve.main(args) == 0
    result: dict[str, Any] = json.loads(out.read_text())
    return result


SUMMARY_KEYS = {
    "completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput", "output_len_mismatch", "total_cached_tokens",
    "prefix_cache_hit_rate",
    *(f"{stat}_{m}_ms" for stat in serve_metrics.STATS for m in serve_metrics.METRICS),
}  # fmt: skip
RECORD_KEYS = {
    "index", "prompt_len", "output_len", "scheduled_s", "sent_s", "end_s", "success", "error",
    "http_status", "output_tokens", "output_tokens_source", "prompt_tokens", "cached_tokens", "token_times_s",
    "ttft_ms",
    "tpot_ms", "e2el_ms", "itl_ms",
}  # fmt: skip


def test_all_at_once(stub: tuple[Stub, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server, url = stub
    result = _run(url, "--num-prompts", "10", "--input-len", "7", "--output-len", "6", tmp_path=tmp_path)
    assert set(result) == {"config", "summary", "errors", "requests", "pass_results"}
    s, c = result["summary"], result["config"]
    assert c["passes"] == 1 and [p["pass"] for p in result["pass_results"]] == [1]
    assert result["pass_results"][0]["summary"] == s
    assert set(s) == SUMMARY_KEYS
    assert c["model"] == "stub-model" and c["url"] == url + "/v1/completions"
    assert c["request_rate"] == "inf" and c["num_prompts"] == 10 and c["seed"] == 0
    assert s["completed"] == 10 and s["failed"] == 0 and result["errors"] == []
    assert s["total_output_tokens"] == 60 and s["total_input_tokens"] == 70
    assert s["output_len_mismatch"] == 0
    assert s["request_throughput"] == pytest.approx(10 / s["duration_s"])
    assert all(s[k] is not None for k in SUMMARY_KEYS - {"total_cached_tokens", "prefix_cache_hit_rate"})
    assert s["total_cached_tokens"] is None and s["prefix_cache_hit_rate"] is None  # not reported
    assert len(result["requests"]) == 10
    for rec in result["requests"]:
        assert set(rec) == RECORD_KEYS
        assert rec["success"] and rec["output_tokens"] == 6 and rec["output_tokens_source"] == "usage"
        assert rec["prompt_tokens"] == 7 and len(rec["token_times_s"]) == 6 and len(rec["itl_ms"]) == 5
        assert rec["tpot_ms"] == pytest.approx((rec["e2el_ms"] - rec["ttft_ms"]) / 5)
        assert rec["http_status"] == 200
    # What the server got: model from /v1/models, exact token-id prompts, streaming with usage, ignore_eos.
    assert server.arrived == 10
    for body in server.payloads:
        assert body["model"] == "stub-model" and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert len(body["prompt"]) == 7 and all(3 <= t < 1000 for t in body["prompt"])
        assert body["max_tokens"] == 6 and body["ignore_eos"] is True and body["min_tokens"] == 6
    assert "authorization" not in server.headers[0]
    report = capsys.readouterr().out
    for line in ("Successful requests:", "Failed requests:", "Request throughput (req/s):",
                 "Output token throughput (tok/s):", "Total token throughput (tok/s):", "Mean TTFT (ms):",
                 "Median TPOT (ms):", "P90 ITL (ms):", "P99 E2EL (ms):"):  # fmt: skip
        assert line in report, line


def test_passes_send_the_same_shapes_and_report_each(
    stub: tuple[Stub, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server, url = stub
    result = _run(
        url, "--num-prompts", "6", "--input-len", "9", "--output-len", "4", "--range-ratio", "0.5",
        "--request-rate", "200", "--passes", "3", tmp_path=tmp_path,
    )  # fmt: skip
    passes = result["pass_results"]
    assert [p["pass"] for p in passes] == [1, 2, 3] and result["config"]["passes"] == 3
    assert result["summary"] == passes[0]["summary"] and len(result["requests"]) == 6
    for p in passes:
        assert set(p["summary"]) == SUMMARY_KEYS and p["errors"] == []
        assert p["summary"]["completed"] == 6 and len(p["requests"]) == 6
        assert all(set(rec) == RECORD_KEYS and rec["success"] for rec in p["requests"])
        assert p["summary"]["total_input_tokens"] == passes[0]["summary"]["total_input_tokens"]
    # Each pass sent six requests of the same lengths, and prompts of its own.
    sent = [(tuple(b["prompt"]), b["max_tokens"]) for b in server.payloads]
    assert server.arrived == 18 and len(set(sent)) == 18
    shapes = [(len(p), n) for p, n in sent]
    assert all(shapes.count(x) % 3 == 0 for x in shapes)
    report = capsys.readouterr().out
    for n in (1, 2, 3):
        assert f"Serving Benchmark Result, pass {n} of 3" in report


def test_shared_prefixes_and_the_reported_hit_rate(
    stub: tuple[Stub, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--prefix-len/--num-prefixes: request i starts with prefix i % N; the hit rate is the cached tokens the
    server reports over the prompt tokens."""
    server, url = stub
    server.reset(cached_share=0.5)
    result = _run(url, "--num-prompts", "6", "--input-len", "5", "--prefix-len", "8", "--num-prefixes", "2",
                  tmp_path=tmp_path)  # fmt: skip
    prompts = {tuple(b["prompt"]) for b in server.payloads}
    assert len(prompts) == 6 and all(len(p) == 13 for p in prompts)
    assert len({p[:8] for p in prompts}) == 2 and len({p[8:] for p in prompts}) == 6
    work = serve.make_workload(6, 5, 128, 0.0, 1000, 0, serve.COMPLETIONS, 8, 2)
    assert [w[:8] for w in work.prompts] == [work.prompts[i % 2][:8] for i in range(6)]  # type: ignore[index]
    s = result["summary"]
    assert s["total_cached_tokens"] == 6 * 6 and s["prefix_cache_hit_rate"] == pytest.approx(36 / 78)
    assert all(rec["cached_tokens"] == 6 for rec in result["requests"])
    assert "Prefix cache hit rate (%):" in capsys.readouterr().out


def test_random_lengths_match(stub: tuple[Stub, str], tmp_path: Path) -> None:
    server, url = stub
    result = _run(
        url, "--num-prompts", "16", "--input-len", "10", "--output-len", "8", "--range-ratio", "0.5",
        "--seed", "3", "--model", "my-model", tmp_path=tmp_path,
    )  # fmt: skip
    work = serve.make_workload(16, 10, 8, 0.5, 1000, 3, serve.COMPLETIONS)
    recs = result["requests"]
    assert [r["output_len"] for r in recs] == work.output_lens
    assert [r["prompt_len"] for r in recs] == work.prompt_lens
    assert all(r["output_tokens"] == r["output_len"] for r in recs)
    assert result["summary"]["total_output_tokens"] == sum(work.output_lens)
    got = sorted((tuple(b["prompt"]), b["max_tokens"]) for b in server.payloads)
    assert got == sorted((tuple(p), n) for p, n in zip(work.prompts, work.output_lens, strict=True))
    assert {b["model"] for b in server.payloads} == {"my-model"}


def test_fixed_concurrency_never_exceeded(stub: tuple[Stub, str], tmp_path: Path) -> None:
    server, url = stub
    server.reset(delay=0.005)
    result = _run(url, "--num-prompts", "12", "--max-concurrency", "3", "--output-len", "5",
                  "--input-len", "4", tmp_path=tmp_path)  # fmt: skip
    assert result["summary"]["completed"] == 12
    assert result["config"]["max_concurrency"] == 3
    assert server.arrived == 12 and 1 <= server.max_active <= 3


def test_poisson_schedule(stub: tuple[Stub, str], tmp_path: Path) -> None:
    server, url = stub
    rate, n, seed = 100.0, 9, 11
    result = _run(url, "--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(seed),
                  "--output-len", "3", "--input-len", "4", tmp_path=tmp_path)  # fmt: skip
    recs = result["requests"]
    scheduled = [r["scheduled_s"] for r in recs]
    want = np.random.default_rng(seed).exponential(1.0 / rate, size=n - 1)  # computed independently
    assert scheduled[0] == 0.0
    np.testing.assert_allclose(np.diff(scheduled), want, rtol=1e-9)
    assert all(r["sent_s"] >= r["scheduled_s"] for r in recs)  # never sent before its arrival time
    assert result["summary"]["completed"] == n and server.arrived == n
    assert result["config"]["request_rate"] == rate


def test_failures_counted(stub: tuple[Stub, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server, url = stub
    server.reset(fail_every=3)
    result = _run(url, "--num-prompts", "9", "--max-concurrency", "1", "--output-len", "4",
                  "--input-len", "4", tmp_path=tmp_path)  # fmt: skip
    s = result["summary"]
    assert s["completed"] == 6 and s["failed"] == 3
    assert result["errors"] == [{"error": "HTTP 500: stub failure", "count": 3}]
    failed = [r for r in result["requests"] if not r["success"]]
    assert len(failed) == 3 and all(r["http_status"] == 500 and r["ttft_ms"] is None for r in failed)
    ok = [r for r in result["requests"] if r["success"]]
    assert s["mean_ttft_ms"] == pytest.approx(float(np.mean([r["ttft_ms"] for r in ok])))
    assert s["total_output_tokens"] == 24
    assert "3 x HTTP 500: stub failure" in capsys.readouterr().out


def test_broken_streams_counted(stub: tuple[Stub, str], tmp_path: Path) -> None:
    server, url = stub
    server.reset(break_every=4, crash_every=5)  # k = 0, 4, 8 break off; k = 5 crashes
    result = _run(url, "--num-prompts", "10", "--max-concurrency", "2", "--output-len", "4",
                  "--input-len", "4", tmp_path=tmp_path)  # fmt: skip
    s = result["summary"]
    assert s["failed"] == 4 and s["completed"] == 6 and s["total_output_tokens"] == 24
    errors = {e["error"]: e["count"] for e in result["errors"]}
    assert errors.pop("broken stream: it ended without `data: [DONE]`") == 3
    (crash, count), *_ = errors.items()
    assert count == 1 and crash.startswith("broken stream or connection:"), errors


def test_all_failed_is_an_error(stub: tuple[Stub, str], tmp_path: Path) -> None:
    server, url = stub
    server.reset(fail_every=1)
    out = tmp_path / "r.json"
    with pytest.raises(TPRuntimeError, match=r"all 3 requests failed.*HTTP 500: stub failure"):
        serve.main(_args("--base-url", url, "--num-prompts", "3", "--no-progress", "--output-json", str(out)))
    assert json.loads(out.read_text())["summary"]["failed"] == 3  # still written


def test_a_later_pass_all_failed_is_an_error(
    stub: tuple[Stub, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, url = stub
    timed_pass = serve._timed_pass

    async def first_pass_then_failures(*args: Any) -> float:
        duration = await timed_pass(*args)
        server.fail_every = 1  # every request after the first pass answers HTTP 500
        return duration

    monkeypatch.setattr(serve, "_timed_pass", first_pass_then_failures)
    out = tmp_path / "r.json"
    with pytest.raises(TPRuntimeError, match=r"all 3 requests of pass 2 failed.*HTTP 500: stub failure"):
        serve.main(_args("--base-url", url, "--num-prompts", "3", "--passes", "2", "--no-progress",
                         "--output-json", str(out)))  # fmt: skip
    result = json.loads(out.read_text())
    assert [p["summary"]["failed"] for p in result["pass_results"]] == [0, 3]  # still written


def test_output_counts_not_assumed(
    stub: tuple[Stub, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server that stops early and sends no usage: tokens are counted from the chunks."""
    server, url = stub
    server.reset(tokens=3, send_usage=False)
    result = _run(url, "--num-prompts", "4", "--output-len", "8", "--input-len", "4", tmp_path=tmp_path)
    s = result["summary"]
    assert s["completed"] == 4 and s["total_output_tokens"] == 12 and s["output_len_mismatch"] == 4
    for rec in result["requests"]:
        assert rec["output_tokens"] == 3 and rec["output_tokens_source"] == "chunks"
        assert rec["prompt_tokens"] is None
    assert s["total_input_tokens"] == 16  # the prompt lengths sent, without usage
    assert "4 of 4 requests returned a different number of output tokens" in capsys.readouterr().out


def test_one_token_outputs(stub: tuple[Stub, str], tmp_path: Path) -> None:
    _, url = stub
    result = _run(url, "--num-prompts", "3", "--output-len", "1", "--input-len", "2", tmp_path=tmp_path)
    s = result["summary"]
    assert s["completed"] == 3 and s["mean_tpot_ms"] is None and s["p99_itl_ms"] is None
    assert s["mean_ttft_ms"] is not None
    assert all(r["tpot_ms"] is None and r["itl_ms"] == [] for r in result["requests"])


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_tokens_streamed_with_their_text_held_back_count(
    stub: tuple[Stub, str], tmp_path: Path, endpoint: str
) -> None:
    """A chunk with empty text before the end is a token whose text the server holds back (vLLM's streams
    and this project's send one per token): it times the first token and counts as one."""
    server, url = stub
    server.reset(held=2, delay=0.02)
    result = _run(url, "--endpoint", endpoint, "--num-prompts", "3", "--input-len", "4", "--output-len", "5",
                  "--no-ignore-eos", tmp_path=tmp_path)  # fmt: skip
    assert result["summary"]["completed"] == 3
    for r in result["requests"]:
        times = r["token_times_s"]  # the two held tokens' chunks are the first two
        assert len(times) == 5 and r["ttft_ms"] == pytest.approx(1e3 * (times[0] - r["sent_s"]))


def _send_one(url: str, endpoint: str, output_len: int = 6) -> RequestRecord:
    """One request through bench serve's client, its record (with the text it received)."""
    args = _args("--base-url", url, "--request-timeout", "30")
    kind = serve.endpoint_kind(endpoint) if endpoint.startswith("/v1/") else serve.COMPLETIONS
    prompt: list[int] | str = "a b c d" if kind == serve.CHAT else [5, 6, 7, 8]
    payload = serve.build_payload(kind, "stub-model", prompt, output_len, 0.0, True)
    rec = RequestRecord(index=0, prompt_len=4, output_len=output_len, scheduled_s=0.0)

    async def go() -> None:
        async with serve._session(args) as session:
            start = time.perf_counter()
            await serve.send_request(session, url + endpoint, {}, payload, kind, rec, start, 30.0)

    asyncio.run(go())
    return rec


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_events_cut_across_reads(stub: tuple[Stub, str], tmp_path: Path, endpoint: str) -> None:
    """Events arrive in pieces (a line, and a UTF-8 character, cut between two reads) and several in one
    read: each line is parsed whole, every token counted once, and the text arrives whole."""
    server, url = stub
    server.reset(fragment=True, text_suffix="é€")
    result = _run(url, "--endpoint", endpoint, "--num-prompts", "3", "--input-len", "4", "--output-len", "6",
                  tmp_path=tmp_path)  # fmt: skip
    assert result["summary"]["completed"] == 3 and result["errors"] == []
    for r in result["requests"]:
        assert r["output_tokens"] == 6 and len(r["token_times_s"]) == 6
        assert r["output_tokens_source"] == "usage"
    rec = _send_one(url, endpoint)
    assert rec.success and "".join(rec.text_parts) == "".join(f"t{i} é€" for i in range(6))


@pytest.mark.parametrize(("line_end", "final"), [("\r\n", True), ("\r", True), ("\n", False)])
def test_every_sse_line_end_and_a_last_line_without_one(
    stub: tuple[Stub, str], line_end: str, final: bool
) -> None:
    server, url = stub
    server.reset(line_end=line_end, final_line_end=final)
    rec = _send_one(url, "/v1/completions")
    assert rec.success and rec.error is None and len(rec.token_times_s) == 6


def test_a_redirect_is_reported_not_followed(stub: tuple[Stub, str]) -> None:
    server, url = stub
    rec = _send_one(url, "/moved")
    assert not rec.success and rec.http_status == 307 and rec.error is not None and "HTTP 307" in rec.error
    assert server.arrived == 0


@pytest.mark.parametrize("send_usage", [True, False])
def test_a_last_token_without_text_counts_when_usage_says_so(
    stub: tuple[Stub, str], tmp_path: Path, send_usage: bool
) -> None:
    """This server's and vLLM's last chunk carries the last token with the finish reason, its text maybe
    empty (a stop token): usage's count says it is a token. Without usage it cannot be told from OpenAI's
    end mark (the stub's default, which never counts: see the other tests' five chunks for five tokens)."""
    server, url = stub
    server.reset(last_token_in_finish=True, send_usage=send_usage)
    result = _run(url, "--num-prompts", "2", "--input-len", "4", "--output-len", "5", "--no-ignore-eos",
                  tmp_path=tmp_path)  # fmt: skip
    assert result["summary"]["completed"] == 2
    assert all(len(r["token_times_s"]) == (5 if send_usage else 4) for r in result["requests"])


def test_an_end_mark_after_chunks_of_several_tokens_is_no_token(
    stub: tuple[Stub, str], tmp_path: Path
) -> None:
    """A server sending two tokens a chunk, then OpenAI's end mark: usage counts more tokens than chunks,
    but the end mark carried none (it had been timed as the last token: E2E, TPOT and the ITL all grew by
    the wait before it)."""
    server, url = stub
    server.reset(pairs=True, delay=0.01)
    result = _run(url, "--num-prompts", "2", "--input-len", "4", "--output-len", "6", tmp_path=tmp_path)
    assert result["summary"]["completed"] == 2
    for r in result["requests"]:
        assert r["output_tokens"] == 6 and len(r["token_times_s"]) == 3
        assert r["e2el_ms"] == pytest.approx(1e3 * (r["token_times_s"][-1] - r["sent_s"]))


def test_chat_endpoint(stub: tuple[Stub, str], tmp_path: Path) -> None:
    server, url = stub
    result = _run(url, "--endpoint", "/v1/chat/completions", "--num-prompts", "4", "--input-len", "9",
                  "--output-len", "5", "--num-warmups", "1", tmp_path=tmp_path)  # fmt: skip
    s = result["summary"]
    assert s["completed"] == 4 and s["total_output_tokens"] == 20 and s["output_len_mismatch"] == 0
    # The role-only first chunk is no token: five timed chunks per request.
    assert all(len(r["token_times_s"]) == 5 for r in result["requests"])
    assert server.arrived == 5  # one warmup, not in the results
    assert all(len(b["messages"][0]["content"].split()) == 9 for b in server.payloads)


def test_api_key(stub: tuple[Stub, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server, url = stub
    server.reset(api_key="sekrit")
    assert serve.cli(["--base-url", url, "--num-prompts", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "HTTP 401" in err and "--api-key" in err and len(err.splitlines()) == 1
    result = _run(url, "--api-key", "sekrit", "--num-prompts", "2", "--output-len", "2", tmp_path=tmp_path)
    assert result["summary"]["completed"] == 2 and result["config"]["api_key_set"] is True
    assert "sekrit" not in json.dumps(result)
    assert all(h["authorization"] == "Bearer sekrit" for h in server.headers)


def test_multi_turn_conversations_resend_their_history(stub: tuple[Stub, str], tmp_path: Path) -> None:
    """--multi-turn 3: each conversation's turn t sends its earlier user messages and the stub's replies to
    them, then a new user message; the summary gives each turn's prompt size and TTFT."""
    server, url = stub
    result = _run(
        url, "--endpoint", "/v1/chat/completions", "--num-prompts", "4", "--multi-turn", "3",
        "--input-len", "5", "--output-len", "3", "--request-rate", "inf", tmp_path=tmp_path,
    )  # fmt: skip
    assert result["summary"]["completed"] == 12 and result["config"]["multi_turn"] == 3
    by_first: dict[str, list[list[dict[str, str]]]] = {}
    for body in server.payloads:
        by_first.setdefault(body["messages"][0]["content"], []).append(body["messages"])
    assert len(by_first) == 4
    for conversation in by_first.values():
        assert [len(m) for m in conversation] == [1, 3, 5]
        for turn in range(1, 3):
            earlier, now = conversation[turn - 1], conversation[turn]
            assert now[: len(earlier)] == earlier  # the history is resent as it was
            assert now[len(earlier)] == {"role": "assistant", "content": "t0 t1 t2 "}
            assert now[-1]["role"] == "user" and len(now[-1]["content"].split()) == 5
    turns = result["summary"]["turns"]
    assert [t["turn"] for t in turns] == [0, 1, 2] and all(t["completed"] == 4 for t in turns)
    assert [t["mean_prompt_tokens"] for t in turns] == [5.0, 13.0, 21.0]  # 5 words + 3 per reply
    assert all(t["mean_ttft_ms"] is not None and t["mean_ttft_ms"] >= 0 for t in turns)
    with pytest.raises(ConfigError, match="--multi-turn"):
        serve.check(_args("--base-url", url, "--multi-turn", "2"))


def test_a_server_that_stops_reading_the_body_times_out() -> None:
    """--request-timeout bounds the sending too: a server that accepts the connection and never reads a
    body larger than the sockets' buffers fails the request as timed out, instead of hanging."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1/completions"
    args = _args("--request-timeout", "1")
    rec = RequestRecord(index=0, prompt_len=1, output_len=1, scheduled_s=0.0)
    payload = {"prompt": "x" * (64 << 20), "max_tokens": 1, "stream": True}

    async def go() -> None:
        async with serve._session(args) as session:
            start = time.perf_counter()
            await serve.send_request(session, url, {}, payload, serve.COMPLETIONS, rec, start, 1.0)

    try:
        asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        listener.close()
    assert not rec.success and rec.error is not None and rec.error.startswith("timed out"), rec.error
