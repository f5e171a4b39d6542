"""The PD master while a decode node reserves KV: the prefill node chosen for the request is not yet
needed, so its drop re-places the request instead of failing it.

The real master against node stand-ins (pd_node_stand_in.py), as in test_pd_master_xpyd.py; the
decode stand-in holds its reservations (``reservations_open``) while a test drops a prefill node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import httpx

from pd_master_support import Cluster, generate, metric_value
from pd_node_stand_in import reference_tokens
from test_pd_master_xpyd import in_background, nodes_of, prompts_seen, wait_for


def _warm_two_prefill_cluster(tiny_llama_dir: Path, preferred: int) -> Cluster:
    """Two prefill nodes and one decode node (heartbeats every 0.5 s, so a silent node is dropped
    after 1.75 s); placement prefers prefill node ``preferred``, which has served one request."""
    cluster = Cluster(str(tiny_llama_dir), "--pd_heartbeat_interval", "0.5", prefills=2, decodes=1)
    for index, node in enumerate(cluster.prefills):
        node.report({"queued_prefill_tokens": 0 if index == preferred else 10000})
    assert generate(cluster, "warm up", 3).status_code == 200
    return cluster


def _assert_served(cluster: Cluster, thread: Any, box: Dict[str, Any], prompt: str) -> None:
    """The background request of ``prompt`` (4 tokens) ends served, with the reference tokens."""
    thread.join(60)
    response = box["result"]
    assert response.status_code == 200, response.text
    prompt_ids = cluster.master.manager.served.encode_prompt(prompt)
    assert [token["id"] for token in response.json()["details"]["tokens"]] == reference_tokens(prompt_ids, 4)


def test_a_prefill_node_dropped_while_the_decode_node_reserves_is_replaced_not_the_request_failed(
        tiny_llama_dir: Path) -> None:
    """A request waiting for D's reservation had already counted as depending on its chosen prefill
    node: that node's drop failed it with 503 pd_node_lost although it never reached that node and
    another prefill node was serving.  Placed again, it runs on the other prefill node."""
    cluster = _warm_two_prefill_cluster(tiny_llama_dir, preferred=0)
    try:
        p0, p1 = cluster.prefills
        assert (prompts_seen(p0), prompts_seen(p1)) == (1, 0)
        cluster.decode.reservations_open.clear()
        prompt = "placed again"
        thread, box = in_background(lambda: generate(cluster, prompt, 4))
        wait_for(lambda: prompts_seen(cluster.decode) == 2, "the reservation reaching the decode node")
        p0.go_silent()  # its heartbeats stop: the master drops it after 1.75 s
        wait_for(lambda: p0.node_id not in nodes_of(cluster), "the prefill node's drop")
        cluster.decode.reservations_open.set()
        _assert_served(cluster, thread, box, prompt)
        assert (prompts_seen(p0), prompts_seen(p1)) == (1, 1)
        metrics = httpx.get(f"{cluster.master.url}/metrics").text
        assert metric_value(metrics, "lightllm_pd_failed_requests_total", reason="node_lost") == 0
    finally:
        cluster.stop()


def test_a_request_whose_only_prefill_node_left_while_the_decode_node_reserved_gets_the_not_ready_answer(
        tiny_llama_dir: Path) -> None:
    cluster = Cluster(str(tiny_llama_dir), "--pd_heartbeat_interval", "0.5")
    try:
        assert generate(cluster, "warm up", 3).status_code == 200
        cluster.decode.reservations_open.clear()
        thread, box = in_background(lambda: generate(cluster, "nowhere to go", 4))
        wait_for(lambda: prompts_seen(cluster.decode) == 2, "the reservation reaching the decode node")
        cluster.prefill.go_silent()
        wait_for(lambda: cluster.prefill.node_id not in nodes_of(cluster), "the prefill node's drop")
        cluster.decode.reservations_open.set()
        thread.join(60)
        response = box["result"]
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        health = httpx.get(f"{cluster.master.url}/health")
        # The answer /health gives now (the docs: 503 pd_not_ready while no prefill node is left).
        assert error["code"] == "pd_not_ready" and error["message"] == health.json()["error"]["message"]
    finally:
        cluster.stop()


def test_a_prefill_node_dropped_while_another_answered_busy_waits_for_the_busy_one(tiny_llama_dir: Path) -> None:
    """p1 answered busy, p0 took the request and left while D reserved: the request was refused 503
    pd_not_ready ("no prefill node other than p1 is alive", p1 being alive) instead of waiting for p1."""
    cluster = _warm_two_prefill_cluster(tiny_llama_dir, preferred=1)
    try:
        p0, p1 = cluster.prefills
        assert (prompts_seen(p0), prompts_seen(p1)) == (0, 1)
        p1.busy = True
        cluster.decode.hold_reservations_from = 3  # the warm-up's and p1's reservations pass; p0's waits
        cluster.decode.reservations_open.clear()
        prompt = "waits for p1"
        thread, box = in_background(lambda: generate(cluster, prompt, 4))
        wait_for(lambda: prompts_seen(cluster.decode) == 3, "the reservation for p0 reaching the decode node")
        p0.go_silent()
        wait_for(lambda: p0.node_id not in nodes_of(cluster), "p0's drop")
        p1.busy = False
        cluster.decode.reservations_open.set()
        _assert_served(cluster, thread, box, prompt)
    finally:
        cluster.stop()
