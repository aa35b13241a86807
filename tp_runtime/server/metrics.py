"""The server's Prometheus metrics, named as vLLM names them (`vllm:num_requests_running` here is
`tp_runtime:num_requests_running`), every one labelled with the served model's name.

Each `ServerMetrics` owns its registry, so two servers in one process (tests) never share a metric.
The engine's gauges (requests running and waiting, KV blocks) and its count of finished requests by
reason are read from the engine thread's last snapshot when /metrics is scraped. Token counters and
latency histograms are updated by the front end as outputs arrive, so time to first token includes the
time a request waited in the queue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tp_runtime.engine.async_engine import EngineStats

PREFIX = "tp_runtime:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, with finer ones below 10 ms where GPU decode steps fall.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        registry, labels = self.registry, ["model_name"]
        self.prompt_tokens = Counter(
            f"{PREFIX}prompt_tokens", "Prompt tokens of the requests admitted", labels, registry=registry
        ).labels(model_name)
        self.generation_tokens = Counter(
            f"{PREFIX}generation_tokens", "Tokens generated", labels, registry=registry
        ).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            metric = Histogram(f"{PREFIX}{name}", doc, labels, buckets=buckets, registry=registry)
            return metric.labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from a request's arrival to its first token", _TTFT_BUCKETS
        )
        # TTFT's engine-side parts (vLLM's names): the engine thread taking the request to its first
        # scheduling, and that to its first token on the host. The rest of TTFT is the HTTP path, the
        # request's checks, and its wait for the engine thread to take it (between two steps).
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Time from a request's arrival at the engine until its prompt is first scheduled", _TTFT_BUCKETS,
        )  # fmt: skip
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds",
            "Time from a request's first scheduling until its first token is on the host", _TTFT_BUCKETS,
        )  # fmt: skip
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between two consecutive tokens of a request", _ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from a request's arrival to its last token", _E2E_BUCKETS
        )
        registry.register(_EngineCollector(model_name, stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """The engine's gauges, from its latest snapshot at each scrape."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        label = [self._model_name]
        gauges = (
            ("num_requests_running", "Requests in the engine's running batch", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of the KV-cache blocks in use (0 to 1)",
             s.kv_blocks_used / max(1, s.kv_blocks_total)),
            ("kv_cache_blocks_used", "KV-cache blocks in use (per rank)", s.kv_blocks_used),
            ("kv_cache_blocks_total", "KV-cache blocks (per rank)", s.kv_blocks_total),
        )  # fmt: skip
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(f"{PREFIX}{name}", doc, labels=["model_name"])
            gauge.add_metric(label, value)
            yield gauge
        preemptions = CounterMetricFamily(
            f"{PREFIX}num_preemptions",
            "Requests preempted (their KV blocks taken back)",
            labels=["model_name"],
        )
        preemptions.add_metric(label, s.num_preemptions)
        yield preemptions
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits),
        ):
            counter = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=["model_name"])
            counter.add_metric(label, value)
            yield counter
        finished = CounterMetricFamily(
            f"{PREFIX}request_success",
            "Requests (one per sample) finished, by finish reason (abort: the client went away, the server "
            "shut down first, or the request's token masks left no token to sample)",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in s.finished:
            finished.add_metric([self._model_name, reason], count)
        yield finished
