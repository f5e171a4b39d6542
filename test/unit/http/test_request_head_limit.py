"""Every request head over 16 KiB is a 400 ``invalid_http_request``, complete or not, first or follow-up.

h11 bounds only a head that is still arriving, so a complete head that came in one read, or a
keep-alive follow-up, used to be served whatever its size. Checked on the h11 connection itself,
on the guarded protocol over loopback (follow-ups, pipelining, a head split across reads) and on
the front door (a fresh connection's complete head, probes included).
"""

from __future__ import annotations

import json
import re
import socket
import time
from typing import Iterator

import h11
import pytest

from api_fakes import FakeManager
from uvicorn_in_thread import serving_behind_front_door
from lightllm.server.http.transport.probe_parsing import MAX_HEAD_BYTES
from lightllm.server.http.transport.head_limited_connection import HeadLimitedConnection
from lightllm.server.http.server_options import AuthPolicy, HttpLimits, HttpServerOptions

LIMITS = HttpLimits(header_timeout=20, body_timeout=5, keep_alive_timeout=5, max_connections=20,
                    max_connections_per_client=20)


def head_of(size: int, path: str = "/v1/models", terminator: bytes = b"\r\n\r\n", close: bool = True) -> bytes:
    """A GET head of exactly ``size`` bytes (padded with one header)."""
    start = f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode() + (b"Connection: close\r\n" if close else b"")
    pad = size - len(start) - len(b"X-Pad: ") - len(terminator)
    assert pad > 0
    return start + b"X-Pad: " + b"a" * pad + terminator


def many_lines_head(lines: int) -> bytes:
    """A head of many small header lines (3000 of them make about 35 KB)."""
    fields = b"".join(b"X-H%d: v\r\n" % index for index in range(lines))
    return b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + fields + b"Connection: close\r\n\r\n"


# ---------------------------------------------------------------- the h11 connection


def _next(conn: HeadLimitedConnection, data: bytes) -> object:
    conn.receive_data(data)
    return conn.next_event()


@pytest.mark.parametrize("terminator", [b"\r\n\r\n", b"\n\n"])
def test_a_head_at_the_limit_passes_one_byte_more_does_not(terminator: bytes) -> None:
    assert isinstance(_next(HeadLimitedConnection(), head_of(MAX_HEAD_BYTES, terminator=terminator)), h11.Request)
    with pytest.raises(h11.RemoteProtocolError):
        _next(HeadLimitedConnection(), head_of(MAX_HEAD_BYTES + 1, terminator=terminator))


def test_complete_heads_of_any_size_are_refused() -> None:
    for head in (head_of(17_000), head_of(200_000), many_lines_head(3000)):
        with pytest.raises(h11.RemoteProtocolError):
            _next(HeadLimitedConnection(), head)


def test_a_head_arriving_in_pieces_is_measured_across_them() -> None:
    conn = HeadLimitedConnection()
    head = head_of(MAX_HEAD_BYTES + 100)
    conn.receive_data(head[:10_000])
    assert conn.next_event() is h11.NEED_DATA
    with pytest.raises(h11.RemoteProtocolError):
        _next(conn, head[10_000:])


def _answer(conn: HeadLimitedConnection) -> None:
    conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
    conn.send(h11.EndOfMessage())


def test_follow_up_heads_are_limited_too() -> None:
    conn = HeadLimitedConnection()
    # The follow-up arrives with the first request, so it is already buffered when the cycle restarts.
    conn.receive_data(head_of(200, close=False) + head_of(MAX_HEAD_BYTES + 1))
    assert isinstance(conn.next_event(), h11.Request)
    assert isinstance(conn.next_event(), h11.EndOfMessage)
    _answer(conn)
    conn.start_next_cycle()
    with pytest.raises(h11.RemoteProtocolError):
        conn.next_event()
    # A follow-up that arrives after the cycle restarted.
    conn = HeadLimitedConnection()
    assert isinstance(_next(conn, head_of(200, close=False)), h11.Request)
    assert isinstance(conn.next_event(), h11.EndOfMessage)
    _answer(conn)
    conn.start_next_cycle()
    assert isinstance(_next(conn, head_of(MAX_HEAD_BYTES, close=False)), h11.Request)
    assert isinstance(conn.next_event(), h11.EndOfMessage)
    _answer(conn)
    conn.start_next_cycle()
    with pytest.raises(h11.RemoteProtocolError):
        _next(conn, head_of(60_000))


