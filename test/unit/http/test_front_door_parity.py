"""The front door answers a request as the app would: the same CORS headers, the same 400 for a
malformed head, and requests pipelined behind a probe served.

The front door answers probes (and its 503s) on a fresh connection before the app sees them; the
same request as the second on a keep-alive connection is answered by the app.  Both must agree.
"""

from __future__ import annotations

import socket
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import pytest
from fastapi.testclient import TestClient

from api_fakes import FakeManager
from uvicorn_in_thread import serving_behind_front_door
from lightllm.server.http.app import create_app
from lightllm.server.http.transport.front_door import FrontDoor
from lightllm.server.http.transport.head_triage import Answer, DoorState, HandOff, HeadTriage
from lightllm.server.http.service.health import starting_readiness
from lightllm.server.http.transport.listen_sockets import bind_listeners
from lightllm.server.http.server_options import AuthPolicy, HttpLimits, HttpServerOptions

PAGE = "https://a.example"
OTHER = "https://b.example"
LIMITS = HttpLimits(header_timeout=10, body_timeout=5, keep_alive_timeout=5, max_connections=20)
# What h11 (and so the loop's protocol) refuses with a 400, on a probe path.
MALFORMED = {
    "no Host": b"GET /health HTTP/1.1\r\n\r\n",
    "two Hosts": b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    "illegal header line": b"GET /health/live HTTP/1.1\r\nHost: a\r\nBad Header: 1\r\n\r\n",
    "non-ASCII target": b"GET /health?q=\xe9 HTTP/1.1\r\nHost: x\r\n\r\n",
}


def _cors(headers: Sequence[Tuple[bytes, bytes]]) -> Dict[str, str]:
    return {name.decode().lower(): value.decode("latin-1") for name, value in headers
            if name.lower().startswith(b"access-control-") or name.lower() == b"vary"}


def _origin_line(origin: Optional[str]) -> bytes:
    return b"" if origin is None else f"Origin: {origin}\r\n".encode()


def _verdict(data: bytes, origins: Sequence[str], phase: str = "serving", reserve: bool = False):
    readiness = starting_readiness if phase == "starting" else (lambda: None)
    return HeadTriage(LIMITS, AuthPolicy(api_keys=("k",)), origins).verdict(
        data, reserve, lambda: DoorState(phase, readiness, None), lambda: True)


# ---------------------------------------------------------------- the decisions alone


@pytest.mark.parametrize("origins", [("*",), (PAGE,), ()])
@pytest.mark.parametrize("origin", [PAGE, OTHER, None])
def test_probe_answers_and_503s_carry_the_cors_headers_the_app_sends(origins, origin) -> None:
    app = TestClient(create_app(FakeManager(), HttpServerOptions(allowed_origins=origins)))
    headers = {} if origin is None else {"Origin": origin}
    expected = _cors([(k.encode(), v.encode()) for k, v in app.get("/health", headers=headers).headers.items()])
    if origins and origin is not None and (origins == ("*",) or origin in origins):
        assert "access-control-allow-origin" in expected  # the comparison is about something
    for method, path in (("GET", "/health"), ("HEAD", "/health/live")):
        probe = _verdict(f"{method} {path} HTTP/1.1\r\nHost: x\r\n".encode() + _origin_line(origin) + b"\r\n", origins)
        assert isinstance(probe, Answer) and probe.status == 200 and _cors(probe.headers) == expected
    request = b"POST /generate HTTP/1.1\r\nHost: x\r\n" + _origin_line(origin) + b"\r\n"
    starting = _verdict(request, origins, phase="starting")
    assert isinstance(starting, Answer) and starting.body["error"]["code"] == "server_starting"
    full = _verdict(request, origins, reserve=True)
    assert isinstance(full, Answer) and full.refusal == "too_many_connections"
    assert _cors(starting.headers) == _cors(full.headers) == expected


