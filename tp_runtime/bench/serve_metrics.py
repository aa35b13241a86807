"""`bench serve`'s figures: per-request metrics (TTFT, TPOT, ITL, E2E latency), their summary, and the
report. Pure functions of the request records, so they are checked against a brute-force computation."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
STATS = ("mean", "median", "p90", "p99")


# ---------------------------------------------------------------------------------------------------------
# Metrics (pure)
# ---------------------------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """One request: what was asked and what came back. Times are seconds from the benchmark's start."""

    index: int
    prompt_len: int
    output_len: int
    scheduled_s: float
    sent_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # arrivals of chunks that carried a token
    end_s: float | None = None  # the stream's end (or the failure)
    success: bool = False
    error: str | None = None
    http_status: int | None = None
    usage_output_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server sent it
    turn: int = 0  # --multi-turn: the turn of its conversation (0: the first)
    text_parts: list[str] = field(default_factory=list)  # the reply's text, as streamed

    @property
    def output_tokens(self) -> int:
        """`usage`'s completion_tokens when the server sent it, else the chunks that carried a token."""
        if self.usage_output_tokens is not None:
            return self.usage_output_tokens
        return len(self.token_times_s)


@dataclass
class RequestMetrics:
    ttft: float
    e2el: float
    itls: list[float]
    tpot: float | None  # None for a one-token output


def request_metrics(rec: RequestRecord) -> RequestMetrics | None:
    """TTFT, E2E, ITLs and TPOT (seconds) of a successful request; None for a failed one."""
    if not rec.success or rec.sent_s is None or not rec.token_times_s:
        return None
    times = rec.token_times_s
    ttft = times[0] - rec.sent_s
    e2el = times[-1] - rec.sent_s
    itls = [b - a for a, b in itertools.pairwise(times)]
    n = rec.output_tokens
    tpot = (e2el - ttft) / (n - 1) if n > 1 else None
    return RequestMetrics(ttft=ttft, e2el=e2el, itls=itls, tpot=tpot)


def stats_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 (numpy's linear percentiles) of `values_s`, in ms; None without samples."""
    if len(values_s) == 0:
        return dict.fromkeys(STATS)
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
    }


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """The summary figures of a run (see the module's docstring for the keys)."""
    samples: dict[str, list[float]] = {m: [] for m in METRICS}
    total_in = total_out = completed = mismatch = 0
    cached: int | None = None
    for rec in records:
        m = request_metrics(rec)
        if m is None:
            continue
        completed += 1
        total_in += rec.prompt_tokens if rec.prompt_tokens is not None else rec.prompt_len
        if rec.cached_tokens is not None:
            cached = (cached or 0) + rec.cached_tokens
        total_out += rec.output_tokens
        mismatch += rec.output_tokens != rec.output_len
        samples["ttft"].append(m.ttft)
        samples["e2el"].append(m.e2el)
        samples["itl"].extend(m.itls)
        if m.tpot is not None:
            samples["tpot"].append(m.tpot)

    def rate(x: float) -> float | None:
        return x / duration_s if duration_s > 0 else None

    summary: dict[str, Any] = {
        "completed": completed,
        "failed": len(records) - completed,
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": rate(completed),
        "output_throughput": rate(total_out),
        "total_token_throughput": rate(total_in + total_out),
        "output_len_mismatch": mismatch,
        # Prompt tokens the server reported found in its prefix cache; None when it reported none.
        "total_cached_tokens": cached,
        "prefix_cache_hit_rate": None if cached is None or not total_in else cached / total_in,
    }
    for metric in METRICS:
        for stat, value in stats_ms(samples[metric]).items():
            summary[f"{stat}_{metric}_ms"] = value
    if any(rec.turn for rec in records):
        summary["turns"] = turn_summaries(records)
    return summary


