"""Prometheus metrics of one server (a private registry, no global state).

Every quantity is measured once, under a ``lightllm_*`` name, and exported at scrape time a
second time under vLLM's name (``vllm:*``) where vLLM has an equivalent, so dashboards and
alerts written for vLLM work unchanged.  Every series carries the served ``model_name`` (the id
``/v1/models`` reports); the ``lightllm_*`` series also carry the prefill queue ``strategy``, the
``vllm:*`` copies vLLM's ``engine`` label (always ``"0"``: one engine per server).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from lightllm.server.core.objs.finish_status import FINISH_REASON_NAMES
from lightllm.server.core.objs.iteration_tokens_histogram import ITERATION_TOKEN_FIELDS, iteration_tokens_family
from lightllm.server.core.objs.prefill_wait_histogram import PREFILL_WAIT_FIELDS, histogram_families
from lightllm.server.core.objs.shm_stats import ShmStats
from lightllm.server.httpserver.request_counting import RequestCounting

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# vLLM's bounds for its histogram of the ``n`` request parameter.
N_BUCKETS = (1, 2, 5, 10, 20)

# Our family -> the vLLM families that carry the same data.  ``time_per_output_token_seconds`` is
# the older vLLM name of ``inter_token_latency_seconds`` (0.32 no longer exports it; dashboards
# built on older versions still query it), and vLLM's prefix-cache counters count prompt tokens
# looked up and found.
VLLM_NAMES: Dict[str, Tuple[str, ...]] = {
    "lightllm_running_requests": ("vllm:num_requests_running",),
    "lightllm_waiting_requests": ("vllm:num_requests_waiting",),
    "lightllm_kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc",),
    "lightllm_preemptions": ("vllm:num_preemptions",),
    "lightllm_prompt_tokens": ("vllm:prompt_tokens",),
    "lightllm_prefix_cache_queried_tokens": ("vllm:prefix_cache_queries",),
    # vLLM counts the same tokens a second time, per finished request, as prompt_tokens_cached.
    "lightllm_cached_prompt_tokens": ("vllm:prefix_cache_hits", "vllm:prompt_tokens_cached"),
    "lightllm_generated_tokens": ("vllm:generation_tokens",),
    "lightllm_requests": ("vllm:request_success",),
    "lightllm_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "lightllm_time_per_output_token_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "lightllm_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "lightllm_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "lightllm_request_generation_tokens": ("vllm:request_generation_tokens",),
    "lightllm_request_decode_seconds": ("vllm:request_decode_time_seconds",),
    "lightllm_request_time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds",),
    "lightllm_request_queue_seconds": ("vllm:request_queue_time_seconds",),
    "lightllm_request_prefill_seconds": ("vllm:request_prefill_time_seconds",),
    "lightllm_request_inference_seconds": ("vllm:request_inference_time_seconds",),
    # vLLM exports the requested completion length under both names.
    "lightllm_request_max_new_tokens": ("vllm:request_max_num_generation_tokens", "vllm:request_params_max_tokens"),
    "lightllm_request_params_n": ("vllm:request_params_n",),
    "lightllm_iteration_tokens": ("vllm:iteration_tokens_total",),
}
# vLLM's finish reason for output its repetition detector stopped (exported at 0, never counted).
VLLM_REPETITION_REASON = "repetition"
# vLLM's engine index: a server here is one engine.
VLLM_ENGINE = "0"
# vLLM spells the finish label ``finished_reason``; it has no strategy label.
_VLLM_LABEL_NAMES = {"finish_reason": "finished_reason", "strategy": None}

# Cumulative shared fields: exported as counters in base units, not as live gauges.
_STEP_PHASE_FIELDS = {
    "step_schedule_us": "schedule",
    "step_forward_us": "forward",
    "step_sample_us": "sample",
    "step_publish_us": "publish",
}
_COUNTER_FIELDS = ("backend_steps", "processed_prefill_tokens", "preemptions")

# Snapshot fields that are not exported as live gauges (histograms and counters instead).
_NOT_GAUGES = (frozenset(PREFILL_WAIT_FIELDS) | frozenset(ITERATION_TOKEN_FIELDS) | frozenset(_COUNTER_FIELDS)
               | frozenset(_STEP_PHASE_FIELDS))

_COUNTER_DOCS = {
    "backend_steps": "Backend steps run",
    "processed_prefill_tokens": "Tokens submitted in prefill forwards: prompt tokens plus the decode rows of mixed batches",
    "preemptions": "Requests paused to free KV cache (vLLM's preemptions)",
}


def token_buckets(max_len: int) -> Tuple[int, ...]:
    """1-2-5 bucket bounds up to ``max_len`` (as vLLM buckets per-request token counts)."""
    bounds: List[int] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_len:
                return tuple(bounds) if bounds else (max(1, max_len),)
            bounds.append(step * scale)
        scale *= 10


class _SharedStatsCollector:
    """Exposes the router's and rank 0's shared values at scrape time."""

    def __init__(self, stats: ShmStats, strategy: str):
        self.stats = stats
        self.strategy = strategy

    def collect(self) -> Iterable[Metric]:
        snapshot = dict(self.stats.snapshot())
        # The router counts every request it handed to the ranks as running; a request paused for
        # KV memory holds none and waits to resume, and one held until its grammar compiled has not
        # started: vLLM (whose names these gauges also carry) counts both as waiting (preempted,
        # WAITING_FOR_FSM). The values are written by different processes at different moments,
        # so the move is clamped.
        stalled = snapshot.get("paused_requests", 0) + snapshot.get("grammar_held_requests", 0)
        stalled = min(stalled, snapshot.get("running_requests", 0))
        if stalled > 0:
            snapshot["running_requests"] -= stalled
            snapshot["waiting_requests"] += stalled
        labels = ["strategy"]
        yield from histogram_families(snapshot, self.strategy)
        yield from iteration_tokens_family(snapshot, self.strategy)
        for name, value in snapshot.items():
            if name in _NOT_GAUGES:
                continue  # exposed as histograms above or as counters below
            gauge = GaugeMetricFamily(f"lightllm_{name}", f"Live value of {name}", labels=labels)
            gauge.add_metric([self.strategy], value)
            yield gauge
        total = snapshot["kv_total_tokens"]
        usage = GaugeMetricFamily(
            "lightllm_kv_cache_usage_ratio", "Share of KV cache slots in use, 0-1 (prefix-cached slots that can be evicted count as free)", labels=labels
        )
        # The fields are read at different moments, so keep the ratio inside [0, 1].
        used = 1.0 - snapshot["kv_allocatable_tokens"] / total if total > 0 else 0.0
        usage.add_metric([self.strategy], min(1.0, max(0.0, used)))
        yield usage
        for name in _COUNTER_FIELDS:
            counter = CounterMetricFamily(f"lightllm_{name}", _COUNTER_DOCS[name], labels=labels)
            counter.add_metric([self.strategy], snapshot[name])
            yield counter
        phases = CounterMetricFamily(
            "lightllm_step_seconds", "Backend step time by phase, cumulative seconds", labels=labels + ["phase"]
        )
        for field, phase in _STEP_PHASE_FIELDS.items():
            phases.add_metric([self.strategy, phase], snapshot[field] / 1e6)
        yield phases


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Exporter:
    """Writes the measured families with ``model_name`` added, plus their vLLM copies.

    It writes the text format itself (without ``_created`` samples, which Prometheus does not
    read from it): a scrape then costs a third of what copying every family and rendering it
    with ``generate_latest`` costs, and /metrics is polled often by tools waiting for idle.
    """

    def __init__(self, source: CollectorRegistry, model_name: str):
        self.source = source
        self.model_name = model_name
        # (vLLM copy?, label items) -> rendered label set; the label sets are few and fixed.
        self._label_text: Dict[Tuple[bool, Tuple[Tuple[str, str], ...]], str] = {}

    def _labels(self, vllm: bool, labels: Dict[str, str]) -> str:
        key = (vllm, tuple(labels.items()))
        text = self._label_text.get(key)
        if text is None:
            shown = {"model_name": self.model_name}
            if vllm:
                shown["engine"] = VLLM_ENGINE
            for name, value in labels.items():
                name = _VLLM_LABEL_NAMES.get(name, name) if vllm else name
                if name is not None:
                    shown[name] = value
            # Sorted by name, as prometheus_client writes them.
            text = "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in sorted(shown.items())) + "}"
            self._label_text[key] = text
        return text

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4)."""
        lines: List[str] = []
        for family in self.source.collect():
            help_text = family.documentation.replace("\\", "\\\\").replace("\n", "\\n")
            for name, vllm in [(family.name, False)] + [(alias, True) for alias in VLLM_NAMES.get(family.name, ())]:
                shown = f"{name}_total" if family.type == "counter" else name
                lines.append(f"# HELP {shown} {help_text}")
                lines.append(f"# TYPE {shown} {family.type}")
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue
                    suffix = sample.name[len(family.name):]
                    lines.append(f"{name}{suffix}{self._labels(vllm, sample.labels)} {floatToGoString(sample.value)}")
        return "\n".join(lines) + "\n"


