"""The PD master: membership of prefill/decode nodes and the dispatch policy of its requests.

Modules (one concept each):

* :mod:`.node_registry` -- the live node set: registration, heartbeats (load, state), expiry, readiness.
* :mod:`.expiry_sweeper` -- the background task that drops silent nodes on time.
* :mod:`.membership_api` -- the HTTP endpoints nodes talk to, and the master's readiness probe.
* :mod:`.node_selector` -- placement: which serving node of a role gets the next request.
* :mod:`.busy_retry` -- what the master does when a node answers busy.
* :mod:`.continuation` -- the segments of a generation and their inference priority on P.
* :mod:`.node_streams` -- the master's HTTP client of the node control endpoints (NDJSON).
* :mod:`.pair_setup` -- the table of set-up P/D pairs, their epochs, KV transfer setup and teardown.
* :mod:`.request_run` -- one request's node streams, bounded waits and failure.
* :mod:`.segment_flow` -- one segment: decode reserves, prefill, hand-off, decode.
* :mod:`.request_accounting` -- one request's token count, usage and request metrics.
* :mod:`.manager` -- :class:`PdMasterManager`, the public API's request manager.
* :mod:`.metrics` -- the master's Prometheus metrics.

What a node registers with and sends back is in :mod:`lightllm.server.pd.protocol`; the start-up
of ``--run_mode pd_master`` is :mod:`lightllm.server.launch.pd_master`. Nothing here loads model weights, shared memory or zmq: the master is a plain HTTP process.
"""
