"""How the PD master handles busy, failing and lost nodes, against stand-ins over real HTTP.

The master is the real one (flags -> build_master -> create_app -> uvicorn); the prefill and
decode stand-ins (pd_node_stand_in.py) speak the node contract's NDJSON and register with the
real PdNodeClient.  Their knobs make a node busy, break or refuse the KV transfer
setup, expire a lease or go silent; these tests check the error a client gets, the retries, the
pair re-setup and that every node stream the master opened is closed again.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import httpx
import pytest

from pd_master_support import (  # noqa: F401 - cluster_fixture is the "cluster" fixture
    HEARTBEAT_S,
    MISSED,
    REQUEST_TIMEOUT,
    Cluster,
    cluster_fixture,
    generate,
    metric_value,
    sse_events,
)
from pd_node_stand_in import reference_tokens
from lightllm.server.http.errors import manager_error
from lightllm.server.manager_errors import ServerBusyError


@pytest.fixture(name="no_retry_cluster")
def no_retry_cluster_fixture(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A cluster whose master was started with the busy retry off (0; the default is 60 s)."""
    monkeypatch.setenv("LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS", "0")
    cluster = Cluster(str(tiny_llama_dir))
    yield cluster
    cluster.stop()


def test_busy_decode_is_an_immediate_503_naming_the_role(no_retry_cluster: Cluster) -> None:
    cluster = no_retry_cluster
    cluster.decode.busy = True
    started = time.monotonic()
    response = generate(cluster, "hello", 4)
    assert time.monotonic() - started < 5  # no retry with 0 (generous bound for a loaded machine)
    assert response.status_code == 503
    error = response.json()["error"]
    assert (error["code"], error["role"]) == ("server_busy", "decode")
    assert "decode node is busy" in error["message"]
    assert cluster.prefill.bodies == []  # decode reserves first: P never saw it
    metrics = httpx.get(f"{cluster.master.url}/metrics").text
    assert metric_value(metrics, "lightllm_pd_busy_answers_total", role="decode") == 1
    assert metric_value(metrics, "lightllm_pd_busy_retries_total") == 0

    cluster.decode.busy = False
    cluster.prefill.busy = True
    response = generate(cluster, "hello", 4)
    assert response.status_code == 503 and response.json()["error"]["role"] == "prefill"
    deadline = time.monotonic() + 5
    while len(cluster.decode.aborted) < 1:  # D's reservation was given back
        assert time.monotonic() < deadline, "the reservation of a request P refused was not closed"
        time.sleep(0.02)


