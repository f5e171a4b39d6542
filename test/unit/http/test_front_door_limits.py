"""The front door on real sockets: per-client and global connection limits, probes, hand-over to uvicorn.

A real uvicorn server (the app around a scripted manager) runs behind a real front door on
loopback. Clients from a second address use 127.0.0.2 as their source (Linux routes all of
127.0.0.0/8 to loopback), so the server sees two different peers.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from typing import Iterator, List, Tuple

import pytest

from api_fakes import FakeManager
from uvicorn_in_thread import serving_behind_front_door
from lightllm.server.http.transport.front_door import FrontDoor
from lightllm.server.http.transport.probe_parsing import head_headers, health_path, may_be_health
from lightllm.server.http.server_options import AuthPolicy, HttpLimits, HttpServerOptions
from lightllm.server.http.transport.listen_sockets import bind_listeners

KEY = "front-door-test-key"
LIMITS = HttpLimits(header_timeout=20, body_timeout=5, keep_alive_timeout=5, max_connections=6,
                    max_connections_per_client=3)
OTHER_PEER = "127.0.0.2"


def _can_bind_other_peer() -> bool:
    try:
        with socket.socket() as sock:
            sock.bind((OTHER_PEER, 0))
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _can_bind_other_peer(), reason="127.0.0.2 is not a loopback address here")


@pytest.fixture()
def served() -> Iterator[Tuple[FrontDoor, int]]:
    """A front door serving the app on a free port; yields it and the port."""
    options = HttpServerOptions(limits=LIMITS, auth=AuthPolicy(api_keys=(KEY,)))
    with serving_behind_front_door(FakeManager(), options) as door:
        yield door, door.port


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    sock.settimeout(10)
    return sock


def _request(port: int, method: str, path: str, source: str = "127.0.0.1", key: str | None = None,
             body: bytes = b"") -> Tuple[int, dict]:
    """One request on a fresh connection; (status, JSON body)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    if key:
        head += f"Authorization: Bearer {key}\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    with _connect(port, source) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        return _read_answer(sock)


def _read_answer(sock: socket.socket) -> Tuple[int, dict]:
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload) if payload else {}


def _hold(port: int, count: int, source: str = "127.0.0.1") -> List[socket.socket]:
    """``count`` connections that send one byte of a request and then nothing."""
    held = [_connect(port, source) for _ in range(count)]
    for sock in held:
        sock.sendall(b"G")
    return held


def test_a_client_beyond_its_limit_is_refused_while_others_and_health_are_served(served) -> None:
    _, port = served
    held = _hold(port, LIMITS.max_connections_per_client)
    try:
        with _connect(port) as extra:
            status, body = _read_answer(extra)
        assert status == 503 and body["error"]["code"] == "too_many_client_connections"
        assert "--http_max_connections_per_client" in body["error"]["message"]
        assert _request(port, "GET", "/v1/models", OTHER_PEER, KEY)[0] == 200
        assert _request(port, "GET", "/health", OTHER_PEER) == (200, {"status": "ok"})
        generate = json.dumps({"inputs": "hello", "parameters": {"max_new_tokens": 2}}).encode()
        assert _request(port, "POST", "/generate", OTHER_PEER, KEY, generate)[0] == 200
    finally:
        for sock in held:
            sock.close()


def test_beyond_the_cap_probes_and_keyed_requests_are_served_others_refused(served) -> None:
    _, port = served
    held = _hold(port, 3) + _hold(port, 3, OTHER_PEER)  # the cap (6), from two clients of 3
    try:
        assert _request(port, "GET", "/health/live", "127.0.0.3") == (200, {"status": "alive"})
        status, body = _request(port, "GET", "/v1/models", "127.0.0.3")
        assert status == 503 and body["error"]["code"] == "too_many_connections"
        assert _request(port, "GET", "/health", "127.0.0.3") == (200, {"status": "ok"})
        assert _request(port, "GET", "/v1/models", "127.0.0.3", KEY)[0] == 200
    finally:
        for sock in held:
            sock.close()


def test_closed_connections_give_their_places_back(served) -> None:
    _, port = served
    for _ in range(3):
        held = _hold(port, LIMITS.max_connections_per_client)
        for sock in held:
            sock.close()
        # The front door sees each close when it next reads; until then this client may still be full.
        deadline = time.monotonic() + 10
        while _request(port, "GET", "/v1/models", key=KEY)[0] != 200:
            assert time.monotonic() < deadline, "closed connections still count against the client"
            time.sleep(0.05)


