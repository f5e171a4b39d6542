"""Prometheus metrics of a PD node's control endpoints (prefill or decode node).

Registered into the server's own measured registry (``ServerMetrics.measured``), so the node's
``/metrics`` shows them next to the normal server metrics, with the ``model_name`` label added.
Every series carries the node's ``role`` (``prefill`` or ``decode``):

* ``lightllm_pd_kv_transfer_seconds`` / ``lightllm_pd_kv_transfer_bytes`` (histograms): one
  observation per KV transfer this side completed (prefill: at hand-off; decode: at the first
  token, whose KV just arrived);
* ``lightllm_pd_failed_transfers_total``: requests whose KV transfer failed or whose transfer
  group broke;
* ``lightllm_pd_expired_leases_total``: decode reservations freed because the KV did not arrive
  within their lease (the master's, at most ``--pd_reserve_lease_seconds``);
* ``lightllm_pd_busy_answers_total``: requests answered busy at once;
* ``lightllm_pd_segment_ends_total{reason}``: segments the decode node ended
  (``kv_pressure`` or ``segment_limit``), each continued by the master as a new segment.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from lightllm.server.pd.protocol.node_events import (
    BUSY,
    ERROR,
    LEASE_EXPIRED,
    SEGMENT_END,
    TRANSFER_BROKEN,
    TRANSFER_FAILED,
    PdNodeEvent,
)
from lightllm.server.pd.protocol.outcomes import SEGMENT_END_REASONS

TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# 4 KiB to 4 GiB in factors of 4: a few tokens of a tiny model up to long prompts of large ones.
TRANSFER_BYTES_BUCKETS = tuple(float(4096 * 4**power) for power in range(11))
# Error kinds (PdNodeEvent.error_kind) that count as a failed transfer.
FAILED_TRANSFER_KINDS = frozenset({TRANSFER_FAILED, TRANSFER_BROKEN})


class PdNodeMetrics:
    """Counts what a node's PD streams report; :meth:`observe` takes every event of every stream."""

    def __init__(self, registry: CollectorRegistry, role: str):
        self.role = role
        labels = ["role"]
        self.transfer_seconds = Histogram(
            "lightllm_pd_kv_transfer_seconds", "Seconds this node spent on one request's KV transfer", labels,
            buckets=TRANSFER_SECONDS_BUCKETS, registry=registry,
        ).labels(role)
        self.transfer_bytes = Histogram(
            "lightllm_pd_kv_transfer_bytes", "Bytes of KV one request's transfer moved", labels,
            buckets=TRANSFER_BYTES_BUCKETS, registry=registry,
        ).labels(role)
        self.failed_transfers = Counter(
            "lightllm_pd_failed_transfers", "Requests whose KV transfer failed or whose transfer group broke",
            labels, registry=registry,
        ).labels(role)
        self.expired_leases = Counter(
            "lightllm_pd_expired_leases", "Decode KV reservations freed because the KV did not arrive in time",
            labels, registry=registry,
        ).labels(role)
        self.busy_answers = Counter(
            "lightllm_pd_busy_answers", "Requests this node answered busy at once", labels, registry=registry,
        ).labels(role)
        self.segment_ends = Counter(
            "lightllm_pd_segment_ends", "Segments the decode node ended before the request finished",
            labels + ["reason"], registry=registry,
        )
        # Every reason exists from the start, so rate() sees 0 rather than nothing.
        for reason in SEGMENT_END_REASONS:
            self.segment_ends.labels(role, reason)

    def observe(self, event: PdNodeEvent) -> None:
        """Account for one event a node stream sends."""
        if event.transfer_seconds > 0 or event.transfer_bytes > 0:
            self.transfer_seconds.observe(event.transfer_seconds)
            self.transfer_bytes.observe(event.transfer_bytes)
        kind = event.kind
        if kind == BUSY:
            self.busy_answers.inc()
        elif kind == SEGMENT_END:
            self.segment_ends.labels(self.role, event.reason or "unknown").inc()
        elif kind == ERROR:
            if event.error_kind in FAILED_TRANSFER_KINDS:
                self.failed_transfers.inc()
            elif event.error_kind == LEASE_EXPIRED:
                self.expired_leases.inc()