class ServerMetrics:
    """Request counts, token counts and latencies, under our names and vLLM's."""

    def __init__(self, strategy: str, stats: Optional[ShmStats], model_name: str = "", max_len: int = 1 << 20):
        self.strategy = strategy
        self.model_name = model_name
        # Measured once here; /metrics shows it with labels added and vLLM copies.
        measured = self.measured = CollectorRegistry()
        labels = ["strategy"]
        self.requests = Counter("lightllm_requests", "Finished requests", labels + ["finish_reason"], registry=measured)
        self.prompt_tokens = Counter("lightllm_prompt_tokens", "Prompt tokens received", labels, registry=measured)
        self.cached_tokens = Counter("lightllm_cached_prompt_tokens", "Prompt tokens served from the prefix cache", labels, registry=measured)
        # Only prompts that read the cache: none with the cache off, nor a prompt_logprobs request
        # (it computes every position), so hits / queries is the hit rate vLLM's dashboards show.
        self.cache_queries = Counter("lightllm_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                     labels, registry=measured)
        self.generated_tokens = Counter("lightllm_generated_tokens", "Tokens generated", labels, registry=measured)
        self.ttft = Histogram("lightllm_time_to_first_token_seconds", "Time to first token", labels, buckets=_LATENCY_BUCKETS, registry=measured)
        self.tpot = Histogram("lightllm_time_per_output_token_seconds", "Gap between consecutive tokens", labels, buckets=_LATENCY_BUCKETS, registry=measured)
        self.e2e = Histogram("lightllm_request_latency_seconds", "End-to-end request latency", labels, buckets=_LATENCY_BUCKETS, registry=measured)
        lengths = token_buckets(max_len)
        self.request_prompt = Histogram("lightllm_request_prompt_tokens", "Prompt tokens per request", labels, buckets=lengths, registry=measured)
        self.request_generation = Histogram("lightllm_request_generation_tokens", "Generated tokens per request", labels, buckets=lengths, registry=measured)
        self.request_max_new_tokens = Histogram(
            "lightllm_request_max_new_tokens", "Most tokens a request may generate (its max_tokens)", labels, buckets=lengths,
            registry=measured)
        # Once per prompt of an accepted API request (its choices share it), as vLLM observes it
        # once per request whatever its n.
        self.request_params_n = Histogram("lightllm_request_params_n", "The n parameter of each request (choices asked per prompt)",
                                          labels, buckets=N_BUCKETS, registry=measured)
        self.request_decode = Histogram(
            "lightllm_request_decode_seconds", "Time from a request's first token to its end", labels, buckets=_LATENCY_BUCKETS, registry=measured
        )
        self.request_tpot = Histogram(
            "lightllm_request_time_per_output_token_seconds",
            "Mean gap between a request's tokens after the first",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=measured,
        )
        # From the moment rank 0 first schedules a request (its first prefill chunk is submitted).
        # Only a server with ranks of its own sees that moment: a PD master exports none of the
        # three rather than three histograms that stay empty (its nodes export theirs).
        self._scheduled = stats is not None
        if self._scheduled:
            self.request_queue = Histogram(
                "lightllm_request_queue_seconds", "Time from submission to first scheduling", labels, buckets=_LATENCY_BUCKETS, registry=measured
            )
            self.request_prefill = Histogram(
                "lightllm_request_prefill_seconds", "Time from first scheduling to the first token", labels, buckets=_LATENCY_BUCKETS, registry=measured
            )
            self.request_inference = Histogram(
                "lightllm_request_inference_seconds", "Time from first scheduling to the end of the request", labels, buckets=_LATENCY_BUCKETS, registry=measured
            )
        if stats is not None:
            # None: a server without a backend of its own (a PD master) has no shared stats.
            measured.register(_SharedStatsCollector(stats, strategy))
        self._exporter = _Exporter(measured, model_name)
        # Every finish reason is exported from the start (as vLLM does), so rate() sees 0, not nothing.
        for reason in FINISH_REASON_NAMES.values():
            if reason is not None:
                self.requests.labels(strategy, reason)
        # vLLM's reason for output its repetition detector cut off: no such detector runs here,
        # so it stays 0, but a vLLM panel or alert on it finds its series.
        self.requests.labels(strategy, VLLM_REPETITION_REASON)
        # Label lookups cost more than the observations: bind every child once.
        self._ttft = self.ttft.labels(strategy)
        self._tpot = self.tpot.labels(strategy)
        self._e2e = self.e2e.labels(strategy)
        self._prompt = self.prompt_tokens.labels(strategy)
        self._cached = self.cached_tokens.labels(strategy)
        self._cache_queries = self.cache_queries.labels(strategy)
        self._generated = self.generated_tokens.labels(strategy)
        self._request_prompt = self.request_prompt.labels(strategy)
        self._request_generation = self.request_generation.labels(strategy)
        self._request_max_new_tokens = self.request_max_new_tokens.labels(strategy)
        self._request_decode = self.request_decode.labels(strategy)
        self._request_params_n = self.request_params_n.labels(strategy)
        self._request_tpot = self.request_tpot.labels(strategy)
        if self._scheduled:
            self._request_queue = self.request_queue.labels(strategy)
            self._request_prefill = self.request_prefill.labels(strategy)
            self._request_inference = self.request_inference.labels(strategy)

    def on_submit(self, prompt_tokens: int, counting: RequestCounting = RequestCounting.FULL,
                  reads_cache: bool = True) -> None:
        """A request was handed to the router (a decode node counts its prompt when the KV arrives).

        ``reads_cache``: its prompt is looked up in the prefix cache (the cache is on and the
        request asks no prompt_logprobs).
        """
        if counting is RequestCounting.FULL:
            self._prompt.inc(prompt_tokens)
            if reads_cache:
                self._cache_queries.inc(prompt_tokens)

    def on_request_params(self, n: int, prompts: int = 1) -> None:
        """An API request asking ``n`` choices for each of its ``prompts`` prompts was accepted
        (its generations started): one observation of ``n`` per prompt."""
        for _ in range(prompts):
            self._request_params_n.observe(n)

    def on_first_token(
        self, seconds: float, cached_tokens: int, counting: RequestCounting = RequestCounting.FULL,
        prompt_tokens: int = 0,
    ) -> None:
        """The first token arrived (on a decode node: the prefill node's token, with the KV).

        ``prompt_tokens``: the request's prompt, counted now by a request whose counting leaves
        it out at submission (a decode node's).
        """
        self._ttft.observe(seconds)
        if counting is RequestCounting.DECODE_NODE_OWN_WORK:
            # The prompt is admitted now; the token and its cache hit are the prefill node's.
            self._prompt.inc(prompt_tokens)
            return
        self._cached.inc(cached_tokens)
        self._generated.inc()

    def on_next_token(self, seconds: float) -> None:
        """A later token arrived ``seconds`` after the previous one."""
        self._tpot.observe(seconds)
        self._generated.inc()

    def on_finish(
        self,
        finish_reason: str,
        completion_tokens: int,
        seconds: float,
        *,
        prompt_tokens: int,
        first_token_seconds: Optional[float],
        queue_seconds: Optional[float] = None,
        max_new_tokens: Optional[int] = None,
        uncounted_tokens: int = 0,
        counting: RequestCounting = RequestCounting.FULL,
    ) -> None:
        """A request ended ``seconds`` after submission; its first token came after ``first_token_seconds``.

        ``max_new_tokens`` is the completion length it asked for (None: not known, not observed).
        ``uncounted_tokens``: generated tokens its client never took (it left with them queued); the
        tokens counter counts them now, so it stays the sum of the per-request histogram.

        ``queue_seconds`` (None: never scheduled) is submission to first scheduling; the prefill
        and inference times are measured from that moment, as vLLM measures them.

        ``counting`` :attr:`~RequestCounting.DECODE_NODE_OWN_WORK`: a request whose first token
        (the prefill node's, with the KV) never came is not counted at all.
        """
        # Gaps between the answer's tokens, all of which this node timed (the decode steps), also
        # on a decode node, whose own token count leaves out the prefill node's first token.
        token_gaps = completion_tokens - 1
        if counting is RequestCounting.DECODE_NODE_OWN_WORK:
            if first_token_seconds is None:
                # No KV (and first token) came: a released reservation, not a request this decode
                # node ran (see RequestCounting).
                return
            completion_tokens -= 1  # the first token is the prefill node's
        self.requests.labels(self.strategy, finish_reason).inc()
        if uncounted_tokens > 0:
            self._generated.inc(uncounted_tokens)
        self._e2e.observe(seconds)
        self._request_prompt.observe(prompt_tokens)
        self._request_generation.observe(completion_tokens)
        if max_new_tokens is not None:
            self._request_max_new_tokens.observe(max_new_tokens)
        if first_token_seconds is not None:
            decode = max(0.0, seconds - first_token_seconds)
            self._request_decode.observe(decode)
            # A one-token answer has no gap: 0, as vLLM records it, so the _count is every request
            # that got a first token, as vLLM's is.
            self._request_tpot.observe(decode / token_gaps if token_gaps > 0 else 0.0)
        if queue_seconds is not None and self._scheduled:
            self._request_queue.observe(queue_seconds)
            self._request_inference.observe(max(0.0, seconds - queue_seconds))
            if first_token_seconds is not None:
                self._request_prefill.observe(max(0.0, first_token_seconds - queue_seconds))

    def render(self) -> tuple[bytes, str]:
        """Body and content type for /metrics."""
        return self._exporter.render().encode(), CONTENT_TYPE_LATEST
