"""Prometheus metrics of one server (``GET /metrics``).

Each app gets its own ``CollectorRegistry`` so that several servers (tests) can live in
one process. Two sources feed it:

* per request, from the outputs the server relays: outcome, token counts, TTFT,
  inter-token latency and end-to-end latency (``RequestMetrics``);
* engine-wide, read from the engine's stats snapshot at scrape time: running/waiting
  requests, KV usage, prefix-cache counters, preemptions (``_EngineCollector``).
  These totals live in the engine, so they are exported as they are instead of being
  re-counted here.

Names are ``dsv4:``. Benchmark clients written for vLLM compute the prefix hit rate
from ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``, so those two are
mirrored; the dsv4 counterparts are named ``..._hit_tokens`` / ``..._query_tokens`` so
that a client summing a metric over the vllm/dsv4 namespaces does not count twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dsv4.engine.outputs import RequestOutput

# The per-series "_created" timestamps double the exposition for nothing a scraper uses
# (vLLM turns them off too). The switch is process-wide.
disable_created_metrics()

STATUS_SUCCESS = "success"
STATUS_ERROR = "error"
STATUS_ABORT = "abort"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.4, 0.8, 1.6, 5.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


class ServerMetrics:
    def __init__(self, model_name: str, engine_stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.requests = counter("dsv4:requests", "Requests that left the engine, by outcome.", ("status",))
        self.prompt_tokens = counter("dsv4:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("dsv4:generation_tokens", "Generated tokens of finished requests.")
        self.cached_tokens = counter("dsv4:prompt_tokens_cached", "Prompt tokens served from the prefix cache.")
        self.ttft = histogram(
            "dsv4:time_to_first_token_seconds", "Arrival to first generated token.", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "dsv4:inter_token_latency_seconds",
            "Time between generated tokens (a step's time shared by the tokens it produced).",
            _ITL_BUCKETS,
        )
        self.e2e = histogram("dsv4:e2e_request_latency_seconds", "Arrival to last output.", _E2E_BUCKETS)
        self.registry.register(_EngineCollector(engine_stats, model_name))

    def track(self) -> RequestMetrics:
        """Start timing one engine request (call on arrival, before tokenising)."""
        return RequestMetrics(self)


class RequestMetrics:
    """Latency and token accounting of one engine request, fed the outputs it produced."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self._arrival = time.perf_counter()
        self._last_token_at: float | None = None
        self._last: RequestOutput | None = None
        self._done = False

    def on_output(self, output: RequestOutput, produced_at: float) -> None:
        self._last = output
        # With n samples a step adds one token to each; with speculative decoding several.
        new = max((len(c.token_ids_delta) for c in output.outputs), default=0)
        if not new:
            return
        labels = self._m.ttft.labels(self._m.model_name)
        if self._last_token_at is None:
            labels.observe(produced_at - self._arrival)
        else:
            itl = self._m.itl.labels(self._m.model_name)
            per_token = (produced_at - self._last_token_at) / new
            for _ in range(new):
                itl.observe(per_token)
        self._last_token_at = produced_at

    def finish(self, status: str) -> None:
        """Record the outcome once; later calls are ignored (error paths may overlap)."""
        if self._done:
            return
        self._done = True
        name = self._m.model_name
        self._m.requests.labels(name, status).inc()
        self._m.e2e.labels(name).observe(time.perf_counter() - self._arrival)
        if self._last is not None:
            self._m.prompt_tokens.labels(name).inc(len(self._last.prompt_token_ids))
            self._m.generation_tokens.labels(name).inc(sum(len(c.token_ids) for c in self._last.outputs))
            self._m.cached_tokens.labels(name).inc(self._last.num_cached_tokens)


class _EngineCollector(Collector):
    """Exports the engine's own gauges and running totals from its stats snapshot."""

    def __init__(self, stats: Callable[[], dict], model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name

    def collect(self):
        stats = self._stats()
        label = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield gauge("dsv4:num_requests_running", "Requests in the running batch.", stats["running"])
        yield gauge("dsv4:num_requests_waiting", "Requests waiting to be scheduled.", stats["waiting"])
        yield gauge("dsv4:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", stats["kv_usage"])
        yield gauge("dsv4:kv_cache_blocks_total", "KV blocks in the pool.", stats["blocks_total"])
        yield gauge("dsv4:kv_cache_capacity_tokens", "Tokens the KV pool can hold.", stats["capacity_tokens"])
        yield gauge("dsv4:prefix_cache_hit_rate", "Prefix-cache hits over queries, in tokens.", stats["prefix_hit_rate"])
        yield counter("dsv4:num_preemptions", "Requests preempted to free KV blocks.", stats["preemptions"])
        hits, queries = stats["prefix_hits_tokens"], stats["prefix_queries_tokens"]
        yield counter("dsv4:prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", hits)
        yield counter("dsv4:prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.", queries)
        yield counter("vllm:prefix_cache_hits", "Mirror of dsv4:prefix_cache_hit_tokens.", hits)
        yield counter("vllm:prefix_cache_queries", "Mirror of dsv4:prefix_cache_query_tokens.", queries)