@pytest.fixture(name="retrying_cluster")
def retrying_cluster_fixture(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A cluster whose master was started with a 20 s busy retry (the variable is read at start-up)."""
    monkeypatch.setenv("LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS", "20")
    cluster = Cluster(str(tiny_llama_dir))
    # Read once at start-up: changing the variable later changes nothing.
    monkeypatch.setenv("LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS", "not a number")
    yield cluster
    cluster.stop()


def test_busy_retry_succeeds_once_the_node_frees(retrying_cluster: Cluster) -> None:
    cluster = retrying_cluster
    cluster.decode.busy = True
    threading.Timer(0.6, lambda: setattr(cluster.decode, "busy", False)).start()
    response = generate(cluster, "hello", 3)
    assert response.status_code == 200, response.text
    assert response.json()["count_output_tokens"] == 3
    metrics = httpx.get(f"{cluster.master.url}/metrics").text
    assert metric_value(metrics, "lightllm_pd_busy_retries_total") >= 1
    assert metric_value(metrics, "lightllm_pd_busy_answers_total", role="decode") >= 1


def test_busy_body_names_the_role_only_when_there_is_one() -> None:
    with_role = manager_error(ServerBusyError("The decode node is busy", "decode")).to_dict()["error"]
    assert with_role == {"message": "The decode node is busy", "type": "service_unavailable_error", "param": None,
                         "code": "server_busy", "role": "decode"}
    assert "role" not in manager_error(ServerBusyError("no free request slot")).to_dict()["error"]


def test_transfer_broken_sets_the_pair_up_again(cluster: Cluster) -> None:
    assert generate(cluster, "hello", 3).status_code == 200
    cluster.decode.epoch = None  # D lost its transfer handles: it answers transfer_broken
    response = generate(cluster, "hello", 3)
    assert response.status_code == 200, response.text
    assert [s["epoch"] for s in cluster.prefill.setups] == [s["epoch"] for s in cluster.decode.setups] == [1, 2]
    assert cluster.prefill.bodies[-1]["epoch"] == 2


def test_transfer_failure_mid_flow_ends_the_stream_with_an_error_and_resets_the_pair(cluster: Cluster) -> None:
    cluster.prefill.fail_transfer = True
    response = httpx.post(f"{cluster.master.url}/generate_stream", timeout=REQUEST_TIMEOUT,
                          json={"inputs": "hello", "parameters": {"max_new_tokens": 5}})
    events = sse_events(response)
    assert "token" in events[0]  # P's first token reached the client at once
    error = events[-1]["error"]
    assert error["code"] == "pd_transfer_failed" and "checksum mismatch" in error["message"]
    deadline = time.monotonic() + 5
    while 1 not in cluster.decode.aborted:  # D's reservation was given back
        assert time.monotonic() < deadline, "the decode stream of a failed transfer was not closed"
        time.sleep(0.02)
    cluster.prefill.fail_transfer = False
    assert generate(cluster, "hello", 3).status_code == 200
    assert [s["epoch"] for s in cluster.prefill.setups] == [1, 2]
    metrics = httpx.get(f"{cluster.master.url}/metrics").text
    assert metric_value(metrics, "lightllm_pd_failed_requests_total", reason="transfer_failed") == 1


def test_a_request_that_fails_alone_on_a_healthy_node_gets_a_normal_servers_500(cluster: Cluster) -> None:
    """A grammar that failed in the prefill node's rank was a 503 pd_node_failed: it blamed a healthy
    node (load balancers take it out) and invited retries of a request that can never succeed."""
    cluster.prefill.fail_generation = "generation_failed"
    response = generate(cluster, "hello", 4)
    assert response.status_code == 500, response.text
    assert response.json()["error"]["code"] == "generation_failed"
    streamed = httpx.post(f"{cluster.master.url}/generate_stream", timeout=REQUEST_TIMEOUT,
                          json={"inputs": "hello", "parameters": {"max_new_tokens": 4}})
    # Before its first token a stream gets the same 500 (as on a normal server).
    assert streamed.status_code == 500 and streamed.json()["error"]["code"] == "generation_failed"
    cluster.prefill.fail_generation = ""
    assert generate(cluster, "hello", 3).status_code == 200  # the node serves on
    metrics = httpx.get(f"{cluster.master.url}/metrics").text
    assert metric_value(metrics, "lightllm_pd_failed_requests_total", reason="generation_failed") == 2
    assert metric_value(metrics, "lightllm_pd_failed_requests_total", reason="node_error") == 0


def test_a_grammar_that_could_not_go_on_on_a_node_gets_a_normal_servers_400(cluster: Cluster) -> None:
    """The client's own grammar, not a failed node nor a server fault: what a normal server answers."""
    cluster.prefill.fail_generation = "grammar_failed"
    response = generate(cluster, "hello", 4)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "grammar_failed"
    cluster.prefill.fail_generation = ""
    assert generate(cluster, "hello", 3).status_code == 200
    metrics = httpx.get(f"{cluster.master.url}/metrics").text
    assert metric_value(metrics, "lightllm_pd_failed_requests_total", reason="grammar_failed") == 1
    assert metric_value(metrics, "lightllm_requests_total", finish_reason="grammar_failed") == 1


def test_failed_pair_setup_is_a_503_and_is_retried_by_the_next_request(cluster: Cluster) -> None:
    cluster.decode.refuse_setup = True
    response = generate(cluster, "hello", 3)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "pd_transfer_setup_failed" and "could not start its transfer handle" in error["message"]
    assert cluster.decode.bodies == []
    cluster.decode.refuse_setup = False
    assert generate(cluster, "hello", 3).status_code == 200
    assert [s["epoch"] for s in cluster.decode.setups] == [1, 2]  # a failed setup's epoch is never reused


def test_dropped_decode_node_fails_its_stream_within_the_bound(cluster: Cluster) -> None:
    cluster.decode.token_delay = 0.05
    cluster.decode.silent_after = None
    received: List[Dict[str, Any]] = []
    with httpx.stream("POST", f"{cluster.master.url}/generate_stream", timeout=REQUEST_TIMEOUT,
                      json={"inputs": "hello", "parameters": {"max_new_tokens": 500}}) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                received.append(json.loads(line[6:]))
                if len(received) == 3:
                    break
        dropped_at = time.monotonic()
        cluster.decode.go_silent()
        for line in lines:
            if line.startswith("data: "):
                received.append(json.loads(line[6:]))
    waited = time.monotonic() - dropped_at
    # The registry's bound (interval x (missed + 0.5)), with slack for a loaded machine; the
    # decode token deadline (120 s) plays no part.
    assert waited < HEARTBEAT_S * (MISSED + 0.5) + 5
    error = received[-1]["error"]
    assert error["code"] == "pd_node_lost" and "decode" in error["message"]
    metrics = httpx.get(f"{cluster.master.url}/metrics").text
    assert metric_value(metrics, "lightllm_pd_failed_requests_total", reason="node_lost") == 1
    # No decode node any more: 503 pd_not_ready at once.
    response = generate(cluster, "hello", 3)
    assert response.status_code == 503 and response.json()["error"]["code"] == "pd_not_ready"


def _stream_with_prefill_lost(cluster: Cluster, lose_prefill: Callable[[], None]) -> List[Dict[str, Any]]:
    """Stream 12 tokens while D pauses after three: ``lose_prefill`` runs in the pause, then D goes
    on.  Returns the client's events, checked to be every reference token with no error."""
    cluster.decode.hold_after = 3
    prompt_ids = cluster.master.manager.served.encode_prompt("hello")
    received: List[Dict[str, Any]] = []
    with httpx.stream("POST", f"{cluster.master.url}/generate_stream", timeout=REQUEST_TIMEOUT,
                      json={"inputs": "hello", "parameters": {"max_new_tokens": 12}}) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                received.append(json.loads(line[6:]))
                if len(received) == 3:
                    break
        lose_prefill()
        cluster.decode.release_hold()
        for line in lines:
            if line.startswith("data: "):
                received.append(json.loads(line[6:]))
    assert all("error" not in event for event in received), received[-1]
    assert [event["token"]["id"] for event in received] == reference_tokens(prompt_ids, 12)
    assert received[-1]["finish_reason"] == "length"
    return received


def test_decode_only_work_survives_the_prefill_nodes_death(cluster: Cluster) -> None:
    """Once P handed the KV over, a request needs only D: losing P must not end its stream.

    D pauses after three tokens; P goes silent and the master drops it (readiness says so);
    then D goes on and the client gets every token, with no error. The pause makes the order
    certain without a timing assumption."""

    def drop_prefill() -> None:
        cluster.prefill.go_silent()
        deadline = time.monotonic() + 60
        while httpx.get(f"{cluster.master.url}/health").status_code == 200:
            assert time.monotonic() < deadline, "the master never dropped the silent prefill node"
            time.sleep(0.05)

    _stream_with_prefill_lost(cluster, drop_prefill)
    metrics = httpx.get(f"{cluster.master.url}/metrics").text
    assert metric_value(metrics, "lightllm_pd_failed_requests_total", reason="node_lost") == 0


def test_losing_the_prefill_node_after_the_echo_but_before_its_handed_off_line_does_not_fail(
        cluster: Cluster) -> None:
    """D echoes P's first token only once the KV arrived, so from the echo on the request needs
    nothing of P, even when P's handed_off line never reaches the master (P busy, then dead).

    P holds its handed_off line and then breaks its stream while D pauses after three tokens;
    then D goes on and the client gets every token, with no error."""
    cluster.prefill.cut_before_handed_off = True

    def break_prefill_stream() -> None:
        cluster.prefill.cut_stream()
        assert cluster.prefill.stream_cut.wait(30)
        # The master reads P's broken stream while it waits for D's next token (a shorter wait
        # could only let the old behaviour pass, never fail the right one).
        time.sleep(0.5)

    _stream_with_prefill_lost(cluster, break_prefill_stream)


def test_health_turns_503_after_a_node_goes_silent(cluster: Cluster) -> None:
    """A silent node is dropped by the heartbeat rule and readiness says which role is missing.
    The bound itself (docs/*/pd_deployment.md) is arithmetic on the flags; the deadline here only
    keeps a broken build from hanging the suite."""
    assert httpx.get(f"{cluster.master.url}/health").status_code == 200
    cluster.decode.go_silent()
    deadline = time.monotonic() + 60
    while True:
        health = httpx.get(f"{cluster.master.url}/health")
        if health.status_code == 503:
            break
        assert time.monotonic() < deadline, "/health never turned 503 after the decode node went silent"
        time.sleep(0.05)
    error = health.json()["error"]
    assert error["code"] == "pd_not_ready" and error["message"].endswith("no decode node registered")


def test_decode_failure_during_prefill_ends_the_request_at_once(cluster: Cluster) -> None:
    cluster.prefill.prefill_delay = 30.0
    cluster.decode.lease_expires = True
    started = time.monotonic()
    response = generate(cluster, "hello", 4)
    assert time.monotonic() - started < 15  # not after P's (30 s) first token
    assert response.status_code == 503
    error = response.json()["error"]
    # An expired lease is a KV transfer failure (the KV never arrived), as documented.
    assert error["code"] == "pd_transfer_failed" and "did not arrive within the lease" in error["message"]
    deadline = time.monotonic() + 5
    while 1 not in cluster.prefill.aborted:  # P's prefill was called off
        assert time.monotonic() < deadline, "the prefill stream was not closed"
        time.sleep(0.02)


def test_client_gone_closes_the_node_streams(cluster: Cluster) -> None:
    cluster.decode.token_delay = 0.05
    with httpx.stream("POST", f"{cluster.master.url}/generate_stream", timeout=REQUEST_TIMEOUT,
                      json={"inputs": "hello", "parameters": {"max_new_tokens": 500}}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 10
    while cluster.decode.aborted != [1]:
        assert time.monotonic() < deadline, "the decode stream was not closed after the client left"
        time.sleep(0.02)


def test_a_node_stream_is_cancelled_once_so_its_connection_closes_cleanly() -> None:
    """Closing a stream after cancelling it must not cancel the reader again.

    A second cancellation lands inside the reader's connection close and leaves a half-closed
    connection behind (seen as other requests' streams ending early under load).
    """
    import asyncio

    from lightllm.server.pd.master.node_streams import NodeStreams
    from pd_membership_support import node

    async def scenario() -> tuple[int, list]:
        accepted = asyncio.Event()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set()
            await reader.read()  # never answers; returns when the master closes the connection
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        nodes = NodeStreams()
        got: list = []
        stream = nodes.stream(node("d0", "decode", port), "/pd/node/decode", {}, got.append)
        await asyncio.wait_for(accepted.wait(), 10)
        await asyncio.sleep(0.05)  # the reader now waits for the answer
        stream.cancel()
        stream.cancel()
        pending = stream._task.cancelling()
        await stream.close()
        server.close()
        return pending, got

    pending, got = asyncio.run(scenario())
    assert pending == 1
    assert got == []  # a cancelled reader reports nothing (no STREAM_END for a stream it stopped)
