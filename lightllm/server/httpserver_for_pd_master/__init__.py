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

Nothing here loads a model, torch, shared memory or zmq: the master is a plain HTTP process.
The ``--run_mode pd_master|prefill|decode`` flags are not wired yet.
"""
