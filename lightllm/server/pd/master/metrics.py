"""Prometheus metrics of the PD master (its ``/metrics``).

The public request metrics (TTFT, inter-token latency, end-to-end latency, token counts, finish
reasons, and their ``vllm:*`` copies) are the normal server's
:class:`~lightllm.server.httpserver.metrics.ServerMetrics`, measured where the client sees them,
with ``strategy="pd_master"`` (the prefill-queue strategy runs on the prefill node, which
exports its own).  The PD families:

* ``lightllm_pd_nodes_alive{role}`` -- live nodes per role (gauge, read at scrape time);
* per live node, gauges labelled ``node_id`` and ``role`` (read at scrape time):
  ``lightllm_pd_node_serving`` (1 serving, 0 draining), ``lightllm_pd_node_in_flight_requests``
  (requests the master placed there and has not seen leave), and the node's last load report
  ``lightllm_pd_node_queued_prefill_tokens``, ``lightllm_pd_node_running_requests``,
  ``lightllm_pd_node_free_kv_tokens``, ``lightllm_pd_node_kv_capacity_tokens`` (a field the node
  has not reported has no sample);
* ``lightllm_pd_busy_answers_total{role}`` -- busy answers of the nodes;
* ``lightllm_pd_busy_retries_total`` -- retries after a busy answer
  (``LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS`` > 0);
* ``lightllm_pd_phase_seconds{phase}`` -- ``reserve`` (D's reservation answer), ``prefill`` (P's
  first token after dispatch), ``transfer`` (P's first token to D's echo of it: the KV moved and
  D admitted the request), ``first_decode_token`` (the echo to D's first generated token);
* ``lightllm_pd_continuation_segments_total`` -- continuation segments dispatched;
* ``lightllm_pd_master_stalled_seconds_total`` -- time the master's own event loop did not run
  beyond its expiry sweep (:mod:`.stall_watch`; read at scrape time);
* ``lightllm_pd_failed_requests_total{reason}`` -- requests that ended with an error: the
  failures of a request that ran (:data:`RUN_FAILURE_REASONS`) and the 503 refusals of one that
  could not start (:data:`REFUSAL_REASONS`, by the error code the client got).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Tuple

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from lightllm.server.httpserver.metrics import ServerMetrics
from lightllm.server.pd.protocol.node_info import ROLES
from lightllm.server.pd.master.node_registry import NodeRegistry
from lightllm.server.pd.protocol.membership import NodeLoad

MASTER_STRATEGY_LABEL = "pd_master"
PHASES = ("reserve", "prefill", "transfer", "first_decode_token")
RUN_FAILURE_REASONS = ("timeout", "node_error", "transfer_failed", "node_lost", "node_unreachable", "protocol",
                       "stopped", "generation_failed", "grammar_failed")
# The reason of a request refused with a 503, by its error code; any other code (the master
# stopping or failing) counts as "stopped", like the requests in flight it ends then.
REFUSAL_REASONS = {"pd_not_ready": "not_ready", "pd_transfer_setup_failed": "transfer_setup_failed",
                   "server_busy": "busy"}
FAILURE_REASONS = RUN_FAILURE_REASONS + tuple(REFUSAL_REASONS.values())
_PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


# (metric name, help, NodeLoad field) of the per-node load gauges.
_LOAD_GAUGES = tuple(
    (f"lightllm_pd_node_{name}", f"{text} (the node's last heartbeat report)", name)
    for name, text in (
        ("queued_prefill_tokens", "Prompt tokens waiting to be prefilled on the node"),
        ("running_requests", "Requests the node holds"),
        ("free_kv_tokens", "KV token slots of the node neither used nor reserved"),
        ("kv_capacity_tokens", "KV token slots of the node"),
    )
)
assert {field for _, _, field in _LOAD_GAUGES} == set(NodeLoad.__dataclass_fields__)


class _NodesCollector:
    def __init__(self, registry: NodeRegistry, in_flight: Optional[Callable[[str], int]]) -> None:
        self.registry = registry
        self.in_flight = in_flight

    def collect(self) -> Iterable[Metric]:
        gauge = GaugeMetricFamily("lightllm_pd_nodes_alive", "Live PD nodes per role", labels=["role"])
        for role in ROLES:
            gauge.add_metric([role], len(self.registry.alive(role)))
        yield gauge
        labels = ["node_id", "role"]
        serving = GaugeMetricFamily("lightllm_pd_node_serving", "1 while the PD node takes new requests, "
                                    "0 while it drains or after its port refused the master", labels=labels)
        in_flight = GaugeMetricFamily("lightllm_pd_node_in_flight_requests", "Requests the master placed on the "
                                      "PD node and has not seen leave it", labels=labels)
        loads = [(GaugeMetricFamily(name, text, labels=labels), field) for name, text, field in _LOAD_GAUGES]
        for info in self.registry.alive():
            state = self.registry.state(info.node_id)
            if state is None:
                continue
            values = [info.node_id, info.role]
            serving.add_metric(values, 1 if state.serving else 0)
            in_flight.add_metric(values, self.in_flight(info.node_id) if self.in_flight is not None else 0)
            for family, field in loads:
                value = getattr(state.load, field) if state.load is not None else None
                if value is not None:
                    family.add_metric(values, value)
        yield serving
        yield in_flight
        for family, _ in loads:
            yield family
        watch = self.registry.stall_watch
        yield CounterMetricFamily("lightllm_pd_master_stalled_seconds", "Seconds the PD master's event loop did not "
                                  "run beyond its expiry sweep (not counted against the nodes' heartbeats)",
                                  value=watch.stalled_s if watch is not None else 0.0)


class MasterMetrics:
    """The request metrics of :class:`ServerMetrics` plus the PD master's own families."""

    def __init__(self, registry: NodeRegistry, model_name: str, max_len: int,
                 in_flight: Optional[Callable[[str], int]] = None) -> None:
        self.requests = ServerMetrics(MASTER_STRATEGY_LABEL, None, model_name, max_len)
        measured = self.requests.measured
        self.busy_answers = Counter("lightllm_pd_busy_answers", "Busy answers of PD nodes", ["role"], registry=measured)
        self.busy_retries = Counter("lightllm_pd_busy_retries", "Dispatch retries after a busy answer", registry=measured)
        self.phase_seconds = Histogram("lightllm_pd_phase_seconds", "Latency of each phase of a PD request segment",
                                       ["phase"], buckets=_PHASE_BUCKETS, registry=measured)
        self.continuation_segments = Counter("lightllm_pd_continuation_segments", "Continuation segments dispatched",
                                             registry=measured)
        self.failed_requests = Counter("lightllm_pd_failed_requests", "PD requests that ended with an error",
                                       ["reason"], registry=measured)
        measured.register(_NodesCollector(registry, in_flight))
        # Every label value exported from the start, so rate() sees 0, not nothing.
        for role in ROLES:
            self.busy_answers.labels(role)
        for phase in PHASES:
            self.phase_seconds.labels(phase)
        for reason in FAILURE_REASONS:
            self.failed_requests.labels(reason)

    def on_busy(self, role: str) -> None:
        """A node answered busy."""
        self.busy_answers.labels(role).inc()

    def on_retry(self, role: str) -> None:
        """The master retries after a busy answer (the busy policy's ``on_retry``)."""
        self.busy_retries.inc()

    def on_phase(self, phase: str, seconds: float) -> None:
        """One phase of a segment took ``seconds``."""
        self.phase_seconds.labels(phase).observe(max(0.0, seconds))

    def on_continuation(self) -> None:
        """A continuation segment was dispatched."""
        self.continuation_segments.inc()

    def on_failure(self, reason: str) -> None:
        """A request ended with an error of kind ``reason`` (one of :data:`FAILURE_REASONS`)."""
        self.failed_requests.labels(reason).inc()

    def on_refusal(self, code: str) -> None:
        """A request was refused with a 503 of error ``code`` (``pd_not_ready``, ``server_busy``, ...)."""
        self.on_failure(REFUSAL_REASONS.get(code, "stopped"))

    def render(self) -> Tuple[bytes, str]:
        """Body and content type for /metrics."""
        return self.requests.render()
