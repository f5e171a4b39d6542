"""The PD node control endpoints over real HTTP (uvicorn on loopback), with a scripted node service.

The router under test is the real one; the service behind it (standing in for
``PdNodeService``) yields scripted PdNodeEvents and records how its iterators end (an iterator
closed early is how the node aborts a request).
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from typing import Any, Dict, List, Optional

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest

from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_PREFILL
from lightllm.server.http.errors import install_error_handlers
from lightllm.server.pd.protocol.node_events import PdNodeEvent
from lightllm.server.manager_errors import ServerBusyError, ServerUnavailableError
from lightllm.server.pd.node.api import PdStreams, pd_node_router, public_api_refusal_router
from lightllm.server.pd.protocol.stream_lines import token_from_line
from lightllm.server.request_manager import GenerationEvent

VOCAB = 100
MAX_LEN = 64


def token(token_id: int, finish: Optional[str] = None, **extra: Any) -> PdNodeEvent:
    event = GenerationEvent(request_id=7, token_id=token_id, text=f"t{token_id}", logprob=-0.25, finish_reason=finish,
                            prompt_tokens=3, cached_tokens=1, completion_tokens=1, **extra)
    return PdNodeEvent(kind="token", token=event)


class ScriptedNodeManager:
    """Yields ``script`` (events, or exceptions to raise) for every generate call."""

    def __init__(self) -> None:
        self.vocab_size = VOCAB
        self.max_req_total_len = MAX_LEN
        self.metrics_registry = CollectorRegistry()
        self.script: List[Any] = []
        # When set, the iterator waits on it after the scripted events (a request still running).
        self.hold = False
        self.calls: List[Dict[str, Any]] = []
        self.closed: List[int] = []
        self.setups: List[tuple] = []
        self.teardowns: List[int] = []
        self.setup_failure: Optional[BaseException] = None

    async def transfer_setup(self, epoch: int, prefill_transfer_address: str) -> None:
        if self.setup_failure is not None:
            raise self.setup_failure
        self.setups.append((epoch, prefill_transfer_address))

    async def transfer_teardown(self, epoch: int) -> bool:
        known = any(setup[0] == epoch for setup in self.setups)
        self.setups = [setup for setup in self.setups if setup[0] != epoch]
        self.teardowns.append(epoch)
        return known

    async def generate(self, spec: RequestSpec, *, request_id: int, epoch: int, request: Any = None):
        self.calls.append({"request_id": request_id, "epoch": epoch, "prompt_ids": list(spec.prompt_ids),
                           "params": spec.params, "segment_index": spec.segment.segment_index,
                           "generated_before": spec.segment.generated_before,
                           "high_priority": spec.priority.high_priority_request,
                           "infer_high_priority": spec.priority.infer_high_priority,
                           "pd_kind": spec.pd.kind, "kv_start": spec.pd.kv_start})
        try:
            for item in list(self.script):
                if isinstance(item, BaseException):
                    raise item
                yield item
            if self.hold:
                await asyncio.Event().wait()
        finally:
            self.closed.append(request_id)


class NodeApp:
    """A decode and a prefill router, each with its own scripted manager, served by uvicorn."""

    def __init__(self) -> None:
        self.decode = ScriptedNodeManager()
        self.prefill = ScriptedNodeManager()
        self.decode_streams = PdStreams()
        decode_app = self._app(self.decode, "decode", self.decode_streams)
        prefill_app = self._app(self.prefill, "prefill", PdStreams())
        self.loops: Dict[str, asyncio.AbstractEventLoop] = {}
        self.decode_url = self._serve(decode_app, "decode")
        self.prefill_url = self._serve(prefill_app, "prefill")

    @staticmethod
    def _app(manager: ScriptedNodeManager, role: str, streams: PdStreams) -> FastAPI:
        app = FastAPI()
        install_error_handlers(app)
        app.include_router(pd_node_router(manager, role, streams))
        app.include_router(public_api_refusal_router(role, "10.0.0.9:1212"))
        return app

    def _serve(self, app: FastAPI, name: str) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))

        def run() -> None:
            self.loops[name] = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loops[name])
            self.loops[name].run_until_complete(server.serve(sockets=[sock]))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        self.servers = getattr(self, "servers", []) + [(server, thread, sock)]
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def stop(self) -> None:
        for server, thread, sock in self.servers:
            server.should_exit = True
            thread.join(timeout=10)
            sock.close()


@pytest.fixture(scope="module")
def node() -> NodeApp:
    app = NodeApp()
    yield app
    app.stop()


def decode_body(**overrides: Any) -> Dict[str, Any]:
    body = {"request_id": 7, "prompt_ids": [1, 5, 9], "params": {"max_new_tokens": 4, "temperature": 0.0},
            "segment_index": 0, "epoch": 3}
    body.update(overrides)
    return body


def prefill_body(**overrides: Any) -> Dict[str, Any]:
    return {**decode_body(), "kv_start": 1, "infer_high_priority": 0, **overrides}


def lines(response: httpx.Response) -> List[Dict[str, Any]]:
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


def metric(manager: ScriptedNodeManager, name: str, **labels: str) -> float:
    value = manager.metrics_registry.get_sample_value(name, {"role": labels.pop("role", "decode"), **labels})
    return 0.0 if value is None else value


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


def _wait(predicate, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_master_closing_the_stream_aborts_the_request(node: NodeApp) -> None:
    node.decode.script = [PdNodeEvent(kind="reserved", kv_start=0)]
    node.decode.hold = True
    closed = len(node.decode.closed)
    try:
        with httpx.stream("POST", f"{node.decode_url}/pd/node/decode", json=decode_body(request_id=8), timeout=10) as r:
            first = next(r.iter_lines())
            assert json.loads(first) == {"event": "reserved", "kv_start": 0}
        _wait(lambda: len(node.decode.closed) > closed, "the node to abort the request")
        assert node.decode.closed[-1] == 8
        _wait(lambda: len(node.decode_streams) == 0, "the stream to be forgotten")
    finally:
        node.decode.hold = False


def test_losing_the_master_fails_open_streams(node: NodeApp) -> None:
    node.decode.script = [PdNodeEvent(kind="reserved", kv_start=0), token(4)]
    node.decode.hold = True
    closed = len(node.decode.closed)
    try:
        with httpx.stream("POST", f"{node.decode_url}/pd/node/decode", json=decode_body(request_id=9), timeout=10) as r:
            received = r.iter_lines()
            assert json.loads(next(received))["event"] == "reserved"
            assert json.loads(next(received))["event"] == "token"
            _wait(lambda: len(node.decode_streams) == 1, "the stream to be registered")
            node.loops["decode"].call_soon_threadsafe(node.decode_streams.fail_all, "the PD master is gone")
            rest = [json.loads(line) for line in received]
        assert rest == [{"event": "error", "message": "the PD master is gone", "transfer_broken": False, "error_kind": "internal"}]
        _wait(lambda: len(node.decode.closed) > closed, "the node to abort the request")
    finally:
        node.decode.hold = False


def test_losing_the_master_fails_a_request_still_waiting_for_its_first_event(node: NodeApp) -> None:
    node.decode.script = []
    node.decode.hold = True
    closed = len(node.decode.closed)
    result: Dict[str, Any] = {}

    def call() -> None:
        result["response"] = httpx.post(f"{node.decode_url}/pd/node/decode", json=decode_body(request_id=10), timeout=20)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        _wait(lambda: len(node.decode_streams) == 1, "the request to reach the node")
        node.loops["decode"].call_soon_threadsafe(node.decode_streams.fail_all, "the PD master is gone")
        caller.join(20)
    finally:
        node.decode.hold = False
    assert lines(result["response"]) == [{"event": "error", "message": "the PD master is gone", "transfer_broken": False, "error_kind": "internal"}]
    _wait(lambda: len(node.decode.closed) > closed, "the node to abort the request")


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
