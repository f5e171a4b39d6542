"""A client is its connection's peer address: X-Forwarded-For changes nothing, from any peer.

uvicorn's default rewrote ``scope["client"]`` from ``X-Forwarded-For`` for peers on 127.0.0.1
(``FORWARDED_ALLOW_IPS``), so a local client named a fresh address per request and escaped its
per-client share, while the front door's connection caps counted the socket's address.
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time

import pytest
import uvicorn

from lightllm.server.http.server_options import HttpServerOptions
from lightllm.server.http.transport.uvicorn_config import build_uvicorn_config
from lightllm.utils.free_ports import free_port


async def _echo_client(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    body = json.dumps({"client": scope["client"][0], "scheme": scope["scheme"]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def _serve_and_ask(headers: dict[str, str]) -> dict[str, str]:
    port = free_port()
    args = argparse.Namespace(host="127.0.0.1", port=port)
    server = uvicorn.Server(build_uvicorn_config(_echo_client, args, HttpServerOptions()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("GET", "/", headers=headers)
        answer = json.loads(connection.getresponse().read())
        connection.close()
        return answer
    finally:
        server.should_exit = True
        thread.join(10)


FORWARDED = {"X-Forwarded-For": "10.0.0.1", "X-Forwarded-Proto": "https", "Forwarded": "for=10.0.0.2"}


def test_forwarded_headers_from_a_loopback_peer_do_not_change_the_client() -> None:
    assert _serve_and_ask(FORWARDED) == {"client": "127.0.0.1", "scheme": "http"}


def test_forwarded_allow_ips_in_the_environment_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "*")
    assert _serve_and_ask(FORWARDED) == {"client": "127.0.0.1", "scheme": "http"}


def test_no_caller_can_turn_proxy_headers_back_on() -> None:
    args = argparse.Namespace(host="127.0.0.1", port=free_port())
    for override in ({"proxy_headers": True}, {"forwarded_allow_ips": "*"}):
        with pytest.raises(ValueError, match="cannot be overridden"):
            build_uvicorn_config(_echo_client, args, HttpServerOptions(), **override)