def test_a_starting_server_answers_probes_and_refuses_requests() -> None:
    door = FrontDoor(bind_listeners("127.0.0.1", 0), LIMITS, AuthPolicy())
    door.start()
    try:
        assert _request(door.port, "GET", "/health/live") == (200, {"status": "alive"})
        for path in ("/health", "/health/ready", "/v1/models"):
            status, body = _request(door.port, "GET", path)
            assert status == 503 and body["error"]["code"] == "server_starting", path
        door.stop_serving()
        status, body = _request(door.port, "GET", "/v1/models")
        assert status == 503 and body["error"]["code"] == "server_shutting_down"
    finally:
        door.close()


@pytest.mark.parametrize("problem, code", [
    (("server_failed", "The server failed: its router process exited"), "server_failed"),
    (("server_shutting_down", "The server is shutting down"), "server_shutting_down"),
    (None, "server_shutting_down"),
])
def test_a_stopped_door_names_why_it_refuses(problem, code) -> None:
    """After a child died, a request on a fresh connection says ``server_failed``, as the probes do."""
    import asyncio

    door = FrontDoor(bind_listeners("127.0.0.1", 0), LIMITS, AuthPolicy())
    door.start()
    loop = asyncio.new_event_loop()
    try:
        door.serve(loop, lambda: None, lambda: problem)
        door.stop_serving()
        status, body = _request(door.port, "GET", "/v1/models")
        assert status == 503 and body["error"]["code"] == code, body
    finally:
        door.close()
        loop.close()


