"""The PD master's request flow against node stand-ins over real HTTP on loopback.

The master is the real one (flags -> build_master -> create_app -> uvicorn); the prefill and
decode stand-ins (pd_node_stand_in.py) speak the node contract's NDJSON and register with the
real PdNodeClient.  Their "model" is a fixed function of the sequence, so every expected token
is computed independently of how the master split or forwarded the work: these tests check the
tokens, text, usage, continuation segments and stop strings a client gets.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from pd_master_support import (  # noqa: F401 - cluster_fixture is the "cluster" fixture
    REQUEST_TIMEOUT,
    Cluster,
    StraddlingStop,
    cluster_fixture,
    generate,
    metric_value,
    sse_events,
)
from pd_node_stand_in import reference_tokens


def test_normal_flow_tokens_in_order_echo_dropped_usage_once(cluster: Cluster) -> None:
    prompt = "hello there, general"
    prompt_ids = cluster.master.manager.served.encode_prompt(prompt)
    expected = reference_tokens(prompt_ids, 6)
    response = generate(cluster, prompt, 6)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [token["id"] for token in answer["tokens"]] == expected  # P's first, then D's; the echo dropped
    # The master decodes the text from the token ids itself (the stand-ins' "text" is ignored).
    expected_text = cluster.master.manager.served.tokenizer.decode(expected, skip_special_tokens=True)
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
    response = httpx.post(f"{cluster.master.url}/v1/completions", timeout=REQUEST_TIMEOUT, json={
        "model": cluster.master.manager.served.model_name, "prompt": prompt, "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True}})
    assert response.status_code == 200, response.text
    events = [event for event in (json.loads(line[6:]) for line in response.text.splitlines()
                                  if line.startswith("data: ") and line != "data: [DONE]")]
    text = "".join(choice["text"] for event in events for choice in event.get("choices", []))
    assert text == expected_text
    assert events[-1]["usage"]["completion_tokens"] == 6
    assert [body["request_id"] for body in cluster.decode.bodies] == [1, 2]

    metrics = httpx.get(f"{cluster.master.url}/metrics").text
    assert metric_value(metrics, "lightllm_pd_nodes_alive", role="decode") == 1
    for phase in ("reserve", "prefill", "transfer", "first_decode_token"):
        assert metric_value(metrics, "lightllm_pd_phase_seconds_count", phase=phase) == 2
    assert metric_value(metrics, "lightllm_generated_tokens_total") == 12
    assert metric_value(metrics, "lightllm_time_to_first_token_seconds_count") == 2

    # A one-token request finishes on P: nothing moves, D's reservation is closed (aborted there).
    response = generate(cluster, prompt, 1)
    assert [token["id"] for token in response.json()["tokens"]] == expected[:1]
    deadline = time.monotonic() + 5
    while 3 not in cluster.decode.aborted:
        assert time.monotonic() < deadline, "the decode reservation of a request finished on P was not closed"
        time.sleep(0.02)


def test_context_length_refused_like_a_normal_server(cluster: Cluster) -> None:
    limit = cluster.master.manager.served.max_req_total_len
    response = generate(cluster, "hello", limit)
    assert response.status_code == 400
    assert "This model's maximum context length is" in response.json()["error"]["message"]
    assert cluster.decode.bodies == []


def test_segment_end_continues_with_prompt_plus_generated(cluster: Cluster) -> None:
    cluster.decode.segment_limit = 2
    prompt = "a long story"
    prompt_ids = cluster.master.manager.served.encode_prompt(prompt)
    expected = reference_tokens(prompt_ids, 8)
    response = httpx.post(f"{cluster.master.url}/generate_stream", timeout=REQUEST_TIMEOUT,
                          json={"inputs": prompt, "parameters": {"max_new_tokens": 8}})
    events = sse_events(response)
    assert [event["token"]["id"] for event in events] == expected
    assert [event["token"]["count_output_tokens"] for event in events] == list(range(1, 9))
    assert events[-1]["finished"] and events[-1]["finish_reason"] == "length"
    # Each segment: P's first token + 2 from D; 8 tokens = segments of 3, 3, 2.
    segments = cluster.prefill.bodies
    assert [body["segment_index"] for body in segments] == [0, 1, 2]
    assert [body["infer_high_priority"] for body in segments] == [0, -1, -1]
    # Continuations are admitted first on both nodes; the first segment is an ordinary request.
    for node in (cluster.prefill, cluster.decode):
        assert [body["high_priority_request"] for body in node.bodies] == [False, True, True]
    assert [body["prompt_ids"] for body in segments] == [prompt_ids, prompt_ids + expected[:3], prompt_ids + expected[:6]]
    assert [body["params"]["max_new_tokens"] for body in segments] == [8, 5, 2]
    assert len({body["request_id"] for body in segments + cluster.decode.bodies}) == 1
    metrics = httpx.get(f"{cluster.master.url}/metrics").text
    assert metric_value(metrics, "lightllm_pd_continuation_segments_total") == 2
    assert metric_value(metrics, "lightllm_generated_tokens_total") == 8


def test_a_decode_segment_that_ends_before_the_prefill_line_arrives_is_not_a_failure(cluster: Cluster) -> None:
    # D gets the KV (and the first token) from P directly, so it can echo, decode, end its
    # segment and close its stream before P's first-token line reaches the master (seen in CI
    # with fast decode). Its end of stream then follows complete lines; it is no failure.
    cluster.decode.segment_limit = 2
    cluster.prefill.first_line_delay = 0.3
    prompt = "a quick segment"
    expected = reference_tokens(cluster.master.manager.served.encode_prompt(prompt), 8)
    response = httpx.post(f"{cluster.master.url}/generate_stream", timeout=REQUEST_TIMEOUT,
                          json={"inputs": prompt, "parameters": {"max_new_tokens": 8}})
    events = sse_events(response)
    assert [event["token"]["id"] for event in events] == expected, events[-1:]
    assert events[-1]["finish_reason"] == "length"
    assert [body["segment_index"] for body in cluster.prefill.bodies] == [0, 1, 2]


def test_master_decides_a_stop_string_that_straddles_segments_and_aborts_the_nodes(cluster: Cluster) -> None:
    # The stand-ins apply no stop strings, so only the master can end these requests on one.
    cluster.decode.segment_limit = 3  # segments of 4 tokens: P's first, then 3 on D
    cluster.decode.token_delay = 0.3  # the stopping segment is still generating when the master stops
    prompt = "hello there, general"
    # A 4-character stop string whose first half comes from segment 1 and second half from segment 2.
    straddling = StraddlingStop(cluster, prompt, 40, after_tokens=8)
    stop, completes_at = straddling.stop, straddling.completes_at
    for request_id, include in ((1, False), (2, True)):
        response = httpx.post(f"{cluster.master.url}/v1/completions", timeout=REQUEST_TIMEOUT, json={
            "model": cluster.master.manager.served.model_name, "prompt": prompt, "max_tokens": 40, "stop": [stop],
            "include_stop_str_in_output": include})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"] == straddling.text(include)
        assert choice["finish_reason"] == "stop"
        assert response.json()["usage"]["completion_tokens"] == completes_at
        last_segment = (completes_at - 1) // 4
        assert max(body["segment_index"] for body in cluster.decode.bodies if body["request_id"] == request_id) == last_segment
        deadline = time.monotonic() + 5
        while (request_id, last_segment) not in cluster.decode.aborted_segments:
            assert time.monotonic() < deadline, "the decode stream of the stopped segment was not closed"
            time.sleep(0.02)


def test_high_priority_goes_to_both_nodes_and_only_from_trusted_clients(tiny_llama_dir: Path) -> None:
    cluster = Cluster(str(tiny_llama_dir), "--allow_public_priority")
    try:
        normal = generate(cluster, "hello", 2)
        urgent = httpx.post(f"{cluster.master.url}/generate", timeout=REQUEST_TIMEOUT, json={
            "inputs": "hello", "parameters": {"max_new_tokens": 2}, "high_priority_request": True})
        assert normal.status_code == urgent.status_code == 200, urgent.text
        assert urgent.json()["generated_text"] == normal.json()["generated_text"]
        for node in (cluster.prefill, cluster.decode):
            flags = {body["request_id"]: body["high_priority_request"] for body in node.bodies}
            assert flags == {1: False, 2: True}, (node, flags)
    finally:
        cluster.stop()


def test_high_priority_from_an_untrusted_client_is_refused_by_the_master(cluster: Cluster) -> None:
    response = httpx.post(f"{cluster.master.url}/generate", timeout=REQUEST_TIMEOUT, json={
        "inputs": "hello", "parameters": {"max_new_tokens": 2}, "high_priority_request": True})
    assert response.status_code == 403 and response.json()["error"]["code"] == "priority_not_allowed"
    assert cluster.prefill.bodies == [] and cluster.decode.bodies == []