# ---------------------------------------------------------------- over loopback


@pytest.fixture(scope="module")
def door_port() -> Iterator[int]:
    """The app behind a front door, as ``api_server`` serves it; yields the port."""
    with serving_behind_front_door(FakeManager(), HttpServerOptions(limits=LIMITS, auth=AuthPolicy())) as door:
        yield door.port


def _exchange(port: int, *parts: bytes, pause: float = 0.3) -> bytes:
    """Send ``parts`` with a pause between them; everything read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        for index, part in enumerate(parts):
            if index:
                time.sleep(pause)
            try:
                sock.sendall(part)
            except OSError:
                break  # the server answered and closed already
        data = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                return data
            data += chunk
    return data


def _statuses(raw: bytes) -> list[int]:
    # A response follows the previous body directly, not on a line of its own.
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", raw)]


def _last_error(raw: bytes) -> dict:
    return json.loads(raw.rsplit(b"\r\n\r\n", 1)[1])["error"]


@pytest.mark.parametrize("head", [head_of(17_000), head_of(60_000), many_lines_head(3000),
                                  head_of(17_000, path="/health")], ids=["17k", "60k", "3000-lines", "probe-17k"])
def test_a_fresh_connection_with_a_large_complete_head_gets_400(door_port: int, head: bytes) -> None:
    raw = _exchange(door_port, head)
    assert _statuses(raw) == [400]
    assert _last_error(raw)["code"] == "invalid_http_request"


def test_a_head_at_the_limit_is_served(door_port: int) -> None:
    assert _statuses(_exchange(door_port, head_of(MAX_HEAD_BYTES))) == [200]


def test_a_large_head_split_across_reads_gets_400(door_port: int) -> None:
    # The front door hands the connection over after the first part; the protocol measures the rest.
    head = head_of(40_000)
    raw = _exchange(door_port, head[:100], head[100:])
    assert _statuses(raw) == [400] and _last_error(raw)["code"] == "invalid_http_request"


@pytest.mark.parametrize("size", [17_000, 200_000])
def test_a_large_keep_alive_follow_up_gets_400(door_port: int, size: int) -> None:
    raw = _exchange(door_port, head_of(200, close=False), head_of(size))
    assert _statuses(raw) == [200, 400]
    assert _last_error(raw)["code"] == "invalid_http_request"


def test_a_large_pipelined_follow_up_gets_400(door_port: int) -> None:
    raw = _exchange(door_port, head_of(200, close=False) + head_of(17_000))
    assert _statuses(raw) == [200, 400]


# ---------------------------------------------------------------- empty lines before a request line


def test_empty_lines_before_a_request_line_are_ignored() -> None:
    """RFC 9112 section 2.2: a client's stray CRLF after a body used to get a 400 after its 200."""
    conn = HeadLimitedConnection()
    body_and_crlf = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}\r\n"
    conn.receive_data(body_and_crlf)
    assert isinstance(conn.next_event(), h11.Request)
    assert isinstance(conn.next_event(), h11.Data)
    assert isinstance(conn.next_event(), h11.EndOfMessage)
    _answer(conn)
    conn.start_next_cycle()
    assert conn.next_event() is h11.NEED_DATA
    assert isinstance(_next(conn, head_of(200)), h11.Request)
    # Before a first request too, LF-only lines, and a CR whose LF comes in the next read.
    conn = HeadLimitedConnection()
    assert _next(conn, b"\r\n\n\r") is h11.NEED_DATA
    assert isinstance(_next(conn, b"\n" + head_of(200)), h11.Request)


def test_empty_lines_do_not_stretch_the_head_limit() -> None:
    """The head is measured from its request line: leading empty lines neither count nor hide bytes."""
    assert isinstance(_next(HeadLimitedConnection(), b"\r\n\r\n" + head_of(MAX_HEAD_BYTES)), h11.Request)
    for size in (MAX_HEAD_BYTES + 1, 40_000):
        with pytest.raises(h11.RemoteProtocolError):
            _next(HeadLimitedConnection(), b"\r\n\r\n" + head_of(size))


def test_a_crlf_after_a_body_gets_no_second_answer(door_port: int) -> None:
    body = b'{"inputs": "hi", "parameters": {"max_new_tokens": 1}}'
    post = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body + b"\r\n"
    raw = _exchange(door_port, post, head_of(200))
    assert _statuses(raw) == [200, 200], raw[:300]
