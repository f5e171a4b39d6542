"""Limits, authentication and the priority rule on a real server process with small limits."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from typing import Any, Iterator

import httpx
import openai
import pytest

from server_process import ServerHandle, start_server

USER, ADMIN = "user-key-7", "admin-key-7"
BODY_LIMIT = 8_000_000
CHARS_PER_TOKEN = 2000  # the tiny model's 1024-token context: prompts over 2,048,000 characters are refused unread
HEADER_TIMEOUT = 2.0
MAX_CONNECTIONS = 24
PREPARING_PER_CLIENT = 4


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory) -> Iterator[ServerHandle]:
    handle = start_server(tiny_llama_dir, tmp_path_factory.mktemp("limits_logs"), [
        "--max_total_token_num", "16384", "--max_request_body_bytes", str(BODY_LIMIT),
        "--prompt_chars_per_token", str(CHARS_PER_TOKEN), "--http_header_timeout", str(HEADER_TIMEOUT),
        "--http_max_connections", str(MAX_CONNECTIONS), "--api_key", USER, "--admin_api_key", ADMIN,
        "--http_max_preparing_per_client", str(PREPARING_PER_CLIENT),
    ])
    yield handle
    handle.stop()


def _auth(key: str = USER) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _address(server: ServerHandle) -> tuple[str, int]:
    host, port = server.url.rsplit("/", 1)[-1].split(":")
    return host, int(port)


class HealthPoller:
    """Polls /health from a thread and records the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                self.statuses.append(client.get(f"{self.url}/health").status_code)
                self.latencies.append(time.monotonic() - start)
                time.sleep(0.05)

    def __enter__(self) -> "HealthPoller":
        self._thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: Any) -> None:
        time.sleep(0.2)
        self._stop.set()
        self._thread.join(30)


def test_bodies_over_the_limit_get_413(server):
    body = json.dumps({"inputs": "a" * (BODY_LIMIT + 10)}).encode()
    headers = {**_auth(), "content-type": "application/json"}
    sized = httpx.post(f"{server.url}/generate", content=body, headers=headers, timeout=60)
    assert sized.status_code == 413 and sized.json()["error"]["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:
        for start in range(0, len(body), 1 << 20):
            yield body[start:start + (1 << 20)]

    streamed = httpx.post(f"{server.url}/generate", content=chunked(), headers=headers, timeout=60)
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_large_prompts_do_not_stall_health(server):
    with HealthPoller(server.url) as poller:
        # Over the character bound: refused from its length alone, never tokenized.
        huge = httpx.post(f"{server.url}/generate", json={"inputs": "hello world " * 500_000}, headers=_auth(), timeout=120)
        # Under the bound but far over the context: refused from a prefix, not tokenized whole.
        long = httpx.post(f"{server.url}/generate", json={"inputs": "hello world " * 80_000}, headers=_auth(), timeout=120)
        # Kept to its end (truncate_prompt_tokens): tokenized whole (seconds of work) in a worker thread.
        kept = httpx.post(f"{server.url}/v1/completions", json={
            "model": server.model_name, "prompt": "hello world " * 80_000, "truncate_prompt_tokens": 16, "max_tokens": 1,
        }, headers=_auth(), timeout=120)
    error = huge.json()["error"]
    assert huge.status_code == 400 and error["param"] == "inputs" and error["code"] == "context_length_exceeded"
    assert "6000000 characters" in error["message"]
    error = long.json()["error"]
    assert long.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "characters alone are" in error["message"]
    assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == 16
    assert len(poller.latencies) >= 5 and set(poller.statuses) == {200}
    assert max(poller.latencies) < 1.0, max(poller.latencies)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x" * 2_100_000}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2_100_000}]}, "messages"),
    ],
)
def test_openai_prompts_over_the_character_bound(server, path, body, param):
    resp = httpx.post(f"{server.url}{path}", json={"model": server.model_name, **body}, headers=_auth(), timeout=60)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == param and error["code"] == "context_length_exceeded"


def test_slowloris_connections_are_closed(server):
    socks = [socket.create_connection(_address(server)) for _ in range(10)]
    start = time.monotonic()
    for sock in socks:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
    answers: dict[int, bytes] = {}
    while len(answers) < len(socks) and time.monotonic() - start < HEADER_TIMEOUT + 10:
        for index, sock in enumerate(socks):
            if index in answers:
                continue
            if select.select([sock], [], [], 0)[0]:
                answers[index] = sock.recv(4096)
            else:
                try:
                    sock.sendall(b"X-Drip: 1\r\n")
                except OSError:
                    answers[index] = b""
        time.sleep(0.25)
    for sock in socks:
        sock.close()
    assert len(answers) == len(socks)
    assert all(answer.startswith(b"HTTP/1.1 408") for answer in answers.values())