def turn_summaries(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """Per turn of the conversations (--multi-turn): its completed requests, their mean prompt tokens (the
    conversation so far, as the server counted them), the share of those found in the prefix cache and
    the mean TTFT: with prefix caching a later turn's TTFT should not grow with the conversation."""
    out = []
    for turn in sorted({rec.turn for rec in records}):
        done = [(rec, m) for rec in records if rec.turn == turn and (m := request_metrics(rec)) is not None]
        prompts = [rec.prompt_tokens if rec.prompt_tokens is not None else rec.prompt_len for rec, _ in done]
        cached = [rec.cached_tokens for rec, _ in done if rec.cached_tokens is not None]
        out.append({
            "turn": turn,
            "completed": len(done),
            "mean_prompt_tokens": float(np.mean(prompts)) if prompts else None,
            "cached_percent": 100.0 * sum(cached) / sum(prompts) if cached and sum(prompts) else None,
            "mean_ttft_ms": float(np.mean([m.ttft for _, m in done]) * 1e3) if done else None,
        })  # fmt: skip
    return out


def error_counts(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    counts = Counter(rec.error or "unknown error" for rec in records if not rec.success)
    return [{"error": msg, "count": n} for msg, n in counts.most_common()]


def record_json(rec: RequestRecord) -> dict[str, Any]:
    m = request_metrics(rec)
    return {
        "index": rec.index,
        "prompt_len": rec.prompt_len,
        "output_len": rec.output_len,
        "scheduled_s": rec.scheduled_s,
        "sent_s": rec.sent_s,
        "end_s": rec.end_s,
        "success": rec.success,
        "error": rec.error,
        "http_status": rec.http_status,
        "output_tokens": rec.output_tokens if rec.success else None,
        "output_tokens_source": "usage" if rec.usage_output_tokens is not None else "chunks",
        "prompt_tokens": rec.prompt_tokens,
        "cached_tokens": rec.cached_tokens,
        "token_times_s": rec.token_times_s,
        "ttft_ms": None if m is None else m.ttft * 1e3,
        "tpot_ms": None if m is None or m.tpot is None else m.tpot * 1e3,
        "e2el_ms": None if m is None else m.e2el * 1e3,
        "itl_ms": None if m is None else [x * 1e3 for x in m.itls],
    }


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_report(result: dict[str, Any]) -> str:
    """vLLM's report layout; with several passes, one report per pass."""
    passes = result.get("pass_results") or []
    if len(passes) <= 1:
        return _format_pass(result["config"], result["summary"], result["errors"], "Serving Benchmark Result")
    titles = [f"Serving Benchmark Result, pass {p['pass']} of {len(passes)}" for p in passes]
    return "\n".join(
        _format_pass(result["config"], p["summary"], p["errors"], title)
        for p, title in zip(passes, titles, strict=True)
    )


def _format_pass(c: dict[str, Any], s: dict[str, Any], errors: list[dict[str, Any]], title: str) -> str:
    width = 60
    rows: list[str] = [f" {title} ".center(width, "=")]

    def row(label: str, value: Any) -> None:
        rows.append(f"{label:<44}{_fmt(value):>16}")

    row("Model:", c["model"])
    row("Endpoint:", c["endpoint"])
    row("Request rate (req/s):", c["request_rate"])
    row("Max concurrency:", c["max_concurrency"] if c["max_concurrency"] is not None else "none")
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total output tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    if s.get("prefix_cache_hit_rate") is not None:
        row("Prefix cache hit rate (%):", 100 * s["prefix_cache_hit_rate"])
    for metric in METRICS:
        rows.append(f" {METRIC_TITLES[metric]} ".center(width, "-"))
        name = metric.upper()
        for stat in STATS:
            label = {"mean": "Mean", "median": "Median", "p90": "P90", "p99": "P99"}[stat]
            row(f"{label} {name} (ms):", s[f"{stat}_{metric}_ms"])
    for t in s.get("turns") or []:
        rows.append(
            f"Turn {t['turn'] + 1}: {t['completed']} ok, mean prompt {_fmt(t['mean_prompt_tokens'])} tokens "
            f"({_fmt(t['cached_percent'])} % cached), mean TTFT {_fmt(t['mean_ttft_ms'])} ms"
        )
    rows.append("=" * width)
    if s["output_len_mismatch"]:
        rows.append(
            f"note: {s['output_len_mismatch']} of {s['completed']} requests returned a different number of "
            "output tokens than asked (does the server honor ignore_eos / min_tokens?); the figures use "
            "the counts returned"
        )
    if errors:
        rows.append("Errors (most common first):")
        for e in errors[:5]:
            rows.append(f"  {e['count']} x {e['error']}")
        if len(errors) > 5:
            rows.append(f"  ... and {len(errors) - 5} more distinct errors (see --output-json)")
    return "\n".join(rows)
