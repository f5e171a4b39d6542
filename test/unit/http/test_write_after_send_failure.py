"""A response that writes several chunks in one loop turn after its client is gone: no asyncio
``socket.send() raised exception.`` warnings, and the request learns of the disconnect at once.

asyncio's socket transport tells the protocol ``connection_lost`` only on the loop's next turn
after a send failed; until then each further write just counts, and from the fifth on logs that
warning (no request id).  A PD master relaying a burst of a node's tokens to a client that reset
its connection wrote a chunk per token in one turn and filled its log with them.  The test drives
the real :class:`~lightllm.server.http.transport.protocol.GuardedH11Protocol` with a real asyncio socket
transport over a socketpair whose peer is closed before the response starts, so the first write
fails deterministically (EPIPE) and the rest of the burst comes in the same turn.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, Callable, Dict

import uvicorn
from uvicorn.server import ServerState

from lightllm.server.http.transport.protocol import guarded_protocol_class
from lightllm.server.http.server_options import HttpLimits

BURST = 20  # chunks written in one loop turn after the peer went away (asyncio warns from the 5th on)


class BurstAfterPeerClosed:
    """An ASGI app that closes the client's end of the socketpair, then writes a burst in one turn."""

    def __init__(self, peer: socket.socket) -> None:
        self.peer = peer
        self.disconnected_after_burst: Any = None
        self.next_message: Dict[str, Any] = {}
        self.done = asyncio.Event()
        self.protocol: Any = None  # the connection's protocol, whose cycle this request is

    async def __call__(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        try:
            await receive()  # the (empty) request body
            self.peer.close()  # the client is gone: the next send on the server's socket fails
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for _ in range(BURST):
                # uvicorn's send does not yield while writes are not paused: one loop turn in all.
                await send({"type": "http.response.body", "body": b"data: token\n\n", "more_body": True})
            self.disconnected_after_burst = self.protocol.cycle.disconnected
            self.next_message = await receive()
        finally:
            self.done.set()


async def _serve_one_request() -> BurstAfterPeerClosed:
    server_sock, client_sock = socket.socketpair()
    app = BurstAfterPeerClosed(client_sock)
    config = uvicorn.Config(app, log_level="error", lifespan="off", proxy_headers=False)
    config.load()
    protocol_class = guarded_protocol_class(HttpLimits())
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    app.protocol = protocol
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(lambda: protocol, server_sock)
    client_sock.sendall(b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    await asyncio.wait_for(app.done.wait(), 10)
    transport.close()
    await asyncio.sleep(0)
    return app


def test_a_burst_written_after_the_client_left_logs_no_asyncio_warning_and_disconnects(caplog):
    caplog.set_level(logging.WARNING, logger="asyncio")
    app = asyncio.run(_serve_one_request())
    warnings = [record for record in caplog.records
                if record.name == "asyncio" and "socket.send() raised exception" in record.getMessage()]
    assert warnings == [], f"{len(warnings)} asyncio write warnings for one departed client"
    # The request learns of the disconnect in the same turn (connection_lost comes a turn later).
    assert app.disconnected_after_burst is True
    assert app.next_message == {"type": "http.disconnect"}