def test_a_503_waits_for_the_whole_head_so_it_knows_the_origin() -> None:
    partial = _verdict(b"POST /generate HTTP/1.1\r\nHost: x\r\nOri", ("*",), phase="starting")
    assert not isinstance(partial, (Answer, HandOff))


@pytest.mark.parametrize("name", sorted(MALFORMED))
@pytest.mark.parametrize("phase", ["starting", "serving"])
def test_a_malformed_probe_head_gets_the_protocols_400(name: str, phase: str) -> None:
    verdict = _verdict(MALFORMED[name], ("*",), phase=phase)
    assert isinstance(verdict, Answer) and verdict.status == 400, name
    assert verdict.body["error"]["code"] == "invalid_http_request" and verdict.headers == ()


def test_what_the_app_answers_otherwise_is_left_to_it() -> None:
    preflight = (b"OPTIONS /health HTTP/1.1\r\nHost: x\r\nOrigin: " + PAGE.encode()
                 + b"\r\nAccess-Control-Request-Method: GET\r\n\r\n")
    assert isinstance(_verdict(preflight, ("*",)), HandOff)
    # The app refuses a body framed twice, a probe's included.
    framed_twice = b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    assert isinstance(_verdict(framed_twice, ("*",)), HandOff)


def test_requests_pipelined_behind_a_probe_go_to_the_loop_while_it_serves() -> None:
    pipelined = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    assert isinstance(_verdict(pipelined, ("*",)), HandOff)
    # No loop to hand them to: the probe is answered, its close said.
    assert isinstance(_verdict(pipelined, ("*",), phase="starting"), Answer)


def test_a_large_probe_head_is_read_by_the_loop() -> None:
    many = b"GET /health/live HTTP/1.1\r\nHost: x\r\n" + b"a: b\r\n" * 2000 + b"\r\n"  # 12 KiB of tiny headers
    long = b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 3000 + b"\r\n\r\n"
    malformed = b"GET /health/live HTTP/1.1\r\n" + b"a: b\r\n" * 2000 + b"\r\n"  # no Host: the loop's 400
    for head in (many, long, malformed):
        assert isinstance(_verdict(head, ("*",)), HandOff)
        # No loop to take it (or a reserve place): answered as a probe, its CORS headers from its Origin.
        starting = _verdict(head[:-2] + b"Origin: " + PAGE.encode() + b"\r\n\r\n", (PAGE,), phase="starting")
        assert isinstance(starting, Answer) and starting.status == 200
        assert _cors(starting.headers)["access-control-allow-origin"] == PAGE
        assert isinstance(_verdict(head, ("*",), reserve=True), Answer)


