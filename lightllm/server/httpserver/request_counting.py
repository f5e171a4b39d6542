"""Which of a server's request counters one request feeds (see docs/EN/metrics.md)."""

from __future__ import annotations

import enum

from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE


class RequestCounting(enum.Enum):
    """Which counters of :class:`~lightllm.server.httpserver.metrics.ServerMetrics` a request feeds.

    ``FULL``: every counter, from submission on (a normal request, a PD prefill node's, the PD
    master's).

    ``DECODE_NODE_OWN_WORK``: a PD decode node's request starts as a KV reservation; the prefill
    node runs the prompt and generates the first token, which arrives here with the KV.  Only
    from then on is it this node's work: its prompt is counted then, its first token and that
    token's prefix-cache hit not at all (the prefill node generated and counted them), and a
    reservation released before the KV came (the prefill node's first token finished the
    request, the client or master gave up during the prefill, or the node answered busy) is not
    a request this node finished -- the master counts it, and the busy answers and expired leases
    have counters of their own.
    """

    FULL = "full"
    DECODE_NODE_OWN_WORK = "decode_node_own_work"

    @classmethod
    def of(cls, spec: RequestSpec) -> RequestCounting:
        """The counting of the request ``spec`` describes: decided by its PD kind alone."""
        return cls.DECODE_NODE_OWN_WORK if spec.pd.kind == PD_KIND_DECODE else cls.FULL
