"""Request-shape guards (405 Allow, 415, 413, 408) and the prompt pre-check / off-loop tokenization."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeManager, FakeServed, assert_error
from lightllm.server.http.app import create_app
from lightllm.server.http.middleware.request_guard import RequestGuardMiddleware, is_json_content_type
from lightllm.server.http.server_options import MIB, HttpLimits, HttpServerOptions
from lightllm.server.http.generation.prompt_encoding import PromptEncoder, longest_token_chars


@pytest.mark.parametrize(
    ("value", "accepted"),
    [(None, True), ("application/json", True), ("Application/JSON; charset=UTF-8", True),
     ('application/json; charset="utf8"', True), ("application/merge-patch+json", True),
     ("application/json; charset=latin-1", False), ("text/plain", False),
     ("application/x-www-form-urlencoded", False), ("multipart/form-data; boundary=x", False), ("text/json", False)],
)
def test_json_content_types(value: str | None, accepted: bool) -> None:
    assert is_json_content_type(value) is accepted


class _Recorder:
    """An inner ASGI app that records what reaches it, and a scripted client side."""

    def __init__(self, chunks: list[bytes], stall: bool = False) -> None:
        self.chunks = list(chunks)
        self.stall = stall
        self.receive_calls = 0
        self.sent: list[dict[str, Any]] = []
        self.app_messages: list[dict[str, Any]] | None = None

    async def receive(self) -> dict[str, Any]:
        self.receive_calls += 1
        if not self.chunks:
            if self.stall:
                await asyncio.sleep(3600)
            return {"type": "http.disconnect"}
        chunk = self.chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(self.chunks) or self.stall}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.app_messages = [await receive(), await receive()]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def run(self, headers: list[tuple[bytes, bytes]] | None = None, limit: int = 100, timeout: float = 5.0) -> int:
        guard = RequestGuardMiddleware(self.app, max_body_bytes=limit, body_timeout=timeout)
        scope = {"type": "http", "method": "POST", "path": "/x", "headers": headers or []}
        asyncio.run(guard(scope, self.receive, self.send))
        return self.sent[0]["status"]

    def error(self) -> dict[str, Any]:
        return json.loads(b"".join(m.get("body", b"") for m in self.sent[1:]))["error"]


def test_body_is_handed_on_in_one_piece() -> None:
    recorder = _Recorder([b"ab", b"", b"cd"])
    assert recorder.run() == 200
    first, second = recorder.app_messages
    assert first == {"type": "http.request", "body": b"abcd", "more_body": False}
    assert second == {"type": "http.disconnect"}  # later receives reach the client side


def test_a_body_growing_past_the_limit_is_refused_at_once() -> None:
    recorder = _Recorder([b"x" * 60, b"x" * 60, b"x" * 60, b"x" * 60])
    assert recorder.run(limit=100) == 413
    assert recorder.app_messages is None and recorder.receive_calls == 2
    assert recorder.error()["code"] == "request_too_large"
    assert (b"connection", b"close") in recorder.sent[0]["headers"]


def test_a_declared_length_over_the_limit_is_refused_unread() -> None:
    recorder = _Recorder([b"x" * 10])
    assert recorder.run(headers=[(b"content-length", b"101")], limit=100) == 413
    assert recorder.receive_calls == 0 and recorder.app_messages is None


def test_a_stalled_body_times_out() -> None:
    recorder = _Recorder([b"{"], stall=True)
    assert recorder.run(timeout=0.2) == 408
    assert recorder.error()["code"] == "request_timeout" and recorder.app_messages is None


def test_405_lists_the_allowed_methods(client: TestClient) -> None:
    response = client.post("/health")
    assert_error(response, 405, code="method_not_allowed")
    assert response.headers["allow"] == "GET, HEAD"
    assert client.get("/v1/chat/completions").headers["allow"] == "POST"
    assert client.delete(f"/v1/models/{MODEL}").headers["allow"] == "GET, HEAD"


@pytest.mark.parametrize("path", ["/v1/models", f"/v1/models/{MODEL}", "/metrics", "/version"])
def test_every_read_only_path_answers_head_as_its_get_without_a_body(client: TestClient, path: str) -> None:
    """RFC 9110 9.1: a general-purpose server supports HEAD; it was a 405 'Allow: GET' on these paths."""
    get, head = client.get(path), client.head(path)
    assert head.status_code == get.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    assert client.head("/v1/models/no-such-model").status_code == 404
    assert client.post(path).headers["allow"] == "GET, HEAD"


@pytest.mark.parametrize("method", ["GET", "HEAD", "DELETE", "PUT", "OPTIONS", "POST"])
def test_a_path_no_resource_has_is_a_404_for_every_method(client: TestClient, method: str) -> None:
    """/v1/models/ names no model: a 405 advertising GET (while GET itself is a 404) sent clients astray."""
    response = client.request(method, "/v1/models/")
    assert response.status_code == 404 and "allow" not in response.headers
    if method != "HEAD":
        assert response.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions"])
def test_non_json_bodies_get_415(client: TestClient, manager: FakeManager, path: str) -> None:
    body = json.dumps({"model": MODEL, "inputs": "hi", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1"):
        response = client.post(path, content=body, headers={"content-type": content_type})
        error = assert_error(response, 415, code="unsupported_media_type")
        assert content_type in error["message"]
    assert manager.calls == []


def test_json_with_charset_or_without_content_type_is_accepted(client: TestClient) -> None:
    body = json.dumps({"inputs": "hi"}).encode()
    assert client.post("/generate", content=body, headers={"content-type": "application/json; charset=utf-8"}).status_code == 200
    assert client.post("/generate", content=body).status_code == 200


def test_415_only_where_a_route_takes_the_post(client: TestClient) -> None:
    assert client.post("/nowhere", content=b"x", headers={"content-type": "text/plain"}).status_code == 404
    assert client.post("/health", content=b"x", headers={"content-type": "text/plain"}).status_code == 405


def test_body_limit_default_follows_the_context_length() -> None:
    assert HttpLimits().body_limit(2048) == 8 * MIB
    assert HttpLimits().body_limit(1 << 20) == 64 << 20
    assert HttpLimits(max_body_bytes=1000).body_limit(1 << 20) == 1000


class _CountingServed(FakeServed):
    def __init__(self) -> None:
        super().__init__()
        self.encoded: list[str] = []

    def encode_prompt(self, text: str, **options: Any) -> list[int]:
        self.encoded.append(text)
        return super().encode_prompt(text, **options)


def _counting_manager() -> FakeManager:
    return FakeManager(_CountingServed())


def test_obviously_long_prompts_are_refused_before_tokenizing() -> None:
    manager = _counting_manager()  # max_req_total_len 64, at most 2 characters per token: 128 characters
    client = TestClient(create_app(manager, HttpServerOptions(limits=HttpLimits(prompt_chars_per_token=2))))
    cases = [
        ("/generate", {"inputs": "a" * 129}, "inputs"),
        ("/v1/completions", {"model": MODEL, "prompt": ["ok", "a" * 129]}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a" * 70},
                                                               {"role": "user", "content": "a" * 60}]}, "messages"),
    ]
    for path, body, param in cases:
        error = assert_error(client.post(path, json=body), 400, param, "context_length_exceeded")
        assert "characters" in error["message"]
    assert manager.served.encoded == ["ok"] and manager.served.chat_messages == [] and manager.calls == []
    assert client.post("/generate", json={"inputs": "a" * 128}).status_code == 200


def test_the_check_can_be_turned_off() -> None:
    manager = _counting_manager()
    client = TestClient(create_app(manager, HttpServerOptions(limits=HttpLimits(prompt_chars_per_token=0))))
    assert client.post("/generate", json={"inputs": "a" * 10_000}).status_code == 200


def test_default_bound_never_refuses_a_prompt_that_fits(tokenizer) -> None:
    longest = longest_token_chars(tokenizer)
    assert longest == max(len(token) for token in tokenizer.get_vocab())
    texts = ["the quick brown fox " * 50, "你好世界" * 100, "ünïcödé " * 80, " " * 500, "<s></s>" * 60, "x" * 700]
    for text in texts:
        tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert tokens * longest >= len(text), text[:20]


def test_tokenization_runs_off_the_event_loop() -> None:
    class BlockingServed(FakeServed):
        def __init__(self) -> None:
            super().__init__()
            self.entered = threading.Event()
            self.release = threading.Event()

        def encode_prompt(self, text: str, **options: Any) -> list[int]:
            self.entered.set()
            # On the event loop this would wait forever: nothing could set release.
            if not self.release.wait(10):
                raise AssertionError("the tokenizer blocked the event loop")
            return super().encode_prompt(text, **options)

    served = BlockingServed()
    encoder = PromptEncoder(FakeManager(served), chars_per_token=4)

    async def scenario() -> list[int]:
        task = asyncio.create_task(encoder.encode_prompt("hello world", "inputs"))
        while not served.entered.is_set():
            await asyncio.sleep(0.01)
        assert not task.done()
        served.release.set()
        return await task

    assert asyncio.run(scenario()) == FakeServed().encode_prompt("hello world")


def test_prompts_a_prefix_proves_too_long_are_refused_before_tokenizing_whole() -> None:
    """Far under the character bound, far over the context: refused from a prefix, naming the field."""
    manager = _counting_manager()  # max_req_total_len 64: the first probe is 512 characters
    client = TestClient(create_app(manager, HttpServerOptions(limits=HttpLimits(prompt_chars_per_token=0))))
    words = "w " * 5000  # one token per word
    cases = [
        ("/generate", {"inputs": words}, "inputs", "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": words}, "prompt", "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 400},
         "messages", "messages"),
    ]
    for path, body, param, noun in cases:
        error = assert_error(client.post(path, json=body), 400, param, "context_length_exceeded")
        assert re.search(rf"the {noun} cannot fit: its first \d+ characters alone are \d+ tokens", error["message"])
    assert manager.calls == []
    # A request that keeps only the end of its prompt is tokenized whole and truncated.
    reply = client.post("/v1/completions", json={"model": MODEL, "prompt": words, "truncate_prompt_tokens": 8,
                                                 "max_tokens": 2})
    assert reply.status_code == 200 and len(manager.calls[-1].spec.prompt_ids) == 8
    reply = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": words}], "truncate_prompt_tokens": 8, "max_tokens": 2})
    assert reply.status_code == 200 and len(manager.calls[-1].spec.prompt_ids) == 8


def test_what_would_be_read_only_in_part_is_refused(client: TestClient) -> None:
    """Repeated keys or headers, compressed bodies and query strings on POST: refused, not half-read."""
    body = b'{"inputs": "hi", "inputs": "bye", "parameters": {"max_new_tokens": 2}}'
    error = assert_error(client.post("/generate", content=body, headers={"content-type": "application/json"}), 400)
    assert "repeats the key 'inputs'" in error["message"]
    nested = b'{"model": "%s", "messages": [{"role": "user", "content": "a", "content": "b"}]}' % MODEL.encode()
    assert "repeats the key 'content'" in assert_error(
        client.post("/v1/chat/completions", content=nested, headers={"content-type": "application/json"}), 400)["message"]
    generate = json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 2}}).encode()
    json_type = ("content-type", "application/json")
    for name, headers in (("authorization", [json_type, ("authorization", "Bearer a"), ("authorization", "Bearer b")]),
                          ("content-type", [json_type, json_type])):
        error = assert_error(client.post("/generate", content=generate, headers=headers), 400,
                             code="invalid_http_request")
        assert f"'{name}' 2 times" in error["message"]
    error = assert_error(client.post("/generate", content=generate, headers={
        "content-type": "application/json", "content-encoding": "gzip"}), 415, code="unsupported_media_type")
    assert "Content-Encoding 'gzip'" in error["message"]
    assert client.post("/generate", content=generate, headers={
        "content-type": "application/json", "content-encoding": "identity"}).status_code == 200
    error = assert_error(client.post("/generate?max_new_tokens=99", content=generate,
                                     headers={"content-type": "application/json"}), 400, code="invalid_http_request")
    assert "not the query string (got '?max_new_tokens=99')" in error["message"]
    assert client.get("/v1/models?x=1").status_code == 200  # a GET's query string is its own business
    # An empty content list (OpenAI refuses it too) and a trailing slash (no redirect built from Host).
    assert_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": []}]}), 400, "messages.0.content")
    reply = client.post("/v1/completions/", json={"model": MODEL, "prompt": "hi"}, follow_redirects=False)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found"
