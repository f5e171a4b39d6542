"""The PD node control endpoints' handlers called alone (no server, no router): ``PdNodeEndpoints``
bound to the scripted node service of ``pd_node_api_support``.  Over real HTTP they are tested in
``test_pd_node_api.py``."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Dict, List

import pytest
from fastapi import Request
from fastapi.responses import StreamingResponse

from pd_node_api_support import ScriptedNodeManager, decode_body, token
from lightllm.server.http.errors import APIError
from lightllm.server.manager_errors import ServerUnavailableError
from lightllm.server.pd.node.api import PdNodeEndpoints
from lightllm.server.pd.node.open_streams import PdStreams


def post(path: str, body: Dict[str, Any]) -> Request:
    """A POST request of ``body`` as JSON, whose client stays connected."""
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> Dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # connected: no disconnect message ever comes
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}
    return Request(scope, receive)


def body_of(response: Any) -> Any:
    return json.loads(response.body)


def test_transfer_setup_answers_its_epoch_and_maps_failures() -> None:
    node = ScriptedNodeManager()
    endpoints = PdNodeEndpoints(node, "decode")
    setup = {"epoch": 3, "peer_node_id": "p0", "prefill_transfer_address": "127.0.0.1:5000"}

    response = asyncio.run(endpoints.transfer_setup(post("/pd/node/transfer_setup", setup)))
    assert (response.status_code, body_of(response)) == (200, {"epoch": 3})
    assert node.setups == [(3, "127.0.0.1:5000")]

    for failure, status, code in ((ValueError("bad address"), 400, "pd_transfer_setup_refused"),
                                  (RuntimeError("rank 0 did not answer"), 503, "pd_transfer_setup_failed")):
        node.setup_failure = failure
        with pytest.raises(APIError) as raised:
            asyncio.run(endpoints.transfer_setup(post("/pd/node/transfer_setup", setup)))
        assert (raised.value.status_code, raised.value.code) == (status, code)
        assert str(failure) in raised.value.message


def test_transfer_teardown_says_whether_the_epoch_was_known() -> None:
    node = ScriptedNodeManager()
    node.setups = [(5, "127.0.0.1:5000")]
    endpoints = PdNodeEndpoints(node, "prefill")
    answers = [asyncio.run(endpoints.transfer_teardown(post("/pd/node/transfer_teardown", {"epoch": 5})))
               for _ in range(2)]
    assert [body_of(answer) for answer in answers] == [{"epoch": 5, "known": True}, {"epoch": 5, "known": False}]


def test_other_role_path_is_a_404_naming_the_role_that_serves_it() -> None:
    endpoints = PdNodeEndpoints(ScriptedNodeManager(), "prefill")
    response = asyncio.run(endpoints.other_role(post("/pd/node/decode", decode_body())))
    assert response.status_code == 404
    error = body_of(response)["error"]
    assert error["code"] == "wrong_pd_role" and "prefill node" in error["message"] and "decode nodes" in error["message"]


def test_node_request_refused_before_its_first_event_is_an_error_status() -> None:
    node = ScriptedNodeManager()
    node.script = [ServerUnavailableError("the node is stopping", "server_shutting_down")]
    streams = PdStreams()
    endpoints = PdNodeEndpoints(node, "decode", streams)
    response = asyncio.run(endpoints.node_request(post("/pd/node/decode", decode_body())))
    assert response.status_code == 503
    assert body_of(response)["error"]["code"] == "server_shutting_down"
    assert len(streams) == 0 and node.closed == [7]


def test_node_request_streams_its_events_as_lines_and_lets_go_of_the_stream() -> None:
    node = ScriptedNodeManager()
    node.script = [token(11), token(12, "stop")]
    streams = PdStreams()
    endpoints = PdNodeEndpoints(node, "decode", streams)

    async def answer() -> List[Dict[str, Any]]:
        response = await endpoints.node_request(post("/pd/node/decode", decode_body()))
        assert isinstance(response, StreamingResponse) and len(streams) == 1
        return [json.loads(chunk) async for chunk in response.body_iterator]

    got = asyncio.run(answer())
    assert [(line["event"], line["token_id"], line["finish_reason"]) for line in got] == [
        ("token", 11, None), ("token", 12, "stop")]
    assert len(streams) == 0 and node.closed == [7]


def test_only_prefill_and_decode_nodes_have_endpoints() -> None:
    with pytest.raises(ValueError, match="pd_master"):
        PdNodeEndpoints(ScriptedNodeManager(), "pd_master")
