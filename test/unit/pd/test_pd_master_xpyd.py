"""The PD master with several prefill and decode nodes (xPyD): placement, pairs, membership.

(The pair table alone is in test_pd_pair_table.py.)  These tests run the real master (flags ->
build_master -> create_app -> uvicorn) against node stand-ins (pd_node_stand_in.py) that register with the real PdNodeClient.  A stand-in's load and state
change only when a test reports them (:meth:`NodeStandIn.report`), so every placement here is
decided by what the test set up, not by timing.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import httpx
import pytest

from pd_master_support import (  # noqa: F401 - cluster_fixture is the "cluster" fixture
    REQUEST_TIMEOUT,
    Cluster,
    cluster_fixture,
    generate,
    metric_value,
)
from pd_node_stand_in import NodeStandIn, reference_tokens
from lightllm.server.pd.master.node_selector import AFFINITY_PREFIX_TOKENS, AFFINITY_QUEUE_MARGIN_TOKENS


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30) -> None:
    """Poll until ``predicate()``; the deadline only keeps a broken build from hanging."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def stream(cluster: Cluster, prompt: str, max_new_tokens: int) -> List[Dict[str, Any]]:
    """The events of one ``/generate_stream`` request, read to the end."""
    events = []
    with httpx.stream("POST", f"{cluster.master.url}/generate_stream", timeout=REQUEST_TIMEOUT,
                      json={"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


def in_background(target: Callable[[], Any]) -> Tuple[threading.Thread, Dict[str, Any]]:
    """Run ``target`` in a thread; its result lands in the returned dict under ``"result"``."""
    box: Dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.__setitem__("result", target()), daemon=True)
    thread.start()
    return thread, box


def nodes_of(cluster: Cluster) -> Dict[str, Dict[str, Any]]:
    """The master's ``GET /pd/nodes`` entries by node id."""
    return {entry["node_id"]: entry for entry in httpx.get(f"{cluster.master.url}/pd/nodes").json()["nodes"]}


def assert_served_as_reference(cluster: Cluster, prompt: str, max_new_tokens: int) -> None:
    """The cluster answers ``prompt`` with 200 and the stand-ins' reference tokens."""
    response = generate(cluster, prompt, max_new_tokens)
    assert response.status_code == 200, response.text
    tokens = [token["id"] for token in response.json()["tokens"]]
    assert tokens == reference_tokens(cluster.master.manager.served.encode_prompt(prompt), max_new_tokens)


def prompts_seen(node: NodeStandIn) -> int:
    return len(node.bodies)


# ---------------------------------------------------------------- placement on stand-ins


def test_2p2d_placement_follows_reported_load_and_shows_it(tiny_llama_dir: Path) -> None:
    cluster = Cluster(str(tiny_llama_dir), prefills=2, decodes=2)
    try:
        p0, p1 = cluster.prefills
        d0, d1 = cluster.decodes
        p0.report({"queued_prefill_tokens": 50000, "running_requests": 40})
        p1.report({"queued_prefill_tokens": 0, "running_requests": 0})
        d0.report({"free_kv_tokens": 100, "kv_capacity_tokens": 100000, "running_requests": 30})
        d1.report({"free_kv_tokens": 90000, "kv_capacity_tokens": 100000, "running_requests": 2})
        for i in range(3):
            assert generate(cluster, f"hello {i}", 3).status_code == 200
        assert [prompts_seen(n) for n in (p0, p1, d0, d1)] == [0, 3, 0, 3]
        # The load moves: so do the requests.
        p0.report({"queued_prefill_tokens": 0, "running_requests": 0})
        p1.report({"queued_prefill_tokens": 50000, "running_requests": 40})
        d0.report({"free_kv_tokens": 90000, "kv_capacity_tokens": 100000, "running_requests": 2})
        d1.report({"free_kv_tokens": 100, "kv_capacity_tokens": 100000, "running_requests": 30})
        for i in range(2):
            assert generate(cluster, f"hello again {i}", 3).status_code == 200
        assert [prompts_seen(n) for n in (p0, p1, d0, d1)] == [2, 3, 2, 3]
        # Each pair was set up once, on first use, under its own epoch.
        assert [s["epoch"] for s in p1.setups] == [s["epoch"] for s in d1.setups] == [1]
        assert [s["epoch"] for s in p0.setups] == [s["epoch"] for s in d0.setups] == [2]
        assert {body["epoch"] for body in p0.bodies + d0.bodies} == {2}

        listed = nodes_of(cluster)
        entry = listed[d1.node_id]
        assert (entry["role"], entry["state"], entry["in_flight_requests"], entry["transfer_epochs"]) == (
            "decode", "serving", 0, [1])
        assert entry["load"] == {"queued_prefill_tokens": None, "running_requests": 30, "free_kv_tokens": 100,
                                 "kv_capacity_tokens": 100000}
        metrics = httpx.get(f"{cluster.master.url}/metrics").text
        assert metric_value(metrics, "lightllm_pd_node_queued_prefill_tokens", node_id=p1.node_id,
                            role="prefill") == 50000
        assert metric_value(metrics, "lightllm_pd_node_free_kv_tokens", node_id=d0.node_id) == 90000
        assert metric_value(metrics, "lightllm_pd_node_serving", node_id=d0.node_id) == 1
        assert metric_value(metrics, "lightllm_pd_node_in_flight_requests", node_id=d0.node_id) == 0
        assert metric_value(metrics, "lightllm_pd_nodes_alive", role="prefill") == 2
        assert metric_value(metrics, "lightllm_pd_master_stalled_seconds_total") >= 0  # exported from the start
    finally:
        cluster.stop()


def test_prefix_affinity_sends_shared_prefix_prompts_to_one_prefill_node_until_it_is_overloaded(
        tiny_llama_dir: Path) -> None:
    cluster = Cluster(str(tiny_llama_dir), prefills=2)
    try:
        system = "shared system prompt " * 30
        assert len(cluster.master.manager.served.encode_prompt(system)) > AFFINITY_PREFIX_TOKENS
        for i in range(4):
            assert generate(cluster, f"{system}question {i}", 2).status_code == 200
        counts = sorted(prompts_seen(n) for n in cluster.prefills)
        assert counts == [0, 4]  # one prefill node got every prompt of the shared prefix
        preferred = max(cluster.prefills, key=prompts_seen)
        other = min(cluster.prefills, key=prompts_seen)
        # The preferred node is past the margin: the least loaded one takes the next.
        preferred.report({"queued_prefill_tokens": AFFINITY_QUEUE_MARGIN_TOKENS + 1})
        other.report({"queued_prefill_tokens": 0})
        assert generate(cluster, f"{system}question 9", 2).status_code == 200
        assert (prompts_seen(preferred), prompts_seen(other)) == (4, 1)
        # Within the margin it is preferred again.
        preferred.report({"queued_prefill_tokens": AFFINITY_QUEUE_MARGIN_TOKENS})
        assert generate(cluster, f"{system}question 10", 2).status_code == 200
        assert (prompts_seen(preferred), prompts_seen(other)) == (5, 1)
        # Short prompts have no affinity: they are balanced.
        preferred.report({"queued_prefill_tokens": 0})
        for i in range(2):
            assert generate(cluster, f"hi {i}", 2).status_code == 200
        assert (prompts_seen(preferred), prompts_seen(other)) == (6, 2)
    finally:
        cluster.stop()


def test_a_draining_node_gets_nothing_new(tiny_llama_dir: Path) -> None:
    cluster = Cluster(str(tiny_llama_dir), prefills=2, decodes=2)
    try:
        p0, p1 = cluster.prefills
        d0, d1 = cluster.decodes
        p0.report(state="draining")
        d0.report(state="draining")
        for i in range(4):
            assert generate(cluster, f"hello {i}", 3).status_code == 200
        assert [prompts_seen(n) for n in (p0, p1, d0, d1)] == [0, 4, 0, 4]
        assert nodes_of(cluster)[p0.node_id]["state"] == "draining"
        metrics = httpx.get(f"{cluster.master.url}/metrics").text
        assert metric_value(metrics, "lightllm_pd_node_serving", node_id=p0.node_id) == 0
        assert metric_value(metrics, "lightllm_pd_node_serving", node_id=p1.node_id) == 1
        # With every prefill node draining the cluster takes nothing and says why.
        p1.report(state="draining")
        response = generate(cluster, "hello", 3)
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "pd_not_ready"
        assert error["message"] == (f"The PD cluster is not ready: every prefill node is draining "
                                    f"({p1.node_id}, {p0.node_id})")
        assert httpx.get(f"{cluster.master.url}/health").status_code == 503
        assert prompts_seen(d1) == 4
        p0.report(state="serving")
        assert generate(cluster, "hello", 3).status_code == 200 and prompts_seen(p0) == 1
    finally:
        cluster.stop()


# ---------------------------------------------------------------- membership under traffic


def test_a_dropped_decode_node_fails_only_its_request_and_its_pairs_are_torn_down(tiny_llama_dir: Path) -> None:
    cluster = Cluster(str(tiny_llama_dir), decodes=2)
    try:
        victim, survivor = cluster.decodes
        for decode in cluster.decodes:
            decode.hold_after = 2  # both requests stay in flight until the test lets them go
        prompts = ["first story", "second story"]
        runs = [in_background(lambda prompt=prompt: stream(cluster, prompt, 12)) for prompt in prompts]
        # Two requests in flight at once: one on each decode node (placement counts them).
        wait_for(lambda: prompts_seen(victim) == 1 and prompts_seen(survivor) == 1, "one request on each decode node")
        wait_for(lambda: all(entry["in_flight_requests"] == 1 for node_id, entry in nodes_of(cluster).items()
                             if node_id != cluster.prefill.node_id), "in-flight counts")
        victim_epoch = victim.setups[0]["epoch"]
        survivor_epoch = survivor.setups[0]["epoch"]
        victim_prompt = victim.bodies[0]["prompt_ids"]
        victim.go_silent()
        wait_for(lambda: cluster.prefill.teardowns == [victim_epoch], "the lost pair's teardown on the prefill node")
        survivor.release_hold()
        for thread, _ in runs:
            thread.join(60)
        results = [box["result"] for _, box in runs]
        encoded = [cluster.master.manager.served.encode_prompt(prompt) for prompt in prompts]
        for prompt_ids, events in zip(encoded, results):
            if prompt_ids == victim_prompt:
                error = events[-1]["error"]
                assert error["code"] == "pd_node_lost" and "decode" in error["message"]
            else:
                assert all("error" not in event for event in events), events[-1]
                assert [event["token"]["id"] for event in events] == reference_tokens(prompt_ids, 12)
        assert survivor.teardowns == []
        assert nodes_of(cluster)[cluster.prefill.node_id]["transfer_epochs"] == [survivor_epoch]
        metrics = httpx.get(f"{cluster.master.url}/metrics").text
        assert metric_value(metrics, "lightllm_pd_failed_requests_total", reason="node_lost") == 1
        # The cluster serves on with the remaining pair.
        assert generate(cluster, "after the loss", 3).status_code == 200
        assert prompts_seen(survivor) == 2
    finally:
        cluster.stop()


def test_a_restarted_node_ends_its_pairs_on_the_survivor(cluster: Cluster) -> None:
    assert generate(cluster, "hello", 3).status_code == 200
    client = cluster.prefill.client
    assert client is not None
    cluster.prefill.server.call(client.stop())
    cluster.prefill.epoch = None  # a restarted node holds no transfer group
    cluster.prefill.register()  # same id and address: the master treats it as restarted
    wait_for(lambda: cluster.decode.teardowns == [1], "the teardown of the restarted node's pair")
    assert generate(cluster, "hello", 3).status_code == 200
    assert [s["epoch"] for s in cluster.prefill.setups] == [s["epoch"] for s in cluster.decode.setups] == [1, 2]


def test_a_broken_transfer_tears_the_pair_down_on_both_nodes(cluster: Cluster) -> None:
    assert generate(cluster, "hello", 3).status_code == 200
    cluster.decode.epoch = None  # D lost its transfer handles: it answers transfer_broken
    assert generate(cluster, "hello", 3).status_code == 200
    wait_for(lambda: cluster.prefill.teardowns == [1] and cluster.decode.teardowns == [1], "both teardowns")
    assert cluster.prefill.epochs == cluster.decode.epochs == {2}


def test_a_node_joining_mid_traffic_gets_work(cluster: Cluster) -> None:
    cluster.decode.hold_after = 1
    first, box = in_background(lambda: stream(cluster, "long running", 6))
    wait_for(lambda: prompts_seen(cluster.decode) == 1, "the first request on the first decode node")
    joined = cluster.add("decode")
    assert generate(cluster, "newcomer", 3).status_code == 200
    assert prompts_seen(joined) == 1 and prompts_seen(cluster.decode) == 1
    assert [s["epoch"] for s in joined.setups] == [2] and [s["epoch"] for s in cluster.prefill.setups] == [1, 2]
    cluster.decode.release_hold()
    first.join(60)
    prompt_ids = cluster.master.manager.served.encode_prompt("long running")
    assert [event["token"]["id"] for event in box["result"]] == reference_tokens(prompt_ids, 6)


def test_a_continuation_moves_to_another_decode_node_when_its_decode_node_is_busy(tiny_llama_dir: Path) -> None:
    cluster = Cluster(str(tiny_llama_dir), decodes=2)
    try:
        best, other = cluster.decodes
        best.report({"free_kv_tokens": 100000, "kv_capacity_tokens": 100000, "running_requests": 0})
        other.report({"free_kv_tokens": 1000, "kv_capacity_tokens": 100000, "running_requests": 0})
        best.segment_limit = 2  # the first segment ends on it...
        best.busy_from_segment = 1  # ...and its KV is full for the continuation
        prompt = "a long story"
        response = generate(cluster, prompt, 8)
        assert response.status_code == 200, response.text
        prompt_ids = cluster.master.manager.served.encode_prompt(prompt)
        assert [token["id"] for token in response.json()["tokens"]] == reference_tokens(prompt_ids, 8)
        assert [body["segment_index"] for body in best.bodies] == [0, 1]  # tried first, answered busy
        assert [body["segment_index"] for body in other.bodies] == [1]
        assert [body["segment_index"] for body in cluster.prefill.bodies] == [0, 1]
        metrics = httpx.get(f"{cluster.master.url}/metrics").text
        assert metric_value(metrics, "lightllm_pd_busy_answers_total", role="decode") == 1
        assert metric_value(metrics, "lightllm_pd_busy_retries_total") == 0  # no wait: another node took it

        # A segment that ended because its decode node ran out of KV goes elsewhere first,
        # though that node still reports the most free KV.
        best.busy_from_segment = None
        best.segment_end_reason = "kv_pressure"
        response = generate(cluster, prompt, 8)
        assert response.status_code == 200, response.text
        assert [token["id"] for token in response.json()["tokens"]] == reference_tokens(prompt_ids, 8)
        assert [body["segment_index"] for body in best.bodies[2:]] == [0]
        assert [body["segment_index"] for body in other.bodies[1:]] == [1]
    finally:
        cluster.stop()


def test_every_decode_node_busy_is_one_503_after_trying_each(tiny_llama_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS", "0")  # one round, no waiting for KV
    cluster = Cluster(str(tiny_llama_dir), decodes=2)
    try:
        for decode in cluster.decodes:
            decode.busy = True
        response = generate(cluster, "hello", 3)
        assert response.status_code == 503
        error = response.json()["error"]
        assert (error["code"], error["role"]) == ("server_busy", "decode")
        assert [prompts_seen(decode) for decode in cluster.decodes] == [1, 1]
        assert cluster.prefill.bodies == []
    finally:
        cluster.stop()


def test_a_killed_node_not_yet_dropped_is_passed_over_for_the_next_one(tiny_llama_dir: Path) -> None:
    # A long heartbeat interval keeps killed nodes registered for the whole test (no race with
    # their drop): the master finds out only by calling them.
    cluster = Cluster(str(tiny_llama_dir), "--pd_heartbeat_interval", "30", prefills=2, decodes=3)
    try:
        p0, p1 = cluster.prefills
        d0, d1, d2 = cluster.decodes
        p0.report({"queued_prefill_tokens": 0})
        p1.report({"queued_prefill_tokens": 10000})
        for decode, free in ((d0, 90000), (d1, 50000), (d2, 1000)):
            decode.report({"free_kv_tokens": free, "kv_capacity_tokens": 100000})
        assert generate(cluster, "hello", 3).status_code == 200
        assert (prompts_seen(p0), prompts_seen(d0)) == (1, 1)  # the pair (p0, d0) is set up
        p0.stop()  # killed: their ports refuse connections, the master still lists them
        d0.stop()
        d1.stop()
        prompt = "still served"
        # d0's stream, then p0's and d1's setups could not reach them: p1 and d2 took the request.
        assert_served_as_reference(cluster, prompt, 4)
        assert (prompts_seen(p1), prompts_seen(d2)) == (1, 1)
        assert {p0.node_id, d0.node_id, d1.node_id} <= set(nodes_of(cluster))  # not dropped yet
        # With no reachable decode node left the client gets the last node's failure.
        d2.stop()
        response = generate(cluster, prompt, 4)
        assert response.status_code == 503
        assert response.json()["error"]["code"] in ("pd_node_unreachable", "pd_transfer_setup_failed")
    finally:
        cluster.stop()


def test_a_node_answering_that_it_failed_is_passed_over_and_gets_nothing_new(tiny_llama_dir: Path) -> None:
    """A node whose model process died answers 503 server_failed until its HTTP server stops: the
    master placed request after request on it (it answered fastest, so it looked least loaded) and
    each failed although another decode node was free."""
    cluster = Cluster(str(tiny_llama_dir), "--pd_heartbeat_interval", "30", prefills=1, decodes=2)
    try:
        (p0,) = cluster.prefills
        d0, d1 = cluster.decodes
        d0.report({"free_kv_tokens": 90000, "kv_capacity_tokens": 100000})
        d1.report({"free_kv_tokens": 50000, "kv_capacity_tokens": 100000})
        assert generate(cluster, "hello", 3).status_code == 200
        assert prompts_seen(d0) == 1
        d0.failed = True
        prompt = "still served"
        assert_served_as_reference(cluster, prompt, 4)
        assert (prompts_seen(d0), prompts_seen(d1)) == (2, 1)
        # Until it heartbeats again it takes nothing new, however free it reported itself.
        for _ in range(3):
            assert generate(cluster, prompt, 2).status_code == 200
        assert (prompts_seen(d0), prompts_seen(d1)) == (2, 4)
        # With no other decode node the client gets the failure, not a hang.
        d1.failed = True
        d0.report({"free_kv_tokens": 90000, "kv_capacity_tokens": 100000})  # back, and still failing
        response = generate(cluster, prompt, 2)
        assert response.status_code == 503
    finally:
        cluster.stop()


def test_one_request_may_run_at_most_half_the_smallest_nodes_request_slots(tiny_llama_dir: Path) -> None:
    """Each generation holds a request slot on its nodes (and a top-logprob row when it asks for
    top logprobs): as on a normal server, one request of many prompts x n must not take every slot
    of a node (every other client then waits for it)."""
    cluster = Cluster(str(tiny_llama_dir), register=False, prefills=2)
    try:
        for node, slots, tops in zip(cluster.prefills + cluster.decodes, (64, 8, 16), (None, 32, 6)):
            node.request_slots, node.top_logprob_slots = slots, tops
            node.register()
        body = {"model": cluster.master.manager.served.model_name, "prompt": ["a", "b", "c"], "max_tokens": 2}
        refused = httpx.post(f"{cluster.master.url}/v1/completions", json={**body, "n": 2}, timeout=REQUEST_TIMEOUT)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "n" and "6 generations (3 prompts x n 2)" in error["message"]
        assert "at most 4" in error["message"]  # half of p1's 8
        top_refused = httpx.post(f"{cluster.master.url}/v1/completions", json={**body, "prompt": list("abcd"), "logprobs": 1},
                                 timeout=REQUEST_TIMEOUT)
        assert top_refused.status_code == 400, top_refused.text
        error = top_refused.json()["error"]
        assert error["param"] == "prompt" and "at most 3" in error["message"]  # half of d0's 6 top-logprob rows
        assert "half of the smallest PD node's top-logprob rows (--top_logprobs_slots)" in error["message"]
        served = httpx.post(f"{cluster.master.url}/v1/completions", json={**body, "prompt": ["a", "b"], "n": 2},
                            timeout=REQUEST_TIMEOUT)
        assert served.status_code == 200, served.text
        assert len(served.json()["choices"]) == 4
    finally:
        cluster.stop()
