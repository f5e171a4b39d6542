"""A PD request whose client left is aborted on the nodes and never continued as a new segment.

Against the node stand-ins (pd_node_stand_in.py) over real HTTP: the decode stand-in ends a
segment every 2 tokens, so a long generation is a chain of short continuation segments, and
a client that gives up after a fraction of a second must stop that chain at once rather than
after the master's next disconnect poll (which let several more segments be placed for nobody).
"""

from __future__ import annotations

import time

import httpx
import pytest

from pd_master_support import (  # noqa: F401 - cluster_fixture is the "cluster" fixture
    Cluster,
    cluster_fixture,
    metric_value,
)

CLIENT_TIMEOUT_S = 0.3


def test_a_client_that_left_gets_no_further_continuation_segment(cluster: Cluster) -> None:
    cluster.decode.segment_limit = 2
    cluster.decode.token_delay = 0.05  # a segment takes ~0.1 s: several would fit in one 0.5 s poll
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{cluster.master.url}/generate", timeout=CLIENT_TIMEOUT_S,
                   json={"inputs": "a long story", "parameters": {"max_new_tokens": 200}})
    left_at = time.monotonic()
    deadline = left_at + 5
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{cluster.master.url}/metrics").text
        if metric_value(metrics, "lightllm_requests_total", finish_reason="abort") == 1:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the master never ended the request whose client left")
    time.sleep(0.5)  # anything still placed after the client left would show up by now
    segments = [body["segment_index"] for body in cluster.prefill.bodies]
    # Segments placed while the client was there: ~0.3 s / ~0.1 s each, plus the one that may have
    # been starting as it left.  Polling alone placed about twice as many.
    assert len(segments) <= 5, f"segments placed: {segments}"
