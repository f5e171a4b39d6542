"""Clients that half-close their sending side after a complete request (``nc -N``, socat, HTTP/1.0 scripts).

A request that generates nothing (``GET``/``HEAD``/``OPTIONS``) is answered, then the connection
closed; a generation request is taken as its client gone, as before (the disconnect tests rely on
it).  A real uvicorn server with the guarded protocol, on loopback.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Iterator, Tuple

import pytest
import uvicorn

from api_fakes import MODEL, FakeManager
from lightllm.server.http.app import create_app
from lightllm.server.http.transport.protocol import guarded_protocol_class
from lightllm.server.http.server_options import HttpLimits, HttpServerOptions

LIMITS = HttpLimits(header_timeout=5, body_timeout=5, keep_alive_timeout=5, send_timeout=2)


@pytest.fixture(scope="module")
def server() -> Iterator[Tuple[uvicorn.Server, int]]:
    """The app around a scripted manager behind the guarded protocol; (server, port)."""
    manager = FakeManager()
    # A generation outlasts the EOF's arrival however busy the machine: its answer can never win that race.
    manager.step_seconds = 0.5
    app = create_app(manager, HttpServerOptions(limits=LIMITS))
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", http=guarded_protocol_class(LIMITS),
                            timeout_keep_alive=LIMITS.keep_alive_timeout)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield uv, sock.getsockname()[1]
    uv.should_exit = uv.force_exit = True
    thread.join(10)


def _half_closed(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data``, shut down the sending side, and read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return received
            received += chunk


@pytest.mark.parametrize(("head", "status"), [
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 200),
    (b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n", 200),
    (b"GET /metrics HTTP/1.0\r\n\r\n", 200),
    (b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n", 200),
    (b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"OPTIONS /v1/completions HTTP/1.1\r\nHost: x\r\nOrigin: https://a.example\r\n"
     b"Access-Control-Request-Method: POST\r\n\r\n", 200),
])
def test_a_request_that_generates_nothing_is_answered_after_a_half_close(server, head: bytes, status: int) -> None:
    _, port = server
    answer = _half_closed(port, head)  # returns once the server closed: it does after the answer
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    if head.startswith(b"GET /v1/models"):
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["data"][0]["id"] == MODEL


def test_pipelined_requests_are_answered_after_a_half_close_up_to_a_generation(server) -> None:
    _, port = server
    models = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    answer = _half_closed(port, b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n" + models + models)
    assert answer.count(b"HTTP/1.1 200 ") == 3 and b'"version"' in answer
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2}).encode()
    generation = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body)) + body
    answer = _half_closed(port, models + generation + models)
    assert answer.count(b"HTTP/1.1 ") == 1  # the generation is a client gone, and nothing follows it


def test_a_generation_request_is_a_client_gone_after_a_half_close(server) -> None:
    _, port = server
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    started = time.monotonic()
    assert _half_closed(port, head + body) == b""  # no answer: the connection is closed
    assert time.monotonic() - started < 10.0  # closed, not answered after the generation (a generous bound)


def test_clients_that_closed_altogether_leave_no_connection_open(server) -> None:
    uv, port = server
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.shutdown(socket.SHUT_WR)
        # closed at once, before reading anything
    deadline = time.monotonic() + LIMITS.send_timeout + 3
    while uv.server_state.connections:
        assert time.monotonic() < deadline, f"{len(uv.server_state.connections)} connection(s) still open"
        time.sleep(0.05)
