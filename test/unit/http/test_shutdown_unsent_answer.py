"""An answer still being sent when the server stops: its connection is closed before uvicorn's
cancel, so the request ends as a client disconnect, not as a task cancelled mid-write.

uvicorn's shutdown calls each connection's ``shutdown()``, waits its graceful-shutdown timeout for
the answers still being sent, then cancels their tasks ("Exception in ASGI application" with a
CancelledError traceback; a stream cut mid-event).  An outside test saw it for a client that read
nothing of a 3 MB stream at a SIGTERM's deadline.  The test drives the real
:class:`~lightllm.server.http.transport.protocol.GuardedH11Protocol` over a socketpair whose client reads
nothing, so the server's writes pause with an answer unsent.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, Callable, Dict

import uvicorn
from uvicorn.server import ServerState

from lightllm.server.http.transport.protocol import SHUTDOWN_CLOSE_SHARE, guarded_protocol_class
from lightllm.server.http.server_options import HttpLimits

GRACE_S = 0.4
CHUNK = b"data: " + b"x" * 65536 + b"\n\n"


class EndlessStream:
    """An ASGI app streaming until its client disconnects (as the server's streams do)."""

    def __init__(self) -> None:
        self.writes_paused = asyncio.Event()
        self.ended_by: Any = None
        self.protocol: Any = None

    async def __call__(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        while True:
            if self.protocol.flow.write_paused:
                self.writes_paused.set()
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
            if self.protocol.cycle.disconnected:
                self.ended_by = await receive()
                return


async def _serve(app: Any, grace_s: float, receive_buffer: int = 0) -> tuple[Any, socket.socket]:
    """``app`` behind the real protocol over a socketpair, one streaming request sent (uvicorn runs the app)."""
    server_sock, client_sock = socket.socketpair()
    if receive_buffer:
        client_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    config = uvicorn.Config(app, log_level="error", lifespan="off", proxy_headers=False,
                            timeout_graceful_shutdown=grace_s)
    config.load()
    protocol = guarded_protocol_class(HttpLimits())(config=config, server_state=ServerState(), app_state={})
    app.protocol = protocol
    await asyncio.get_running_loop().connect_accepted_socket(lambda: protocol, server_sock)
    client_sock.sendall(b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    return protocol, client_sock


async def _stop_while_sending() -> tuple[EndlessStream, float]:
    app = EndlessStream()
    protocol, client_sock = await _serve(app, GRACE_S, receive_buffer=4096)
    loop = asyncio.get_running_loop()
    await asyncio.wait_for(app.writes_paused.wait(), 10)
    started = loop.time()
    protocol.shutdown()  # what uvicorn's Server.shutdown calls on every connection
    await asyncio.wait_for(_ended(app), GRACE_S)  # before uvicorn would cancel (timeout + 0.1 s)
    client_sock.close()
    return app, loop.time() - started


async def _ended(app: EndlessStream) -> None:
    while app.ended_by is None:
        await asyncio.sleep(0.01)


def test_an_answer_still_being_sent_at_shutdown_ends_as_a_disconnect_before_uvicorns_cancel(caplog):
    caplog.set_level(logging.WARNING, logger="lightllm.server.http.transport.protocol")
    app, took = asyncio.run(_stop_while_sending())
    assert app.ended_by == {"type": "http.disconnect"}
    assert GRACE_S * SHUTDOWN_CLOSE_SHARE - 0.05 <= took < GRACE_S
    assert "whose answer was still being sent when the server stopped (its client had not read it in time)" in caplog.text


class PausingStream:
    """An ASGI app that sends one small chunk, then waits to be released before it ends its answer."""

    def __init__(self) -> None:
        self.sent_first = asyncio.Event()
        self.release = asyncio.Event()
        self.completed = False
        self.protocol: Any = None

    async def __call__(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        self.sent_first.set()
        await self.release.wait()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        self.completed = not self.protocol.cycle.disconnected


async def _stop_while_client_reads() -> PausingStream:
    app = PausingStream()
    protocol, client_sock = await _serve(app, 1.0)
    await asyncio.wait_for(app.sent_first.wait(), 10)
    protocol.shutdown()
    await asyncio.sleep(0.6)  # past the first check (0.5 s): its writes are not paused, so it keeps going
    assert not protocol._lost
    app.release.set()
    for _ in range(100):
        if app.completed or protocol._lost:
            break
        await asyncio.sleep(0.01)
    client_sock.close()
    return app


def test_a_client_still_taking_its_answer_keeps_its_connection_until_just_before_uvicorns_cancel(caplog):
    caplog.set_level(logging.WARNING, logger="lightllm.server.http.transport.protocol")
    app = asyncio.run(_stop_while_client_reads())
    assert app.completed
    assert "still being sent" not in caplog.text
