"""Prometheus metrics of one server (a private registry, no global state)."""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from lightllm.server.core.objs.shm_stats import ShmStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _SharedStatsCollector:
    """Exposes the router's and rank 0's shared counters as gauges at scrape time."""

    def __init__(self, stats: ShmStats, strategy: str):
        self.stats = stats
        self.strategy = strategy

    def collect(self) -> Iterable[GaugeMetricFamily]:
        for name, value in self.stats.snapshot().items():
            gauge = GaugeMetricFamily(f"lightllm_{name}", f"Live value of {name}", labels=["strategy"])
            gauge.add_metric([self.strategy], value)
            yield gauge


class ServerMetrics:
    """Request counts, token counts, TTFT and per-token latency, labelled by strategy."""

    def __init__(self, strategy: str, stats: ShmStats):
        self.strategy = strategy
        self.registry = CollectorRegistry()
        labels = ["strategy"]
        self.requests = Counter("lightllm_requests", "Finished requests", labels + ["finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("lightllm_prompt_tokens", "Prompt tokens received", labels, registry=self.registry)
        self.cached_tokens = Counter("lightllm_cached_prompt_tokens", "Prompt tokens served from the prefix cache", labels, registry=self.registry)
        self.generated_tokens = Counter("lightllm_generated_tokens", "Tokens generated", labels, registry=self.registry)
        self.ttft = Histogram("lightllm_time_to_first_token_seconds", "Time to first token", labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("lightllm_time_per_output_token_seconds", "Gap between consecutive tokens", labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("lightllm_request_latency_seconds", "End-to-end request latency", labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_SharedStatsCollector(stats, strategy))
        # Label lookups cost more than the observations; the per-token path uses bound children.
        self._tpot = self.tpot.labels(strategy)
        self._generated = self.generated_tokens.labels(strategy)

    def on_submit(self, prompt_tokens: int) -> None:
        """A request was handed to the router."""
        self.prompt_tokens.labels(self.strategy).inc(prompt_tokens)

    def on_first_token(self, seconds: float, cached_tokens: int) -> None:
        """The first token arrived."""
        self.ttft.labels(self.strategy).observe(seconds)
        self.cached_tokens.labels(self.strategy).inc(cached_tokens)
        self.generated_tokens.labels(self.strategy).inc()

    def on_next_token(self, seconds: float) -> None:
        """A later token arrived ``seconds`` after the previous one."""
        self._tpot.observe(seconds)
        self._generated.inc()

    def on_finish(self, finish_reason: str, completion_tokens: int, seconds: float) -> None:
        """A request ended."""
        self.requests.labels(self.strategy, finish_reason).inc()
        self.e2e.labels(self.strategy).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """Body and content type for /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
