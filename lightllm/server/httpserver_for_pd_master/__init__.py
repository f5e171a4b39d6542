"""The PD master: membership of prefill/decode nodes and the dispatch policy of its requests.

Modules (one concept each):

* :mod:`.node_info` -- what a node sends when it registers, and the P/D compatibility rules.
* :mod:`.node_registry` -- the live node set: registration, heartbeats, expiry, readiness.
* :mod:`.expiry_sweeper` -- the background task that drops silent nodes on time.
* :mod:`.membership_api` -- the HTTP endpoints nodes talk to, and the master's readiness probe.
* :mod:`.node_client` -- the node side: register, heartbeat, notice a dead or restarted master.
* :mod:`.node_selector` -- which alive node of a role gets the next request.
* :mod:`.busy_retry` -- what the master does when a node answers busy.
* :mod:`.continuation` -- the segments of a generation and their inference priority on P.
* :mod:`.node_streams` -- the master's HTTP client of the node control endpoints (NDJSON).
* :mod:`.pair_setup` -- the current P/D pair, its epoch and its KV transfer setup.
* :mod:`.request_run` -- one request's node streams, bounded waits and failure.
* :mod:`.segment_flow` -- one segment: decode reserves, prefill, hand-off, decode.
* :mod:`.master_manager` -- :class:`PdMasterManager`, the public API's request manager.
* :mod:`.master_metrics` -- the master's Prometheus metrics.
* :mod:`.master_start` -- ``--run_mode pd_master``: build and serve the master.

Nothing here loads model weights, shared memory or zmq: the master is a plain HTTP process.
"""
