"""The PD node control endpoints over real HTTP (uvicorn on loopback), with a scripted node service
(``pd_node_api_support``): the stream lines, refusals, transfer setup and teardown, and metrics.
What happens to open streams when the master goes away is in ``test_pd_node_master_loss.py``.
"""

from __future__ import annotations

import math
from typing import Any, Dict

import httpx
import pytest
from prometheus_client import generate_latest

from pd_node_api_support import (
    MAX_LEN, VOCAB, NodeApp, ScriptedNodeManager, decode_body, lines, metric, node, prefill_body, token,
)
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_PREFILL
from lightllm.server.manager_errors import ServerBusyError, ServerUnavailableError
from lightllm.server.pd.node.api import pd_node_router
from lightllm.server.pd.protocol.node_events import PdNodeEvent
from lightllm.server.pd.protocol.stream_lines import token_from_line


def test_decode_stream_lines_metrics_and_arguments(node: NodeApp) -> None:
    node.decode.script = [
        PdNodeEvent(kind="reserved", kv_start=2),
        PdNodeEvent(kind="token", token=token(11).token, transfer_seconds=0.02, transfer_bytes=8192),
        token(12, top_logprobs={12: -0.25, 40: -float("inf")}),
        token(13, "length"),
    ]
    before = metric(node.decode, "lightllm_pd_kv_transfer_seconds_count")
    response = httpx.post(f"{node.decode_url}/pd/node/decode", json=decode_body(), timeout=10)
    assert response.status_code == 200
    got = lines(response)
    assert got[0] == {"event": "reserved", "kv_start": 2}
    assert got[1] == {"event": "token", "token_id": 11, "text": "t11", "logprob": -0.25, "top_logprobs": None,
                      "finish_reason": None, "cached_tokens": 1}
    assert "prompt_logprobs" not in got[1]  # only the prefill node's first token carries them
    assert got[2]["top_logprobs"] == [[12, -0.25], [40, -math.inf]]
    assert [line.get("finish_reason") for line in got[1:]] == [None, None, "length"]
    # The master reads a line back into the event it came from.
    back = token_from_line(got[2], 7, 3, 2)
    assert back.top_logprobs == {12: -0.25, 40: -math.inf} and back.token_id == 12
    call = node.decode.calls[-1]
    assert call["request_id"] == 7 and call["prompt_ids"] == [1, 5, 9] and call["epoch"] == 3
    assert call["segment_index"] == 0 and call["high_priority"] is False
    assert (call["pd_kind"], call["kv_start"], call["infer_high_priority"]) == (PD_KIND_DECODE, 0, 0)
    assert call["params"].max_new_tokens == 4 and call["params"].temperature == 0.0
    assert metric(node.decode, "lightllm_pd_kv_transfer_seconds_count") == before + 1
    assert metric(node.decode, "lightllm_pd_kv_transfer_bytes_sum") >= 8192


def test_busy_segment_end_and_errors_end_the_stream_and_are_counted(node: NodeApp) -> None:
    cases = [
        ([PdNodeEvent(kind="busy", message="no KV"), token(99)], {"event": "busy", "message": "no KV"},
         ("lightllm_pd_busy_answers_total", {})),
        ([PdNodeEvent(kind="reserved"), PdNodeEvent(kind="segment_end", reason="kv_pressure"), token(99)],
         {"event": "segment_end", "reason": "kv_pressure"},
         ("lightllm_pd_segment_ends_total", {"reason": "kv_pressure"})),
        ([PdNodeEvent(kind="reserved"), PdNodeEvent(kind="error", message="lease gone", error_kind="lease_expired")],
         {"event": "error", "message": "lease gone", "transfer_broken": False, "error_kind": "lease_expired"},
         ("lightllm_pd_expired_leases_total", {})),
        ([PdNodeEvent(kind="reserved"),
          PdNodeEvent(kind="error", message="bad checksum", transfer_broken=True, error_kind="transfer_failed")],
         {"event": "error", "message": "bad checksum", "transfer_broken": True, "error_kind": "transfer_failed"},
         ("lightllm_pd_failed_transfers_total", {})),
    ]
    for script, last, (counter, labels) in cases:
        node.decode.script = script
        before = metric(node.decode, counter, **labels)
        response = httpx.post(f"{node.decode_url}/pd/node/decode", json=decode_body(), timeout=10)
        got = lines(response)
        assert got[-1] == last, got  # nothing after the ending event
        assert metric(node.decode, counter, **labels) == before + 1
        assert node.decode.closed[-1] == 7  # the node's iterator was closed (request ended)