def test_probe_recognition() -> None:
    assert health_path(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n") == "/health"
    assert health_path(b"HEAD /health/live?x=1 HTTP/1.0\r\n\r\n") == "/health/live"
    assert health_path(b"POST /health HTTP/1.1\r\n\r\n") is None
    assert health_path(b"GET /healthy HTTP/1.1\r\n\r\n") is None
    # LightLLM's names for the probes are probes too.
    assert [health_path(f"GET {path} HTTP/1.1\r\n\r\n".encode()) for path in ("/healthz", "/liveness", "/readiness")] == [
        "/healthz", "/liveness", "/readiness"]
    assert health_path(b"GET /health HTTP/1.1\r\nHost: x\r\n") is None  # head not complete yet
    assert may_be_health(b"GE") and may_be_health(b"GET /heal") and may_be_health(b"GET /health/re")
    assert may_be_health(b"GET /health HTTP/1.1\r\nHost")
    assert not may_be_health(b"POST /generate") and not may_be_health(b"GET /v1/models HTTP/1.1\r\n")


def test_upgrade_requests_are_served_as_plain_http_and_give_their_places_back(served) -> None:
    """uvicorn would hand an upgrade to its WebSocket protocol, and the front door never heard that
    connection close: three of them filled this client's limit for good."""
    _, port = served
    upgrade = (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
               b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    for _ in range(2 * LIMITS.max_connections_per_client):
        with _connect(port) as sock:
            sock.sendall(upgrade)
            sock.shutdown(socket.SHUT_WR)
            status, body = _read_answer(sock)
        assert status == 401 and body["error"]["type"], body  # the app's answer to GET / without a key
    deadline = time.monotonic() + 10
    while _request(port, "GET", "/v1/models", key=KEY)[0] != 200:
        assert time.monotonic() < deadline, "upgrade requests still count against the client"
        time.sleep(0.05)


def test_a_client_refused_at_accept_reads_the_refusal_while_sending_its_request(served) -> None:
    """The refusal is sent before the request arrives; the server reads the request instead of
    resetting the connection, so the client reads the 503 rather than a broken pipe."""
    _, port = served
    held = _hold(port, LIMITS.max_connections_per_client)
    body = b"{" + b" " * 200_000 + b"}"
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    try:
        for _ in range(3):
            with _connect(port) as sock:
                # The refusal has arrived (it came first); then the client sends its request.
                assert select.select([sock], [], [], 10)[0]
                sock.sendall(head)
                time.sleep(0.05)
                sock.sendall(body)
                status, answer = _read_answer(sock)
            assert status == 503 and answer["error"]["code"] == "too_many_client_connections"
    finally:
        for sock in held:
            sock.close()


def test_heads_with_bare_line_feeds_are_read_like_uvicorn_reads_them(served) -> None:
    _, port = served
    with _connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\nHost: x\n\n")
        assert _read_answer(sock) == (200, {"status": "ok"})
    with _connect(port) as sock:
        sock.sendall(f"GET /v1/models HTTP/1.1\nHost: x\nAuthorization: Bearer {KEY}\nConnection: close\n\n".encode())
        assert _read_answer(sock)[0] == 200
    # Not a probe the front door answers (HTTP/2.0 on an HTTP/1 port): handed on at once, not held to 408.
    started = time.monotonic()
    with _connect(port) as sock:
        sock.sendall(b"GET /health/live HTTP/2.0\r\nHost: x\r\n\r\n")
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(65536):
            pass
    assert time.monotonic() - started < LIMITS.header_timeout / 2


def test_probe_recognition_of_bare_line_feeds() -> None:
    assert health_path(b"GET /health HTTP/1.1\nHost: x\n\n") == "/health"
    assert health_path(b"GET /health/live HTTP/1.1\r\nHost: x\n\r\n") == "/health/live"
    assert health_path(b"GET /health HTTP/1.1\nHost: x\n") is None
    assert health_path(b"GET /health HTTP/2.0\r\n\r\n") is None
    assert not may_be_health(b"GET /health HTTP/2.0\r\n")
    assert head_headers(b"GET / HTTP/1.1\nHost: x\r\nAuthorization: Bearer k\n\nbody: no") == [
        (b"host", b"x"), (b"authorization", b"Bearer k")]


def _keyed_keep_alive(port: int, source: str) -> Tuple[socket.socket, int]:
    """A keyed ``GET /v1/models`` that keeps its connection open; (the socket, the status)."""
    sock = _connect(port, source)
    sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return sock, int(head.split()[1])


def test_connections_served_from_the_reserve_keep_holding_it(served) -> None:
    """A keyed connection left the reserve's count once its head was read: keyed clients held 60
    connections on a cap of 20 and a reserve of 16, past the open-file limit sized for both."""
    _, port = served
    held = _hold(port, 3) + _hold(port, 3, OTHER_PEER)  # the cap (6)
    reserve = LIMITS.reserve_connections
    keyed: List[socket.socket] = []
    try:
        for index in range(reserve):
            sock, status = _keyed_keep_alive(port, f"127.0.1.{index + 1}")
            keyed.append(sock)
            assert status == 200, index
        status, body = _request(port, "GET", "/v1/models", "127.0.2.1", KEY)
        assert status == 503 and body["error"]["code"] == "too_many_connections"
        assert "serves 16 more from its reserve" in body["error"]["message"]
        # A probe is still read and answered: heads being read have a reserve budget of their own.
        assert _request(port, "GET", "/health", "127.0.2.3") == (200, {"status": "ok"})
        keyed.pop().close()  # a reserve place comes back when its connection closes
        deadline = time.monotonic() + 10
        while _request(port, "GET", "/v1/models", "127.0.2.2", KEY)[0] != 200:
            assert time.monotonic() < deadline, "a closed reserve connection still holds its place"
            time.sleep(0.05)
    finally:
        for sock in held + keyed:
            sock.close()


@pytest.mark.parametrize("framing", [b"Content-Length: 107374182400\r\n", b"Transfer-Encoding: chunked\r\n"])
def test_an_answer_before_the_body_was_read_closes_the_connection(served, framing) -> None:
    """A 401 left the body on a keep-alive connection and uvicorn read it with no size or time
    limit: a client without a key streamed 22 GB in 15 s into a server with a small body limit."""
    _, port = served
    sock = _connect(port)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + framing + b"\r\n")
    closed = threading.Event()
    chunk = (b"10000\r\n" + b"x" * 0x10000 + b"\r\n") if b"chunked" in framing else b"x" * 0x10000

    def flood() -> None:
        try:
            while True:  # as much body as the server will take
                sock.sendall(chunk)
        except OSError:
            closed.set()

    with _connect(port) as plain:  # the answer itself: the key check's 401, marked to close the connection
        plain.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 2\r\n\r\n{}")
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = plain.recv(65536)
            assert chunk, head
            head += chunk
        assert head.startswith(b"HTTP/1.1 401") and b"connection: close" in head.lower(), head
    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    try:
        # Ends only when the server closes the connection; the bound only keeps a broken build from hanging.
        assert closed.wait(60), "the server kept reading the body of a request it had answered"
    finally:
        sock.close()
        sender.join(10)