def test_connection_cap(server):
    """One client address holds at most its share (--http_max_connections_per_client, by default half
    of --http_max_connections): the rest are refused at once, and the server stays reachable."""
    per_client = MAX_CONNECTIONS // 2
    socks = [socket.create_connection(_address(server)) for _ in range(per_client + 4)]
    try:
        answers = first_answers(socks, wanted=4, within=HEADER_TIMEOUT * 0.75)
        refused = [answer for answer in answers if answer.startswith(b"HTTP/1.1 503")]
        # Connections of earlier tests may still be closing, so more than the extra four may be refused.
        assert len(refused) >= 4 and len(socks) - len(refused) <= per_client
        assert all(b"too_many_client_connections" in answer for answer in refused)
    finally:
        for sock in socks:
            sock.close()
    time.sleep(0.3)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_a_clients_requests_beyond_its_share_wait_and_other_clients_do_not(server):
    """--http_max_preparing_per_client: one client pipelining on many connections had every request
    in the event loop at once, and others waited seconds behind it.

    The client's places are held by requests whose bodies are still coming (a request is being
    prepared until it reaches the engine): as many of them as it has places stand aside after a
    second (their bodies still read), and the next ones keep their places; its next request, even
    one answered 401, then waits for a place, while another client address is answered at once.
    """
    host, port = _address(server)
    holders = [socket.create_connection((host, port)) for _ in range(2 * PREPARING_PER_CLIENT)]
    try:
        for sock in holders:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + USER.encode()
                         + b"\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n")
        time.sleep(3.0)  # the first ones stood aside after a second, the next ones could not
        waiting = socket.create_connection((host, port))
        waiting.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        # Another client address (loopback is all 127/8) is served while the first one waits.
        other = socket.create_connection((host, port), source_address=("127.0.0.2", 0))
        other.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        other.settimeout(30)
        assert other.recv(4096).startswith(b"HTTP/1.1 401")
        other.close()
        assert not select.select([waiting], [], [], 1.0)[0], "the request beyond the client's share was answered"
        for sock in holders:  # the bodies complete (400s): a freed place passes to the waiting request first
            sock.sendall(b"{}")
        waiting.settimeout(30)
        assert waiting.recv(4096).startswith(b"HTTP/1.1 401")
        waiting.close()
    finally:
        for sock in holders:
            sock.close()


def first_answers(socks: list[socket.socket], wanted: int, within: float) -> list[bytes]:
    """What the server sent first on each socket that got something, once ``wanted`` did or time is up."""
    deadline = time.monotonic() + within
    while True:
        ready = select.select(socks, [], [], max(0.0, deadline - time.monotonic()))[0]
        if len(ready) >= wanted or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return [sock.recv(4096) for sock in ready]


def test_api_keys(server):
    missing = httpx.get(f"{server.url}/v1/models", timeout=10)
    assert missing.status_code == 401 and missing.headers["www-authenticate"].startswith("Bearer")
    assert missing.json()["error"]["code"] == "missing_api_key"
    wrong = httpx.post(f"{server.url}/generate", json={"inputs": "hi"}, headers=_auth("nope"), timeout=10)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/metrics", headers=_auth(), timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=USER)
    done = client.completions.create(model=server.model_name, prompt="Hi", max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_priority_needs_the_admin_key(server):
    body = {"inputs": "hi", "high_priority_request": True, "parameters": {"max_new_tokens": 2}}
    refused = httpx.post(f"{server.url}/generate", json=body, headers=_auth(), timeout=30)
    error = refused.json()["error"]
    assert refused.status_code == 403 and error["param"] == "high_priority_request"
    assert error["code"] == "priority_not_allowed"
    admitted = httpx.post(f"{server.url}/generate", json=body, headers=_auth(ADMIN), timeout=30)
    assert admitted.status_code == 200 and admitted.json()["count_output_tokens"] == 2


def test_405_allow_and_415(server):
    wrong_method = httpx.get(f"{server.url}/generate", headers=_auth(), timeout=10)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    form = httpx.post(f"{server.url}/generate", data={"inputs": "hi"}, headers=_auth(), timeout=10)
    assert form.status_code == 415 and form.json()["error"]["code"] == "unsupported_media_type"
    text = httpx.post(f"{server.url}/v1/completions", content=b"{}", headers={**_auth(), "content-type": "text/plain"},
                      timeout=10)
    assert text.status_code == 415
    ok = httpx.post(f"{server.url}/generate", content=json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 1}}),
                    headers={**_auth(), "content-type": "application/json; charset=utf-8"}, timeout=30)
    assert ok.status_code == 200


def test_one_request_may_hold_at_most_half_the_request_slots(server):
    """64 prompts x n 16 took all 1024 request slots of a default server: another client's request
    waited for the whole of it (73 s for 20 tokens each), or --slot_wait_seconds and then a 503."""
    body = {"model": server.model_name, "prompt": ["p"] * 64, "n": 16, "max_tokens": 1}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=_auth(), timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    # The default --running_max_req_size 256 makes 1024 slots: one request runs at most 512.
    assert error["param"] == "n" and "1024 generations (64 prompts x n 16)" in error["message"]
    assert "at most 512" in error["message"]