def test_a_stray_line_end_after_a_probe_is_no_pipelined_request() -> None:
    for rest in (b"\r\n", b"\n", b"\r\n\r\n"):
        verdict = _verdict(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + rest, ("*",))
        assert isinstance(verdict, Answer) and verdict.status == 200, rest
    assert isinstance(_verdict(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n\r\nG", ("*",)), HandOff)


def test_a_partial_head_closed_while_starting_or_stopping_gets_the_503() -> None:
    triage = HeadTriage(LIMITS, AuthPolicy(), (PAGE,))
    partial = b"POST /generate HTTP/1.1\r\nHost: x\r\nOrigin: " + PAGE.encode() + b"\r\nContent-Le"
    for phase, code in (("starting", "server_starting"), ("stopping", "server_shutting_down")):
        readiness = starting_readiness if phase == "starting" else (lambda: None)
        answer = triage.at_eof(partial, False, lambda: DoorState(phase, readiness, None))
        assert isinstance(answer, Answer) and answer.status == 503 and answer.body["error"]["code"] == code
        assert _cors(answer.headers)["access-control-allow-origin"] == PAGE
    serving = lambda: DoorState("serving", lambda: None, None)  # noqa: E731
    assert triage.at_eof(partial, False, serving) is None  # as ever: the loop would have had it
    starting = lambda: DoorState("starting", starting_readiness, None)  # noqa: E731
    assert triage.at_eof(b"GET /heal", False, starting) is None and triage.at_eof(b"", False, starting) is None


def test_a_failing_cors_layer_never_stops_the_front_door(monkeypatch: pytest.MonkeyPatch) -> None:
    door = FrontDoor(bind_listeners("127.0.0.1", 0), LIMITS, AuthPolicy(), (PAGE,))

    def fail(*args, **kwargs):
        raise KeyError("Origin")  # as Starlette 0.x's layer did on a request without Origin

    monkeypatch.setattr(door._triage._cors._layer, "send", fail)
    monkeypatch.setattr(door._triage._cors._layer, "simple_response", fail)
    door.start()
    try:
        for origin in (None, PAGE, None):
            [(status, headers, _)] = _answers(door.port, b"GET /health/live HTTP/1.1\r\nHost: x\r\n"
                                             + _origin_line(origin) + b"\r\n")
            assert status == 200 and _cors(headers) == {}
        with socket.create_connection(("127.0.0.1", door.port), timeout=10) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
            sock.shutdown(socket.SHUT_WR)
            assert b" 503 " in sock.recv(65536).split(b"\r\n", 1)[0]
        assert door._thread.is_alive()
    finally:
        door.close()


# ---------------------------------------------------------------- on real sockets


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    """A front door serving the app (CORS for PAGE only, no keys) on a free port."""
    with serving_behind_front_door(FakeManager(), HttpServerOptions(limits=LIMITS, allowed_origins=(PAGE,))) as door:
        yield door.port


def _answers(port: int, data: bytes) -> List[Tuple[int, List[Tuple[bytes, bytes]], bytes]]:
    """Send ``data`` on a fresh connection; every answer read until the server closes (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    answers = []
    while received:
        head, _, received = received.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = [(name.strip().lower(), value.strip()) for name, _, value in (line.partition(b":") for line in lines[1:])]
        length = int(dict(headers).get(b"content-length", b"0"))
        if data.split(b" ", 1)[0] == b"HEAD" and len(answers) == 0:
            length = 0
        answers.append((int(lines[0].split()[1]), headers, received[:length]))
        received = received[length:]
    return answers


@pytest.mark.parametrize("origin", [PAGE, OTHER, None])
@pytest.mark.parametrize("probe", ["GET /health", "GET /health/live", "GET /ping"])
def test_a_probe_on_a_fresh_connection_gets_the_headers_of_one_on_a_kept_connection(port: int, probe: str,
                                                                                   origin: Optional[str]) -> None:
    request = f"{probe} HTTP/1.1\r\nHost: x\r\n".encode() + _origin_line(origin) + b"Connection: close\r\n\r\n"
    [(door_status, door_headers, door_body)] = _answers(port, request)  # the front door's
    [_, (app_status, app_headers, app_body)] = _answers(port, b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n" + request)
    assert (door_status, door_body.replace(b" ", b"")) == (app_status, app_body.replace(b" ", b"")) == (
        200, b'{"status":"ok"}' if probe != "GET /health/live" else b'{"status":"alive"}')
    assert _cors(door_headers) == _cors(app_headers)
    assert ("access-control-allow-origin" in _cors(door_headers)) == (origin == PAGE)


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_probe_head_gets_the_same_400_on_either_path(port: int, name: str) -> None:
    [(door_status, door_headers, door_body)] = _answers(port, MALFORMED[name])
    [_, (app_status, _, app_body)] = _answers(port, b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n" + MALFORMED[name])
    assert door_status == app_status == 400
    assert door_body.replace(b" ", b"") == app_body.replace(b" ", b""), (door_body, app_body)


def test_a_request_pipelined_behind_a_probe_is_answered(port: int) -> None:
    answers = _answers(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n"
                             b"Connection: close\r\n\r\n")
    assert [status for status, _, _ in answers] == [200, 200] and b'"object":"list"' in answers[1][2]
