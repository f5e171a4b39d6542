"""``Retry-After`` on the 503s a retry to the same server can cure, and on no other answer."""

from __future__ import annotations

import socket

import pytest

from lightllm.server.http.errors import SERVICE_UNAVAILABLE, APIError, error_body, manager_error, server_busy
from lightllm.server.http.transport.front_door import FrontDoor
from lightllm.server.http.transport.listen_sockets import bind_listeners
from lightllm.server.http.transport.probe_parsing import raw_response
from lightllm.server.http.transport.protocol import raw_json_response
from lightllm.server.http.retry_after import RETRY_AFTER_SECONDS, body_error_code, retry_after_seconds
from lightllm.server.http.server_options import AuthPolicy, HttpLimits
from lightllm.server.manager_errors import ServerBusyError, ServerUnavailableError


def _head_lines(raw: bytes) -> dict[str, str]:
    head = raw.partition(b"\r\n\r\n")[0].decode("ascii").split("\r\n")[1:]
    return {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in head)}


@pytest.mark.parametrize("code", sorted(RETRY_AFTER_SECONDS))
def test_each_retryable_code_gets_whole_positive_seconds_on_a_503_only(code: str) -> None:
    seconds = retry_after_seconds(503, code)
    assert isinstance(seconds, int) and seconds > 0
    assert retry_after_seconds(400, code) is None and retry_after_seconds(500, code) is None


@pytest.mark.parametrize("code", ["server_shutting_down", "server_failed", "event_loop_stalled", None, "other"])
def test_a_503_that_says_go_elsewhere_has_no_retry_after(code) -> None:
    assert retry_after_seconds(503, code) is None


def test_api_errors_carry_the_header_by_their_code() -> None:
    assert server_busy("no slot").to_response().headers["retry-after"] == "1"
    assert manager_error(ServerBusyError("busy")).to_response().headers["retry-after"] == "1"
    gone = manager_error(ServerUnavailableError("a process died", "server_failed")).to_response()
    assert gone.status_code == 503 and "retry-after" not in gone.headers
    assert "retry-after" not in APIError(400, "bad", code="server_busy").to_response().headers


def test_raw_answers_written_before_uvicorn_carry_it_too() -> None:
    capped = raw_json_response(503, "full", SERVICE_UNAVAILABLE, "too_many_connections")
    assert _head_lines(capped)["retry-after"] == "1" and capped.endswith(b"}")
    starting = raw_response(503, error_body("loading", SERVICE_UNAVAILABLE, None, "server_starting"))
    assert _head_lines(starting)["retry-after"] == "5"
    stopping = raw_response(503, error_body("bye", SERVICE_UNAVAILABLE, None, "server_shutting_down"))
    assert "retry-after" not in _head_lines(stopping)
    assert "retry-after" not in _head_lines(raw_response(200, {"status": "ok"}, head_only=True))


def test_body_error_code_reads_only_an_error_envelope() -> None:
    assert body_error_code(error_body("m", SERVICE_UNAVAILABLE, None, "server_busy")) == "server_busy"
    assert body_error_code({"status": "ok"}) is None
    assert body_error_code({"error": "text"}) is None
    assert body_error_code({"error": {"code": 5}}) is None


def _ask(port: int, path: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_a_starting_front_door_asks_clients_back_and_a_stopping_one_does_not() -> None:
    limits = HttpLimits(header_timeout=20, body_timeout=5, keep_alive_timeout=5, max_connections=6,
                        max_connections_per_client=3)
    door = FrontDoor(bind_listeners("127.0.0.1", 0), limits, AuthPolicy())
    door.start()
    try:
        for path in ("/v1/models", "/health/ready"):
            answer = _ask(door.port, path)
            assert answer.startswith(b"HTTP/1.1 503") and _head_lines(answer)["retry-after"] == "5", path
        assert "retry-after" not in _head_lines(_ask(door.port, "/health/live"))
        door.stop_serving()
        answer = _ask(door.port, "/v1/models")
        assert answer.startswith(b"HTTP/1.1 503") and "retry-after" not in _head_lines(answer)
    finally:
        door.close()
