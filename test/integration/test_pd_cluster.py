"""A real 1P1D cluster (PD master, prefill node, decode node; tiny model, gloo KV transfer).

Outputs through the cluster must equal a normal server's; continuation segments must be exact;
a transfer failure must end its request cleanly and leak no KV; killing the decode node must
reach its clients as an error within the bound, and a new decode node must restore service.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from typing import Any, Dict, List, Tuple

import httpx
import pytest

from pd_cluster_support import launch, start_cluster
from server_process import start_server

# The decode node ends every segment after this many tokens (--pd_max_segment_tokens).
SEGMENT_TOKENS = 12
# Heartbeat interval x missed heartbeats of the master's defaults, plus start-up slack.
DEAD_NODE_BOUND_S = 2.0 * 3 + 10
# The shared cluster runs with a cluster key, so every test on it crosses the keyed /pd/ calls.
CLUSTER_KEY = "test-cluster-secret"
# The master's admin key: the only clients allowed high_priority_request.
ADMIN_KEY = "test-admin-key"


@pytest.fixture(scope="module")
def normal(tiny_llama_dir, tmp_path_factory):
    handle = start_server(tiny_llama_dir, tmp_path_factory.mktemp("normal"), ["--max_total_token_num", "16384"])
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    handle = start_cluster(
        tiny_llama_dir, tmp_path_factory.mktemp("pd"),
        prefill_args=["--prefill_queue_strategy", "hrrn"],
        decode_args=["--pd_max_segment_tokens", str(SEGMENT_TOKENS)],
        cluster_key=CLUSTER_KEY,
        master_env={"LIGHTLLM_ADMIN_API_KEY": ADMIN_KEY},
    )
    yield handle
    handle.stop()


def _requests(model: str, max_tokens: int) -> List[Tuple[str, Dict[str, Any]]]:
    """16 greedy requests over every public shape: native and OpenAI, streaming and not."""
    out: List[Tuple[str, Dict[str, Any]]] = []
    for i in range(16):
        prompt = f"request {i}: " + "the scheduler orders prompts " * (1 + i % 5)
        kind = i % 4
        if kind == 0:
            out.append(("/generate", {"inputs": prompt, "parameters": {"max_new_tokens": max_tokens, "ignore_eos": True,
                                                                      "do_sample": False}}))
        elif kind == 1:
            out.append(("/generate_stream", {"inputs": prompt, "parameters": {"max_new_tokens": max_tokens, "ignore_eos": True,
                                                                             "do_sample": False}}))
        elif kind == 2:
            out.append(("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                            "ignore_eos": True, "stream": i % 8 == 2,
                                            "stream_options": {"include_usage": True} if i % 8 == 2 else None}))
        else:
            out.append(("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": prompt}],
                                                 "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                                 "stream": i % 8 == 7,
                                                 "stream_options": {"include_usage": True} if i % 8 == 7 else None}))
    for _, body in out:
        if body.get("stream_options") is None:
            body.pop("stream_options", None)
    return out


def _summary(path: str, status: int, text: str) -> Dict[str, Any]:
    """The text, finish reason and token count of one answer, whatever its shape."""
    assert status == 200, text
    if path == "/generate":
        body = json.loads(text)
        return {"text": body["generated_text"][0], "count": body["count_output_tokens"], "finish": body["finish_reason"]}
    if path == "/generate_stream":
        events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
        assert not any("error" in e for e in events), events
        return {"text": "".join(e["token"]["text"] for e in events), "count": len(events), "finish": events[-1]["finish_reason"]}
    if text.lstrip().startswith("{"):
        body = json.loads(text)
        choice = body["choices"][0]
        content = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
        return {"text": content, "count": body["usage"]["completion_tokens"], "finish": choice["finish_reason"]}
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert not any("error" in c for c in chunks), chunks
    pieces, finish = [], None
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            pieces.append(choice["text"] if path == "/v1/completions" else choice["delta"].get("content") or "")
            finish = choice.get("finish_reason") or finish
    return {"text": "".join(pieces), "count": chunks[-1]["usage"]["completion_tokens"], "finish": finish}


async def _send_all(url: str, requests: List[Tuple[str, Dict[str, Any]]]) -> List[Tuple[int, str]]:
    async with httpx.AsyncClient(timeout=180) as client:
        async def one(path: str, body: Dict[str, Any]) -> Tuple[int, str]:
            resp = await client.post(f"{url}{path}", json=body)
            return resp.status_code, resp.text

        return await asyncio.gather(*(one(path, body) for path, body in requests))


def test_greedy_outputs_equal_a_normal_server(cluster, normal):
    requests = _requests(normal.model_name, SEGMENT_TOKENS - 2)
    ours = asyncio.run(_send_all(cluster.master.url, requests))
    theirs = asyncio.run(_send_all(normal.url, requests))
    for (path, _), (status, text), (ref_status, ref_text) in zip(requests, ours, theirs):
        assert _summary(path, status, text) == _summary(path, ref_status, ref_text), path


def test_priority_request_from_an_admin_runs_through_both_nodes(cluster, normal):
    body = {"inputs": "an urgent request", "parameters": {"max_new_tokens": SEGMENT_TOKENS + 4, "do_sample": False,
                                                          "ignore_eos": True}, "high_priority_request": True}
    refused = httpx.post(f"{cluster.master.url}/generate", json=body, timeout=120)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "priority_not_allowed"
    ours = httpx.post(f"{cluster.master.url}/generate", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    theirs = httpx.post(f"{normal.url}/generate", json={**body, "high_priority_request": False}, timeout=120)
    assert ours.status_code == theirs.status_code == 200, ours.text
    assert ours.json()["generated_text"] == theirs.json()["generated_text"]


def test_seeded_sampled_request_equals_a_normal_server(cluster, normal):
    body = {"model": normal.model_name, "prompt": "Sampling with a seed", "max_tokens": SEGMENT_TOKENS - 1,
            "temperature": 0.9, "top_p": 0.95, "seed": 1234, "ignore_eos": True}
    ours = httpx.post(f"{cluster.master.url}/v1/completions", json=body, timeout=120)
    theirs = httpx.post(f"{normal.url}/v1/completions", json=body, timeout=120)
    assert ours.status_code == theirs.status_code == 200, ours.text
    assert ours.json()["choices"][0]["text"] == theirs.json()["choices"][0]["text"]


def test_long_generations_continue_in_segments_with_priority_only_for_continuations(cluster, normal):
    max_tokens = 4 * SEGMENT_TOKENS + 3  # five segments on the decode node
    requests = [("/v1/completions", {"model": normal.model_name, "prompt": f"a long answer number {i}",
                                     "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                     **({"stream": True, "stream_options": {"include_usage": True}} if i == 0 else {})})
                for i in range(3)]
    ours = asyncio.run(_send_all(cluster.master.url, requests))
    theirs = asyncio.run(_send_all(normal.url, requests))
    for (path, _), (status, text), (ref_status, ref_text) in zip(requests, ours, theirs):
        got, want = _summary(path, status, text), _summary(path, ref_status, ref_text)
        assert got == want and got["count"] == max_tokens
    # The prefill node logs each admitted request's segment and inference priority.
    admitted = re.findall(r"request (\d+) admitted: segment_index=(\d+) infer_high_priority=(-?\d+)",
                          cluster.nodes["prefill"].log())
    segments = [(int(s), int(p)) for _, s, p in admitted]
    assert any(s > 0 for s, _ in segments), admitted
    assert all((p < 0) == (s > 0) for s, p in segments), segments
    assert cluster.master.metric("lightllm_pd_continuation_segments_total") >= 3 * 4


def _series(server, name: str, label: str) -> float:
    """The value of the series of ``name`` whose labels include ``label``."""
    body = httpx.get(f"{server.url}/metrics", timeout=10).text
    values = [float(v) for labels, v in re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", body, re.MULTILINE)
              if label in labels]
    assert values, f"no {name} series with {label}"
    return sum(values)


def _kv_full(node) -> bool:
    return node.metric("lightllm_kv_allocatable_tokens") == node.metric("lightllm_kv_total_tokens")


def _finishes(server) -> Dict[str, float]:
    """``lightllm_requests_total`` by finish reason."""
    body = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {reason: float(value) for reason, value in
            re.findall(r'^lightllm_requests_total{[^}]*finish_reason="([^"]+)"[^}]*} (\S+)$', body, re.MULTILINE)}


def test_the_prefill_node_counts_every_hand_off_as_a_hand_off(cluster, normal):
    """Short answers end on D before P's handed_off line reaches the master; P must still count
    a hand-off, not an abort (and log no error for it)."""
    prefill = cluster.nodes["prefill"]
    before = _finishes(prefill)
    requests = _requests(normal.model_name, 2)
    answers = asyncio.run(_send_all(cluster.master.url, requests))
    for (path, _), (status, text) in zip(requests, answers):
        _summary(path, status, text)  # every request succeeded
    deadline = time.monotonic() + 30  # P counts when its own side of each transfer reports
    while _finishes(prefill).get("handed_off", 0) - before.get("handed_off", 0) < len(requests):
        assert time.monotonic() < deadline, _finishes(prefill)
        time.sleep(0.1)
    after = _finishes(prefill)
    assert {reason: after[reason] - before.get(reason, 0) for reason in after
            if after[reason] != before.get(reason, 0)} == {"handed_off": len(requests)}
    assert "without a result" not in prefill.log()


def test_cluster_endpoints_take_only_the_cluster_key_and_a_node_without_it_is_refused(cluster, tmp_path):
    decode = cluster.nodes["decode"]
    for url, method, path in ((cluster.master.url, "GET", "/pd/nodes"), (decode.url, "POST", "/pd/node/decode")):
        missing = httpx.request(method, f"{url}{path}", json={}, timeout=30)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_cluster_key", missing.text
        wrong = httpx.request(method, f"{url}{path}", json={}, headers={"Authorization": "Bearer nope"}, timeout=30)
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_cluster_key", wrong.text
    keyed = httpx.get(f"{cluster.master.url}/pd/nodes", headers={"Authorization": f"Bearer {CLUSTER_KEY}"}, timeout=30)
    assert keyed.status_code == 200 and {n["role"] for n in keyed.json()["nodes"]} == {"prefill", "decode"}
    # The public API stays open: the cluster has no client keys.
    assert httpx.get(f"{cluster.master.url}/v1/models", timeout=30).status_code == 200

    stray = launch(cluster.model_dir, tmp_path, "keyless", [
        "--run_mode", "decode", "--pd_master_ip", "127.0.0.1", "--pd_master_port", str(cluster.master_port),
        "--pd_node_id", "keyless", "--max_total_token_num", "4096",
    ], {"LIGHTLLM_PD_CLUSTER_KEY": ""})
    try:
        code = stray.proc.wait(180)
    finally:
        stray.stop()
    log = stray.log()
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(errors) == 1, log
    assert "refused node 'keyless'" in errors[0] and "cluster key" in errors[0], errors[0]
    assert "Traceback" not in log


def test_injected_transfer_failures_end_requests_cleanly_and_leak_no_kv(tiny_llama_dir, tmp_path_factory, normal):
    pd = start_cluster(tiny_llama_dir, tmp_path_factory.mktemp("pd_faults"),
                       prefill_env={"LIGHTLLM_PD_TRANSFER_FAILURE_PROBABILITY": "0.2"})
    try:
        requests = [("/v1/completions", {"model": normal.model_name, "prompt": f"fault injection {i} " * (1 + i % 7),
                                         "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                         **({"stream": True, "stream_options": {"include_usage": True}} if i % 2 else {})})
                    for i in range(50)]
        answers = asyncio.run(_send_all(pd.master.url, requests))
        reference = asyncio.run(_send_all(normal.url, requests))
        ok = failed = 0
        for (path, body), (status, text), (_, ref_text) in zip(requests, answers, reference):
            if status == 200 and "\"error\"" not in text:
                assert _summary(path, status, text) == _summary(path, 200, ref_text)
                ok += 1
            else:
                # A clean error: a JSON error body, or an error event in the stream.
                payload = text if status != 200 else next(l[6:] for l in text.splitlines() if '"error"' in l)
                assert json.loads(payload)["error"]["message"], text
                failed += 1
        assert ok + failed == 50 and failed > 0 and ok > 0
        for node in pd.nodes.values():
            node.wait_idle()
            assert httpx.get(f"{node.url}/health", timeout=10).status_code == 200
            assert _kv_full(node), node.url
        # The cluster still serves.

        # Killing the decode node mid-stream reaches the client as an error within the bound.
        body = {"model": normal.model_name, "prompt": "a stream that loses its decode node", "max_tokens": 900,
                "temperature": 0, "ignore_eos": True, "stream": True}
        # Failures are still injected on P (1 in 5): a stream whose transfer failed ends with an
        # error before its first token; it is started again (ten failures would be a 1e-7 event).
        for _ in range(10):
            with httpx.stream("POST", f"{pd.master.url}/v1/completions", json=body, timeout=120) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                events = []
                while len(events) < 3:
                    line = next(lines, None)
                    if line is None or line.startswith("data: {\"error\""):
                        break
                    if line.startswith("data: {"):
                        events.append(line)
                if len(events) < 3:
                    assert line is not None and "pd_transfer_failed" in line, (events, line)
                    continue
                pd.nodes["decode"].proc.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                rest = list(lines)
                break
        assert len(events) == 3, "every try of the long stream hit an injected transfer failure"
        assert time.monotonic() - killed < DEAD_NODE_BOUND_S
        assert any('"error"' in line for line in rest), rest[-3:]
        deadline = time.monotonic() + DEAD_NODE_BOUND_S
        while httpx.get(f"{pd.master.url}/health", timeout=10).status_code == 200:
            assert time.monotonic() < deadline, "the master still reports ready without a decode node"
            time.sleep(0.2)
        refused = httpx.post(f"{pd.master.url}/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}}, timeout=60)
        assert refused.status_code == 503 and refused.json()["error"]["message"]
        pd.start_node("decode")
        pd.wait_ready()
        again_body = {"inputs": "served again", "parameters": {"max_new_tokens": 4, "ignore_eos": True, "do_sample": False}}
        # Failures are still injected on P (1 in 5): ten tries all failing would be a 1e-7 event.
        for _ in range(10):
            served = httpx.post(f"{pd.master.url}/generate", json=again_body, timeout=120)
            if served.status_code == 200:
                break
            assert served.json()["error"]["code"] == "pd_transfer_failed", served.text
        expected = httpx.post(f"{normal.url}/generate", json=again_body, timeout=120)
        assert served.status_code == 200, served.text
        assert served.json()["generated_text"] == expected.json()["generated_text"]

        # The same for the prefill node: 503 without one, then a new one (a new KV transfer
        # address, so the master pairs it with the running decode node again) serves.
        pd.nodes["prefill"].proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + DEAD_NODE_BOUND_S
        while httpx.get(f"{pd.master.url}/health", timeout=10).status_code == 200:
            assert time.monotonic() < deadline, "the master still reports ready without a prefill node"
            time.sleep(0.2)
        refused = httpx.post(f"{pd.master.url}/generate", json=again_body, timeout=60)
        assert refused.status_code == 503 and refused.json()["error"]["message"]
        pd.start_node("prefill")  # without failure injection
        pd.wait_ready()
        served = httpx.post(f"{pd.master.url}/generate", json=again_body, timeout=120)
        assert served.status_code == 200, served.text
        assert served.json()["generated_text"] == expected.json()["generated_text"]
    finally:
        pd.stop()


def test_busy_decode_node_gives_503_at_once_when_asked_and_retries_by_default(tiny_llama_dir, tmp_path_factory):
    # The decode node holds one long request's reservation and nothing else (the master admits
    # no longer requests than its nodes take: it refuses a node with a smaller limit).
    limit = ["--max_req_total_len", "560"]
    pd = start_cluster(tiny_llama_dir, tmp_path_factory.mktemp("pd_busy"),
                       decode_args=["--max_total_token_num", "600", *limit], prefill_args=limit, master_args=limit,
                       master_env={"LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS": "0"})
    long_body = {"inputs": "hold the decode node", "parameters": {"max_new_tokens": 500, "ignore_eos": True}}
    short_body = {"inputs": "no room", "parameters": {"max_new_tokens": 200, "ignore_eos": True}}

    def busy_while_long_runs() -> Tuple[int, Dict[str, Any], float]:
        with httpx.stream("POST", f"{pd.master.url}/generate_stream", json=long_body, timeout=180) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            while not next(lines).startswith("data:"):
                pass
            started = time.monotonic()
            short = httpx.post(f"{pd.master.url}/generate", json=short_body, timeout=180)
            elapsed = time.monotonic() - started
            list(lines)
        return short.status_code, short.json(), elapsed

    try:
        status, body, _ = busy_while_long_runs()
        assert status == 503 and body["error"]["code"] == "server_busy", body
        assert "decode" in body["error"]["message"]
        assert _series(pd.master, "lightllm_pd_busy_answers_total", 'role="decode"') >= 1

        pd.restart_master()  # the default: a burst waits for KV as on a normal server
        pd.wait_ready()
        status, body, _ = busy_while_long_runs()
        assert status == 200 and body["count_output_tokens"] == 200, body
        assert pd.master.metric("lightllm_pd_busy_retries_total") >= 1
    finally:
        pd.stop()


def test_n_choices_ended_by_their_first_token_are_answered_when_their_reservations_do_not_fit_together(
        tiny_llama_dir, tmp_path_factory):
    """The decode node's KV holds one choice's reservation at a time.  A choice whose first token
    ends it must release its reservation before its token leaves the master: the API waits for
    every choice's first token before answering, so the old master, which released it only when
    asked for the choice's next event, left the second choice answered busy until the retry gave
    up (and every other request waited behind it)."""
    limit = ["--max_req_total_len", "560"]
    pd = start_cluster(tiny_llama_dir, tmp_path_factory.mktemp("pd_n_first_token"),
                       decode_args=["--max_total_token_num", "600", *limit], prefill_args=limit, master_args=limit,
                       master_env={"LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS": "30"})
    url = f"{pd.master.url}/v1/completions"
    prompt = [5 + (37 * i) % 1000 for i in range(400)]  # two reservations of 401 > 600 KV tokens
    try:
        # Its KV moves to D, so D's prefix cache holds the prompt: the choices below reserve with
        # kv_start = prompt - 1 (almost nothing would need to move), as in the report.
        warm = httpx.post(url, timeout=120, json={"model": pd.master.model_name, "prompt": prompt, "max_tokens": 2,
                                                  "temperature": 0, "logprobs": 1,
                                                  "return_tokens_as_token_ids": True})
        assert warm.status_code == 200, warm.text
        first = int(warm.json()["choices"][0]["logprobs"]["tokens"][0].split(":")[1])
        one = httpx.post(url, timeout=120, json={"model": pd.master.model_name, "prompt": prompt, "max_tokens": 1,
                                                 "n": 2, "temperature": 0})
        assert one.status_code == 200, one.text
        assert [c["finish_reason"] for c in one.json()["choices"]] == ["length", "length"]
        assert one.json()["usage"]["completion_tokens"] == 2
        stopped = httpx.post(url, timeout=120, json={"model": pd.master.model_name, "prompt": prompt, "max_tokens": 20,
                                                     "n": 2, "temperature": 0, "stop_token_ids": [first],
                                                     "stream": True})
        assert stopped.status_code == 200, stopped.text
        events = [json.loads(line[len("data: "):]) for line in stopped.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert "error" not in events[-1], events[-1]
        finishes = {c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]}
        assert finishes == {0: "stop", 1: "stop"}
        # Nothing is left reserved on D (its ranks free a closed reservation between steps).
        deadline = time.monotonic() + 30
        while pd.nodes["decode"].metric("lightllm_kv_promised_tokens") != 0:
            assert time.monotonic() < deadline, "a reservation is still held on the decode node"
            time.sleep(0.2)
    finally:
        pd.stop()
