"""The guarded HTTP/1.1 protocol on a real uvicorn server over loopback (the app's manager is scripted).

Covers what only shows on real sockets: the request-head deadline against slowloris clients, the
connection cap, the lingering close that lets a client still sending a refused body read its 413,
and uvicorn's own 400 in JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import select
import socket
import time
from typing import Iterator

import httpx
import pytest
import uvicorn
from uvicorn.server import ServerState

from api_fakes import FakeManager
from uvicorn_in_thread import serving_in_thread
from lightllm.server.http.app import create_app
from lightllm.server.http.transport.protocol import guarded_protocol_class
from lightllm.server.http.server_options import HttpLimits, HttpServerOptions

LIMITS = HttpLimits(max_body_bytes=64 * 1024, header_timeout=0.6, body_timeout=0.6, keep_alive_timeout=5,
                    max_connections=12)


@contextlib.contextmanager
def _serving(manager: FakeManager, limits: HttpLimits) -> Iterator[str]:
    """A real uvicorn server of the app around ``manager`` on a free loopback port; yields its URL."""
    app = create_app(manager, HttpServerOptions(limits=limits))
    with serving_in_thread(app, limits, timeout_keep_alive=limits.keep_alive_timeout) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with _serving(FakeManager(), LIMITS) as url:
        yield url


def _address(url: str) -> tuple[str, int]:
    host, port = url.rsplit("/", 1)[-1].split(":")
    return host, int(port)


def _read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def _json_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_slowloris_connections_get_408_and_are_closed(server_url: str) -> None:
    socks = [socket.create_connection(_address(server_url)) for _ in range(6)]
    start = time.monotonic()
    for sock in socks:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
    closed: dict[int, bytes] = {}
    # Keep dripping header lines: the deadline must not move.
    while len(closed) < len(socks) and time.monotonic() - start < 10:
        for index, sock in enumerate(socks):
            if index in closed:
                continue
            if select.select([sock], [], [], 0)[0]:
                closed[index] = _read_until_closed(sock, 5)
            else:
                try:
                    sock.sendall(b"X-Drip: 1\r\n")
                except OSError:
                    closed[index] = b""
        time.sleep(0.05)
    elapsed = time.monotonic() - start
    for sock in socks:
        sock.close()
    assert len(closed) == len(socks)
    assert elapsed < 5, elapsed
    for raw in closed.values():
        status, error = _json_error(raw)
        assert status == 408 and error["code"] == "request_timeout"


def test_a_silent_connection_is_closed(server_url: str) -> None:
    with socket.create_connection(_address(server_url)) as sock:
        status, _ = _json_error(_read_until_closed(sock, 10))
    assert status == 408


def test_keep_alive_requests_are_not_cut_by_the_head_deadline(server_url: str) -> None:
    with httpx.Client() as client:
        for _ in range(3):
            assert client.get(f"{server_url}/health").status_code == 200
            time.sleep(LIMITS.header_timeout * 1.5)  # idle between requests is the keep-alive timeout's business


def test_connections_beyond_the_cap_get_503(server_url: str) -> None:
    holders = [socket.create_connection(_address(server_url)) for _ in range(LIMITS.max_connections + 3)]
    try:
        deadline = time.monotonic() + LIMITS.header_timeout * 0.75
        while True:
            ready = select.select(holders, [], [], max(0.0, deadline - time.monotonic()))[0]
            if len(ready) >= 3 or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        answers = [_json_error(_read_until_closed(sock, 5)) for sock in ready]
        # Connections of earlier tests may still be closing, so more than the extra three may be refused;
        # an accepted connection whose head deadline passed meanwhile answers 408, not 503.
        refused = [error for status, error in answers if status == 503]
        assert len(refused) >= 3 and len(holders) - len(refused) <= LIMITS.max_connections
        assert all(error["code"] == "too_many_connections" for error in refused)
    finally:
        for sock in holders:
            sock.close()
    time.sleep(0.2)
    assert httpx.get(f"{server_url}/health", timeout=5).status_code == 200


def test_a_client_sending_a_large_body_reads_its_413(server_url: str) -> None:
    big = b"x" * (4 << 20)  # far beyond what the kernel buffers on loopback
    response = httpx.post(f"{server_url}/generate", content=big, headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:
        for _ in range(64):
            yield b"x" * 65536

    response = httpx.post(f"{server_url}/generate", content=chunks(), headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 413
    assert httpx.get(f"{server_url}/health", timeout=5).status_code == 200


def test_a_stalled_body_gets_408(server_url: str) -> None:
    with socket.create_connection(_address(server_url)) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        status, error = _json_error(_read_until_closed(sock, 10))
    assert status == 408 and "--http_body_timeout" in error["message"]


def test_a_chunked_body_with_bare_lf_chunk_lines_is_told_what_to_check(server_url: str) -> None:
    """The whole body arrived; only its framing was wrong: the 408 must not say only that it never came."""
    body = b'{"inputs": "hi"}'
    with socket.create_connection(_address(server_url)) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\n" % len(body) + body + b"\n0\n\n")
        status, error = _json_error(_read_until_closed(sock, 10))
    assert status == 408 and error["message"].endswith(
        "; it is sent chunked, and its last chunk (a 0 line and an empty line) did not arrive, or a chunk line did "
        "not end in CRLF")


def test_a_malformed_request_gets_a_json_400(server_url: str) -> None:
    with socket.create_connection(_address(server_url)) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, error = _json_error(_read_until_closed(sock, 10))
    assert status == 400 and error["code"] == "invalid_http_request"


@pytest.mark.parametrize("head, reason", [
    (b"GET /v1/models HTTP/1.1\r\n\r\n", "Missing mandatory Host: header"),
    (b"GET /v1/models HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", "Found multiple Host: headers"),
    (b"POST /generate HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
     "conflicting Content-Length headers"),
    (b"POST /generate HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", "bad Content-Length"),
    (b"POST /generate HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
     "Only Transfer-Encoding: chunked is supported"),
    (b"GET /v1/models HTTP/1.1\r\nHost: a\r\nfoo\r\n\r\n", "illegal header line: b'foo'"),
    (b"POST /generate HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
     "illegal chunk header: b'zz\\r\\n'"),
    (b"POST /generate HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 20000,
     "a chunk-size line or trailer is larger than 16 KiB"),
])
def test_a_malformed_request_is_told_what_is_wrong(server_url: str, head: bytes, reason: str) -> None:
    """Every parse error was "malformed, or its head is larger than 16 KiB", for heads of a few bytes."""
    with socket.create_connection(_address(server_url)) as sock:
        sock.sendall(head)
        status, error = _json_error(_read_until_closed(sock, 10))
    assert status == 400 and error["message"] == f"Invalid HTTP request: {reason}", error



@pytest.mark.parametrize("version", ["2.0", "3.0", "0.9"])
def test_a_request_line_of_another_http_version_gets_505(server_url: str, version: str) -> None:
    """h11 parses any HTTP/d.d: an HTTP/2.0 request line was answered as if it were HTTP/1.1."""
    with socket.create_connection(_address(server_url)) as sock:
        sock.sendall(f"GET /v1/models HTTP/{version}\r\nHost: a\r\n\r\n".encode())
        answer = _read_until_closed(sock, 10)
    status, error = _json_error(answer)
    assert answer.startswith(b"HTTP/1.1 505 HTTP Version Not Supported\r\n")
    assert status == 505 and error["message"] == (
        f"Invalid HTTP request: HTTP/{version} is not supported; this server speaks HTTP/1.1 (and 1.0)")


def test_http_1_0_and_later_1_x_minor_versions_are_served(server_url: str) -> None:
    for version in ("1.0", "1.1", "1.2"):
        with socket.create_connection(_address(server_url)) as sock:
            sock.sendall(f"GET /v1/models HTTP/{version}\r\nHost: a\r\nConnection: close\r\n\r\n".encode())
            answer = _read_until_closed(sock, 10)
        assert answer.split(b"\r\n", 1)[0] == b"HTTP/1.1 200 OK", (version, answer[:200])


class _PeerGoneTransport(asyncio.Transport):
    """A connection whose peer reset it between the answer's write and the half-close (a real race
    on a busy machine: the client read the 400 and closed first)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def get_extra_info(self, name, default=None):
        return default

    def write(self, data) -> None:
        self.written += bytes(data)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def resume_reading(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass


def test_an_answer_to_a_client_already_gone_closes_quietly() -> None:
    """The half-close after a refusal fails when the peer is gone: the connection is closed, no traceback."""
    config = uvicorn.Config(create_app(FakeManager()), http=guarded_protocol_class(LIMITS), log_level="error")
    config.load()

    async def scenario() -> _PeerGoneTransport:
        protocol = config.http_protocol_class(config=config, server_state=ServerState(), app_state={})
        transport = _PeerGoneTransport()
        protocol.connection_made(transport)
        protocol.data_received(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
        protocol.connection_lost(None)
        return transport

    transport = asyncio.run(scenario())
    assert transport.written.startswith(b"HTTP/1.1 400") and transport.closed


def test_a_body_framed_twice_is_refused_and_the_connection_closed(server_url: str) -> None:
    """Content-Length with Transfer-Encoding (RFC 9112 section 6.1): a proxy may frame it the
    other way, so nothing after it on the connection is served."""
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    request = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled)
    with socket.create_connection(_address(server_url)) as sock:
        sock.sendall(request)
        raw = _read_until_closed(sock, 10)
    status, error = _json_error(raw)
    assert status == 400 and "Content-Length and Transfer-Encoding" in error["message"]
    assert raw.count(b"HTTP/1.1 ") == 1


@pytest.fixture(scope="module")
def short_keep_alive_url() -> Iterator[str]:
    """A server whose idle keep-alive timeout is shorter than its request-head deadline."""
    with _serving(FakeManager(), HttpLimits(header_timeout=1.5, body_timeout=1.5, keep_alive_timeout=0.3,
                                            max_connections=12)) as url:
        yield url


def test_a_pipelined_head_left_unfinished_gets_its_408(short_keep_alive_url: str) -> None:
    """The keep-alive timer used to close such a connection silently before the head deadline."""
    with socket.create_connection(_address(short_keep_alive_url)) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/mo")
        raw = _read_until_closed(sock, 10)
    first, _, second = raw.partition(b"HTTP/1.1 408")
    assert first.startswith(b"HTTP/1.1 200") and b"request_timeout" in second


def test_bytes_after_a_request_that_said_close_do_not_replace_its_answer() -> None:
    """h11 refuses input after such a request; uvicorn answered 400 in place of the owed 200 (the
    generation, a few tokens of 0.1 s here, still ran)."""
    manager = FakeManager()
    manager.step_seconds = 0.1
    with _serving(manager, LIMITS) as url:
        _check_bytes_after_close(url)


def _check_bytes_after_close(server_url: str) -> None:
    body = json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 2}}).encode()
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    for trailer in (b"\r\n", b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", b"junk"):
        for together in (True, False):
            with socket.create_connection(_address(server_url)) as sock:
                if together:
                    sock.sendall(head + body + trailer)
                else:
                    sock.sendall(head + body)
                    time.sleep(0.02)
                    sock.sendall(trailer)
                raw = _read_until_closed(sock, 10)
            assert raw.startswith(b"HTTP/1.1 200") and raw.count(b"HTTP/1.1 ") == 1, (trailer, together, raw[:200])


def test_an_absolute_form_target_is_routed_by_its_path(server_url: str) -> None:
    # RFC 9112 3.2.2: a server must accept it (a forward proxy's clients send it); it got 404
    # "No route GET /http://x/v1/models".
    def ask(head: bytes) -> bytes:
        with socket.create_connection(_address(server_url), timeout=10) as sock:
            sock.sendall(head)
            return _read_until_closed(sock, 10)

    models = ask(b"GET http://x/v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert models.startswith(b"HTTP/1.1 200") and b'"object":"list"' in models.replace(b" ", b""), models[:300]
    health = ask(b"GET HTTPS://x:8000/health?probe=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert health.startswith(b"HTTP/1.1 200"), health[:300]
    body = json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 2}}).encode()
    generated = ask(b"POST http://127.0.0.1/generate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert generated.startswith(b"HTTP/1.1 200"), generated[:300]
    status, error = _json_error(ask(b"GET http://x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
    assert status == 404 and "GET /" in error["message"]