def test_prefill_stream_carries_prompt_logprobs_and_passes_priority(node: NodeApp) -> None:
    first = token(21, prompt_logprobs=[(5, -1.5, {5: -1.5, 8: -2.0}, 1)]).token
    node.prefill.script = [PdNodeEvent(kind="token", token=first),
                           PdNodeEvent(kind="handed_off", transfer_seconds=0.5, transfer_bytes=4096)]
    response = httpx.post(f"{node.prefill_url}/pd/node/prefill",
                          json=prefill_body(segment_index=2, infer_high_priority=-1, kv_start=2,
                                            high_priority_request=True), timeout=10)
    got = lines(response)
    assert got[0]["prompt_logprobs"] == [[5, -1.5, {"5": -1.5, "8": -2.0}, 1]]
    # The prompt token's rank travels with its logprob.
    assert token_from_line(got[0], 7, 3, 1).prompt_logprobs == [(5, -1.5, {5: -1.5, 8: -2.0}, 1)]
    assert got[1] == {"event": "handed_off"}
    call = node.prefill.calls[-1]
    assert (call["kv_start"], call["infer_high_priority"], call["segment_index"]) == (2, -1, 2)
    assert call["pd_kind"] == PD_KIND_PREFILL
    assert call["high_priority"] is True
    assert metric(node.prefill, "lightllm_pd_kv_transfer_seconds_sum", role="prefill") == pytest.approx(0.5)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/pd/node/decode", decode_body(extra=1), "extra"),
        ("/pd/node/decode", {k: v for k, v in decode_body().items() if k != "epoch"}, "epoch"),
        ("/pd/node/decode", decode_body(request_id="7"), "request_id"),
        ("/pd/node/decode", decode_body(request_id=-1), "request_id"),
        ("/pd/node/decode", decode_body(epoch=True), "epoch"),
        ("/pd/node/decode", decode_body(segment_index=-1), "segment_index"),
        ("/pd/node/decode", decode_body(prompt_ids=[]), "prompt_ids"),
        ("/pd/node/decode", decode_body(prompt_ids=[1, 2.0]), "prompt_ids.1"),
        ("/pd/node/decode", decode_body(prompt_ids=[1, VOCAB]), "prompt_ids"),
        ("/pd/node/decode", decode_body(params={"max_new_tokens": 4, "nucleus": 1}), "params.nucleus"),
        ("/pd/node/decode", decode_body(params={"temperature": -1}), "params.temperature"),
        ("/pd/node/decode", decode_body(params={"max_new_tokens": MAX_LEN}), "params.max_new_tokens"),
        ("/pd/node/decode", decode_body(params=[1]), "params"),
        ("/pd/node/prefill", prefill_body(kv_start=4), "kv_start"),
        ("/pd/node/prefill", prefill_body(kv_start=3), "kv_start"),  # at least one prompt position is sent
        ("/pd/node/prefill", prefill_body(kv_start=-1), "kv_start"),
        ("/pd/node/decode", decode_body(generated_before=1), "generated_before"),  # a first segment's is 0
        ("/pd/node/decode", decode_body(high_priority_request=1), "high_priority_request"),
        ("/pd/node/prefill", prefill_body(infer_high_priority=-1), "infer_high_priority"),
        ("/pd/node/prefill", prefill_body(infer_high_priority=2**40, segment_index=1), "infer_high_priority"),
        ("/pd/node/transfer_setup", {"epoch": 1, "peer_node_id": "p0", "prefill_transfer_address": "p0"},
         "prefill_transfer_address"),
        ("/pd/node/transfer_setup", {"epoch": 1, "peer_node_id": "p0", "prefill_transfer_address": "h:70000"},
         "prefill_transfer_address"),
        ("/pd/node/transfer_setup", {"epoch": 1, "peer_node_id": "p0", "prefill_transfer_address": "h:1", "x": 1},
         "x"),
    ],
)
def test_invalid_bodies_are_refused_naming_the_field(node: NodeApp, path: str, body: Dict[str, Any], param: str) -> None:
    url = node.prefill_url if path == "/pd/node/prefill" else node.decode_url
    calls = len(node.decode.calls) + len(node.prefill.calls)
    response = httpx.post(f"{url}{path}", json=body, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"]
    assert len(node.decode.calls) + len(node.prefill.calls) == calls  # nothing reached the manager


def test_malformed_json_wrong_role_and_public_endpoints(node: NodeApp) -> None:
    response = httpx.post(f"{node.decode_url}/pd/node/decode", content=b"{nope", timeout=10)
    assert response.status_code == 400 and "Malformed JSON" in response.json()["error"]["message"]
    response = httpx.post(f"{node.decode_url}/pd/node/prefill", json=prefill_body(), timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "wrong_pd_role"
    assert "decode node" in response.json()["error"]["message"]
    for path in ("/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions"):
        response = httpx.post(f"{node.prefill_url}{path}", json={"inputs": "hi"}, timeout=10)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "pd_node_not_public" and "PD master at 10.0.0.9:1212" in error["message"]


def test_refusals_before_the_stream_are_json_errors(node: NodeApp) -> None:
    node.decode.script = [ServerUnavailableError("The server is shutting down", "server_shutting_down")]
    response = httpx.post(f"{node.decode_url}/pd/node/decode", json=decode_body(), timeout=10)
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "The server is shutting down"
    node.decode.script = [ServerBusyError("no free request slot")]
    busy = metric(node.decode, "lightllm_pd_busy_answers_total")
    got = lines(httpx.post(f"{node.decode_url}/pd/node/decode", json=decode_body(), timeout=10))
    assert got == [{"event": "busy", "message": "no free request slot"}]
    assert metric(node.decode, "lightllm_pd_busy_answers_total") == busy + 1
    node.decode.script = [ValueError("request_id 7 is in use")]
    response = httpx.post(f"{node.decode_url}/pd/node/decode", json=decode_body(), timeout=10)
    assert response.status_code == 400 and "in use" in response.json()["error"]["message"]


def test_a_failure_mid_stream_is_an_error_line(node: NodeApp) -> None:
    node.decode.script = [PdNodeEvent(kind="reserved"), token(1), RuntimeError("boom")]
    got = lines(httpx.post(f"{node.decode_url}/pd/node/decode", json=decode_body(), timeout=10))
    assert got[-1]["event"] == "error" and "boom" not in got[-1]["message"]  # no internals to the master
    assert got[-1]["transfer_broken"] is False


def test_transfer_setup(node: NodeApp) -> None:
    body = {"epoch": 4, "peer_node_id": "prefill-127.0.0.1:8100", "prefill_transfer_address": "127.0.0.1:29000"}
    response = httpx.post(f"{node.decode_url}/pd/node/transfer_setup", json=body, timeout=10)
    assert response.status_code == 200 and response.json() == {"epoch": 4}
    assert node.decode.setups[-1] == (4, "127.0.0.1:29000")
    node.decode.setup_failure = TimeoutError("rank 0 did not confirm within 60 s")
    try:
        response = httpx.post(f"{node.decode_url}/pd/node/transfer_setup", json={**body, "epoch": 5}, timeout=10)
    finally:
        node.decode.setup_failure = None
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "pd_transfer_setup_failed" and "did not confirm" in error["message"]


def test_transfer_teardown_answers_whether_the_epoch_was_known(node: NodeApp) -> None:
    body = {"epoch": 11, "peer_node_id": "prefill-127.0.0.1:8100", "prefill_transfer_address": "127.0.0.1:29000"}
    assert httpx.post(f"{node.decode_url}/pd/node/transfer_setup", json=body, timeout=10).status_code == 200
    first = httpx.post(f"{node.decode_url}/pd/node/transfer_teardown", json={"epoch": 11}, timeout=10)
    again = httpx.post(f"{node.decode_url}/pd/node/transfer_teardown", json={"epoch": 11}, timeout=10)
    assert (first.status_code, first.json()) == (200, {"epoch": 11, "known": True})
    assert (again.status_code, again.json()) == (200, {"epoch": 11, "known": False})  # idempotent
    assert node.decode.teardowns[-2:] == [11, 11]
    for bad, param in (({"epoch": -1}, "epoch"), ({"epoch": "3"}, "epoch"), ({}, "epoch"), ({"epoch": 1, "x": 0}, "x")):
        response = httpx.post(f"{node.decode_url}/pd/node/transfer_teardown", json=bad, timeout=10)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert node.decode.teardowns[-1] == 11  # nothing invalid reached the service


def test_metrics_families_exist_from_the_start() -> None:
    manager = ScriptedNodeManager()
    pd_node_router(manager, "decode")
    text = generate_latest(manager.metrics_registry).decode()
    for name in ("lightllm_pd_kv_transfer_seconds_bucket", "lightllm_pd_kv_transfer_bytes_bucket",
                 "lightllm_pd_failed_transfers_total", "lightllm_pd_expired_leases_total",
                 "lightllm_pd_busy_answers_total"):
        assert name in text
    assert 'lightllm_pd_segment_ends_total{reason="segment_limit",role="decode"} 0.0' in text
    with pytest.raises(ValueError):
        pd_node_router(manager, "pd_master")
