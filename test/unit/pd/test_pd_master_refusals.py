"""Requests the PD master refuses with a 503: what the client reads and what ``/metrics`` counts.

The master is the real one over loopback HTTP, the nodes are stand-ins (``pd_master_support``).
A refused request is a failed request too: ``lightllm_pd_failed_requests_total`` counts it under
the reason of its error code, like the failures of requests that ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from pd_master_support import Cluster, generate, metric_value
from lightllm.server.pd.master.metrics import FAILURE_REASONS

TRANSFER_TIMEOUT_S = 1


@pytest.fixture(name="unregistered")
def unregistered_fixture(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A cluster whose nodes have not registered yet, its master without busy retries (read at start-up)."""
    monkeypatch.setenv("LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS", "0")
    cluster = Cluster(str(tiny_llama_dir), "--pd_transfer_timeout_seconds", str(TRANSFER_TIMEOUT_S), register=False)
    yield cluster
    cluster.stop()


def _failed(cluster: Cluster) -> dict:
    text = httpx.get(f"{cluster.master.url}/metrics", timeout=10).text
    return {reason: metric_value(text, "lightllm_pd_failed_requests_total", reason=reason)
            for reason in FAILURE_REASONS}


def _refused(cluster: Cluster, code: str) -> str:
    response = generate(cluster, "hello", 3)
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    # A missing node or a busy one clears by itself; a node that fails its transfer set-up may not.
    assert response.headers.get("retry-after") == {"pd_not_ready": "2", "server_busy": "1"}.get(code), code
    return error["message"]


def test_every_refusal_is_counted_under_its_reason(unregistered: Cluster) -> None:
    cluster = unregistered
    assert set(_failed(cluster).values()) == {0.0}  # every reason exported from the start
    _refused(cluster, "pd_not_ready")  # no node registered yet
    for node in (cluster.prefill, cluster.decode):
        node.register()
    cluster.decode.refuse_setup = True
    _refused(cluster, "pd_transfer_setup_failed")
    cluster.decode.refuse_setup = False
    cluster.decode.busy = True
    _refused(cluster, "server_busy")
    cluster.decode.busy = False
    assert generate(cluster, "hello", 3).status_code == 200  # a success counts nowhere here
    expected = {reason: 0.0 for reason in FAILURE_REASONS}
    expected.update(not_ready=1.0, transfer_setup_failed=1.0, busy=1.0)
    assert _failed(cluster) == expected


def test_a_node_that_is_up_but_does_not_answer_its_transfer_setup_is_named_as_such(unregistered: Cluster) -> None:
    cluster = unregistered
    for node in (cluster.prefill, cluster.decode):
        node.register()
    cluster.decode.setup_delay = TRANSFER_TIMEOUT_S + 4.0  # it accepts the call and answers too late
    message = _refused(cluster, "pd_transfer_setup_failed")
    assert f"did not answer /pd/node/transfer_setup within {TRANSFER_TIMEOUT_S} s" in message, message
    assert "could not be reached" not in message and "ReadTimeout" not in message
    assert cluster.decode.setups  # it was reached: the call arrived
