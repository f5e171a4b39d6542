"""The PD node's open streams when the master goes away (it closes a stream, or the node loses it):
the request is aborted on the node and the stream ends with an error line.  Real HTTP, scripted
node service (``pd_node_api_support``).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Any, Dict

import httpx

from pd_node_api_support import NodeApp, decode_body, lines, node, prefill_body, token
from lightllm.server.pd.protocol.node_events import PdNodeEvent


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


def test_a_request_placed_again_under_a_live_id_replaces_the_previous_placement(node: NodeApp) -> None:
    """The master gave the first placement up (its other node failed) and sends the request again:
    the node ends the first one at once, without waiting to notice the closed stream."""
    node.decode.script = [PdNodeEvent(kind="reserved", kv_start=0)]
    node.decode.hold = True
    closed = len(node.decode.closed)
    try:
        with httpx.stream("POST", f"{node.decode_url}/pd/node/decode", json=decode_body(request_id=11),
                          timeout=10) as first:
            first_lines = first.iter_lines()
            assert json.loads(next(first_lines))["event"] == "reserved"
            with httpx.stream("POST", f"{node.decode_url}/pd/node/decode", json=decode_body(request_id=11),
                              timeout=10) as second:
                # Held in a name: a dropped line iterator closes httpx's stream, and the node then sees
                # the master close this placement too (the test failed that way on a loaded machine).
                second_lines = second.iter_lines()
                assert json.loads(next(second_lines))["event"] == "reserved"
                _wait(lambda: 11 in node.decode.closed[closed:], "the previous placement to be aborted")
                assert list(first_lines) == []  # ended without a line: nobody reads it
                assert len(node.decode_streams) == 1
    finally:
        node.decode.hold = False


def test_a_master_gone_as_the_request_ends_without_an_event_is_no_error(node: NodeApp, caplog) -> None:
    # The master closes its stream (its client left) and the node's request ends with no event:
    # an everyday event, answered 499 with an INFO line (it was two ERROR lines and a 500).
    node.prefill.script = []
    node.prefill.end_when_master_leaves = True
    closed = len(node.prefill.closed)
    payload = json.dumps(prefill_body(request_id=11)).encode()
    host, port = node.prefill_url.removeprefix("http://").split(":")
    try:
        with caplog.at_level(logging.INFO, logger="lightllm.server.pd.node.api"):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(b"POST /pd/node/prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
                _wait(lambda: len(node.prefill.calls) > 0 and node.prefill.calls[-1]["request_id"] == 11,
                      "the request to reach the node")
            _wait(lambda: len(node.prefill.closed) > closed, "the node to end the request")
            _wait(lambda: "went away before the first event" in caplog.text, "the node to log the master's leaving")
    finally:
        node.prefill.end_when_master_leaves = False
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING], caplog.text
