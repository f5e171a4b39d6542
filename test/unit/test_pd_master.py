"""The PD master's request flow against node stand-ins over real HTTP on loopback.

The master is the real one (flags -> build_master -> create_app -> uvicorn); the prefill and
decode stand-ins (pd_master_support.py) speak the node contract's NDJSON and register with the
real PdNodeClient.  Their "model" is a fixed function of the sequence, so every expected token
is computed independently of how the master split or forwarded the work.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import httpx
import pytest

from pd_master_support import HEARTBEAT_S, MISSED, Cluster, reference_tokens
from lightllm.server.api_cli import make_argument_parser
from lightllm.server.api_errors import manager_error
from lightllm.server.manager_errors import ServerBusyError
from lightllm.server.httpserver_for_pd_master.master_start import check_master_flags

TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture()
def cluster(tiny_llama_dir: Path):
    cluster = Cluster(str(tiny_llama_dir))
    yield cluster
    cluster.stop()


def _generate(cluster: Cluster, prompt: str, max_new_tokens: int, **extra: Any) -> httpx.Response:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "return_details": True, **extra}}
    return httpx.post(f"{cluster.master.url}/generate", json=body, timeout=TIMEOUT)


def _sse(response: httpx.Response) -> List[Dict[str, Any]]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not exported")


def test_normal_flow_tokens_in_order_echo_dropped_usage_once(cluster: Cluster) -> None:
    prompt = "hello there, general"
    prompt_ids = cluster.master.manager.encode_prompt(prompt)
    expected = reference_tokens(prompt_ids, 6)
    response = _generate(cluster, prompt, 6)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [token["id"] for token in answer["tokens"]] == expected  # P's first, then D's; the echo dropped
    # The master decodes the text from the token ids itself (the stand-ins' "text" is ignored).
    expected_text = cluster.master.manager.tokenizer.decode(expected, skip_special_tokens=True)
    assert answer["generated_text"] == [expected_text]
    assert answer["count_output_tokens"] == 6 and answer["prompt_tokens"] == len(prompt_ids)
    assert answer["finish_reason"] == "length" and answer["prompt_cache_len"] == cluster.prefill.cached_tokens
    (decode_body,), (prefill_body,) = cluster.decode.bodies, cluster.prefill.bodies
    assert decode_body["request_id"] == prefill_body["request_id"] == 1
    assert decode_body["prompt_ids"] == prefill_body["prompt_ids"] == prompt_ids
    assert (prefill_body["segment_index"], prefill_body["infer_high_priority"], prefill_body["kv_start"]) == (0, 0, 0)
    assert decode_body["epoch"] == prefill_body["epoch"] == 1
    # The pair was set up once, P before D, both pointed at P's transfer address.
    assert [s["epoch"] for s in cluster.prefill.setups] == [s["epoch"] for s in cluster.decode.setups] == [1]
    assert cluster.decode.setups[0]["prefill_transfer_address"] == cluster.prefill.info().kv_transfer_address

    # Streaming, OpenAI shape: the same tokens, usage counted once; the next request gets the next id.
    response = httpx.post(f"{cluster.master.url}/v1/completions", timeout=TIMEOUT, json={
        "model": cluster.master.manager.model_name, "prompt": prompt, "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True}})
    assert response.status_code == 200, response.text
    events = [event for event in (json.loads(line[6:]) for line in response.text.splitlines()
                                  if line.startswith("data: ") and line != "data: [DONE]")]
    text = "".join(choice["text"] for event in events for choice in event.get("choices", []))
    assert text == expected_text
    assert events[-1]["usage"]["completion_tokens"] == 6
    assert [body["request_id"] for body in cluster.decode.bodies] == [1, 2]

    metrics = httpx.get(f"{cluster.master.url}/metrics").text
    assert _metric(metrics, "lightllm_pd_nodes_alive", role="decode") == 1
    for phase in ("reserve", "prefill", "transfer", "first_decode_token"):
        assert _metric(metrics, "lightllm_pd_phase_seconds_count", phase=phase) == 2
    assert _metric(metrics, "lightllm_generated_tokens_total") == 12
    assert _metric(metrics, "lightllm_time_to_first_token_seconds_count") == 2

    # A one-token request finishes on P: nothing moves, D's reservation is closed (aborted there).
    response = _generate(cluster, prompt, 1)
    assert [token["id"] for token in response.json()["tokens"]] == expected[:1]
    deadline = time.monotonic() + 5
    while 3 not in cluster.decode.aborted:
        assert time.monotonic() < deadline, "the decode reservation of a request finished on P was not closed"
        time.sleep(0.02)


def test_context_length_refused_like_a_normal_server(cluster: Cluster) -> None:
    limit = cluster.master.manager.max_req_total_len
    response = _generate(cluster, "hello", limit)
    assert response.status_code == 400
    assert "This model's maximum context length is" in response.json()["error"]["message"]
    assert cluster.decode.bodies == []


def test_busy_decode_is_an_immediate_503_naming_the_role(cluster: Cluster) -> None:
    cluster.decode.busy = True
    started = time.monotonic()
    response = _generate(cluster, "hello", 4)
    assert time.monotonic() - started < 5  # no retry by default (generous bound for a loaded machine)
    assert response.status_code == 503
    error = response.json()["error"]
    assert (error["code"], error["role"]) == ("server_busy", "decode")
    assert "decode node is busy" in error["message"]
    assert cluster.prefill.bodies == []  # decode reserves first: P never saw it
    metrics = httpx.get(f"{cluster.master.url}/metrics").text
    assert _metric(metrics, "lightllm_pd_busy_answers_total", role="decode") == 1
    assert _metric(metrics, "lightllm_pd_busy_retries_total") == 0

    cluster.decode.busy = False
    cluster.prefill.busy = True
    response = _generate(cluster, "hello", 4)
    assert response.status_code == 503 and response.json()["error"]["role"] == "prefill"
    deadline = time.monotonic() + 5
    while len(cluster.decode.aborted) < 1:  # D's reservation was given back
        assert time.monotonic() < deadline, "the reservation of a request P refused was not closed"
        time.sleep(0.02)


def test_busy_retry_succeeds_once_the_node_frees(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS", "20")
    cluster.decode.busy = True
    threading.Timer(0.6, lambda: setattr(cluster.decode, "busy", False)).start()
    response = _generate(cluster, "hello", 3)
    assert response.status_code == 200, response.text
    assert response.json()["count_output_tokens"] == 3
    metrics = httpx.get(f"{cluster.master.url}/metrics").text
    assert _metric(metrics, "lightllm_pd_busy_retries_total") >= 1
    assert _metric(metrics, "lightllm_pd_busy_answers_total", role="decode") >= 1


def test_segment_end_continues_with_prompt_plus_generated(cluster: Cluster) -> None:
    cluster.decode.segment_limit = 2
    prompt = "a long story"
    prompt_ids = cluster.master.manager.encode_prompt(prompt)
    expected = reference_tokens(prompt_ids, 8)
    response = httpx.post(f"{cluster.master.url}/generate_stream", timeout=TIMEOUT,
                          json={"inputs": prompt, "parameters": {"max_new_tokens": 8}})
    events = _sse(response)
    assert [event["token"]["id"] for event in events] == expected
    assert [event["token"]["count_output_tokens"] for event in events] == list(range(1, 9))
    assert events[-1]["finished"] and events[-1]["finish_reason"] == "length"
    # Each segment: P's first token + 2 from D; 8 tokens = segments of 3, 3, 2.
    segments = cluster.prefill.bodies
    assert [body["segment_index"] for body in segments] == [0, 1, 2]
    assert [body["infer_high_priority"] for body in segments] == [0, -1, -1]
    assert [body["prompt_ids"] for body in segments] == [prompt_ids, prompt_ids + expected[:3], prompt_ids + expected[:6]]
    assert [body["params"]["max_new_tokens"] for body in segments] == [8, 5, 2]
    assert len({body["request_id"] for body in segments + cluster.decode.bodies}) == 1
    metrics = httpx.get(f"{cluster.master.url}/metrics").text
    assert _metric(metrics, "lightllm_pd_continuation_segments_total") == 2
    assert _metric(metrics, "lightllm_generated_tokens_total") == 8


def test_transfer_broken_sets_the_pair_up_again(cluster: Cluster) -> None:
    assert _generate(cluster, "hello", 3).status_code == 200
    cluster.decode.epoch = None  # D lost its transfer handles: it answers transfer_broken
    response = _generate(cluster, "hello", 3)
    assert response.status_code == 200, response.text
    assert [s["epoch"] for s in cluster.prefill.setups] == [s["epoch"] for s in cluster.decode.setups] == [1, 2]
    assert cluster.prefill.bodies[-1]["epoch"] == 2


def test_dropped_decode_node_fails_its_stream_within_the_bound(cluster: Cluster) -> None:
    cluster.decode.token_delay = 0.05
    cluster.decode.silent_after = None
    received: List[Dict[str, Any]] = []
    with httpx.stream("POST", f"{cluster.master.url}/generate_stream", timeout=TIMEOUT,
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
    assert _metric(metrics, "lightllm_pd_failed_requests_total", reason="node_lost") == 1
    # No decode node any more: 503 pd_not_ready at once.
    response = _generate(cluster, "hello", 3)
    assert response.status_code == 503 and response.json()["error"]["code"] == "pd_not_ready"


def test_client_gone_closes_the_node_streams(cluster: Cluster) -> None:
    cluster.decode.token_delay = 0.05
    with httpx.stream("POST", f"{cluster.master.url}/generate_stream", timeout=TIMEOUT,
                      json={"inputs": "hello", "parameters": {"max_new_tokens": 500}}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 10
    while cluster.decode.aborted != [1]:
        assert time.monotonic() < deadline, "the decode stream was not closed after the client left"
        time.sleep(0.02)


def test_not_ready_until_both_roles_registered(tiny_llama_dir: Path) -> None:
    cluster = Cluster(str(tiny_llama_dir), register=False)
    try:
        url = cluster.master.url
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "pd_not_ready"
        cluster.prefill.register()
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["error"]["message"].endswith("no decode node registered")
        response = _generate(cluster, "hello", 3)
        assert response.status_code == 503
        assert response.json()["error"] == {
            "message": "The PD cluster is not ready: no decode node registered",
            "type": "service_unavailable_error", "param": None, "code": "pd_not_ready"}
        cluster.decode.register()
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        assert _generate(cluster, "hello", 3).status_code == 200
    finally:
        cluster.stop()


def test_node_of_another_model_is_refused(tiny_llama_dir: Path) -> None:
    cluster = Cluster(str(tiny_llama_dir), register=False)
    try:
        body = {**cluster.decode.info().to_dict(), "model_name": "another-model"}
        response = httpx.post(f"{cluster.master.url}/pd/register", json=body)
        assert response.status_code == 409
        error = response.json()["error"]
        assert error["code"] == "incompatible_node"
        assert re.search(r"model_name: 'another-model' is not served by this master", error["message"])
    finally:
        cluster.stop()


def test_transfer_failure_mid_flow_ends_the_stream_with_an_error_and_resets_the_pair(cluster: Cluster) -> None:
    cluster.prefill.fail_transfer = True
    response = httpx.post(f"{cluster.master.url}/generate_stream", timeout=TIMEOUT,
                          json={"inputs": "hello", "parameters": {"max_new_tokens": 5}})
    events = _sse(response)
    assert "token" in events[0]  # P's first token reached the client at once
    error = events[-1]["error"]
    assert error["code"] == "pd_transfer_failed" and "checksum mismatch" in error["message"]
    deadline = time.monotonic() + 5
    while 1 not in cluster.decode.aborted:  # D's reservation was given back
        assert time.monotonic() < deadline, "the decode stream of a failed transfer was not closed"
        time.sleep(0.02)
    cluster.prefill.fail_transfer = False
    assert _generate(cluster, "hello", 3).status_code == 200
    assert [s["epoch"] for s in cluster.prefill.setups] == [1, 2]
    metrics = httpx.get(f"{cluster.master.url}/metrics").text
    assert _metric(metrics, "lightllm_pd_failed_requests_total", reason="transfer_failed") == 1


def test_high_priority_is_refused_not_ignored(tiny_llama_dir: Path) -> None:
    cluster = Cluster(str(tiny_llama_dir), "--allow_public_priority")
    try:
        response = httpx.post(f"{cluster.master.url}/generate", timeout=TIMEOUT, json={
            "inputs": "hello", "parameters": {"max_new_tokens": 2}, "high_priority_request": True})
        assert response.status_code == 400
        assert "high_priority_request is not supported by a PD master" in response.json()["error"]["message"]
    finally:
        cluster.stop()


def test_node_flags_on_the_master_are_refused() -> None:
    parser = make_argument_parser()
    check_master_flags(parser.parse_args(["--run_mode", "pd_master", "--model_dir", "m", "--port", "9",
                                          "--pd_decode_token_timeout_seconds", "5"]))
    with pytest.raises(ValueError) as err:
        check_master_flags(parser.parse_args(["--run_mode", "pd_master", "--model_dir", "m", "--tp", "2",
                                              "--pd_max_segment_tokens", "8"]))
    assert str(err.value).startswith("--pd_max_segment_tokens, --tp configure prefill/decode nodes")


def test_a_draining_master_is_unhealthy_and_refuses(cluster: Cluster) -> None:
    assert httpx.get(f"{cluster.master.url}/health").status_code == 200
    cluster.master.manager.refuse_new_requests("The server is shutting down", "server_shutting_down")
    health = httpx.get(f"{cluster.master.url}/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "server_shutting_down"
    response = _generate(cluster, "hello", 2)
    assert response.status_code == 503 and response.json()["error"]["code"] == "server_shutting_down"
    assert cluster.decode.bodies == []


def test_decode_failure_during_prefill_ends_the_request_at_once(cluster: Cluster) -> None:
    cluster.prefill.prefill_delay = 30.0
    cluster.decode.lease_expires = True
    started = time.monotonic()
    response = _generate(cluster, "hello", 4)
    assert time.monotonic() - started < 15  # not after P's (30 s) first token
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "pd_node_failed" and "did not arrive within the lease" in error["message"]
    deadline = time.monotonic() + 5
    while 1 not in cluster.prefill.aborted:  # P's prefill was called off
        assert time.monotonic() < deadline, "the prefill stream was not closed"
        time.sleep(0.02)


def test_busy_body_names_the_role_only_when_there_is_one() -> None:
    with_role = manager_error(ServerBusyError("The decode node is busy", "decode")).to_dict()["error"]
    assert with_role == {"message": "The decode node is busy", "type": "service_unavailable_error", "param": None,
                         "code": "server_busy", "role": "decode"}
    assert "role" not in manager_error(ServerBusyError("no free request slot")).to_dict()["error"]


def test_failed_pair_setup_is_a_503_and_is_retried_by_the_next_request(cluster: Cluster) -> None:
    cluster.decode.refuse_setup = True
    response = _generate(cluster, "hello", 3)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "pd_transfer_setup_failed" and "could not start its transfer handle" in error["message"]
    assert cluster.decode.bodies == []
    cluster.decode.refuse_setup = False
    assert _generate(cluster, "hello", 3).status_code == 200
    assert [s["epoch"] for s in cluster.decode.setups] == [1, 2]  # a failed setup's epoch is never reused


def test_master_decides_a_stop_string_that_straddles_segments_and_aborts_the_nodes(cluster: Cluster) -> None:
    # The stand-ins apply no stop strings, so only the master can end these requests on one.
    cluster.decode.segment_limit = 3  # segments of 4 tokens: P's first, then 3 on D
    cluster.decode.token_delay = 0.3  # the stopping segment is still generating when the master stops
    prompt = "hello there, general"
    tokenizer = cluster.master.manager.tokenizer
    tokens = reference_tokens(cluster.master.manager.encode_prompt(prompt), 40)
    pieces = [tokenizer.decode([token], skip_special_tokens=True) for token in tokens]
    full = "".join(pieces)
    # A 4-character stop string whose first half comes from segment 1 and second half from segment 2.
    boundary = len("".join(pieces[:8]))
    stop = full[boundary - 2: boundary + 2]
    assert len(stop) == 4 and full.find(stop) == boundary - 2, (full, stop)
    completes_at = next(n for n in range(1, len(pieces) + 1) if len("".join(pieces[:n])) >= boundary + 2)
    for request_id, include in ((1, False), (2, True)):
        response = httpx.post(f"{cluster.master.url}/v1/completions", timeout=TIMEOUT, json={
            "model": cluster.master.manager.model_name, "prompt": prompt, "max_tokens": 40, "stop": [stop],
            "include_stop_str_in_output": include})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"] == full[: boundary + (2 if include else -2)]
        assert choice["finish_reason"] == "stop"
        assert response.json()["usage"]["completion_tokens"] == completes_at
        last_segment = (completes_at - 1) // 4
        assert max(body["segment_index"] for body in cluster.decode.bodies if body["request_id"] == request_id) == last_segment
        deadline = time.monotonic() + 5
        while (request_id, last_segment) not in cluster.decode.aborted_segments:
            assert time.monotonic() < deadline, "the decode stream of the stopped segment was not closed"
            time.sleep(0.02)


def test_a_node_stream_is_cancelled_once_so_its_connection_closes_cleanly() -> None:
    """Closing a stream after cancelling it must not cancel the reader again.

    A second cancellation lands inside the reader's connection close and leaves a half-closed
    connection behind (seen as other requests' streams ending early under load).
    """
    import asyncio

    from lightllm.server.httpserver_for_pd_master.node_streams import NodeStreams
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
