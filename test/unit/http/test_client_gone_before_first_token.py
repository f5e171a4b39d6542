"""A client that leaves before its first token is an everyday event: 499 in the access log, one
INFO line per API request (the HTTP layer's, with the count of generations aborted; the request
manager's per-generation line is debug), never the 500 and WARNING of a request manager that
broke its contract."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from api_fakes import MODEL, FakeManager
from lightllm.server.http.app import create_app


def _call(app: Any, path: str, body: dict[str, Any], client_leaves: bool) -> int:
    """Run one POST through the ASGI app; the client's connection reports a disconnect after the body."""
    payload = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    messages = [{"type": "http.request", "body": payload, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        if client_leaves:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def run() -> None:
        async with app.router.lifespan_context(app):
            await app(scope, receive, send)

    asyncio.run(run())
    return next(message["status"] for message in sent if message["type"] == "http.response.start")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3}),
    ("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}),
    ("/generate", {"inputs": "hello", "parameters": {"max_new_tokens": 3}}),
])
def test_a_client_gone_before_its_first_token_gets_499_and_no_warning(path, body, caplog) -> None:
    manager = FakeManager()
    manager.failure = "nothing"
    with caplog.at_level(logging.DEBUG, logger="lightllm.server.http.generation.fanout"):
        assert _call(create_app(manager), path, body, client_leaves=True) == 499
    # One INFO line for the request, naming how many generations were aborted; nothing above INFO.
    lines = [record for record in caplog.records
             if record.name == "lightllm.server.http.generation.fanout" and record.levelno >= logging.INFO]
    assert [(record.levelno, record.getMessage().split(": ", 1)[1]) for record in lines] == [
        (logging.INFO, "its client went away; aborting 1 of its 1 generation")], caplog.text


def test_a_generation_that_ends_with_nothing_while_its_client_waits_is_still_a_500(caplog) -> None:
    manager = FakeManager()
    manager.failure = "nothing"
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
    with caplog.at_level(logging.INFO, logger="lightllm.server.http.generation.fanout"):
        assert _call(create_app(manager), "/v1/completions", body, client_leaves=False) == 500
    assert "ended a generation before its first event" in caplog.text
