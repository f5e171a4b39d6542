"""--http_send_timeout on a real uvicorn server over loopback: a client that stops reading its stream
has its connection closed, and the application sees the disconnect (which aborts the request).

Before, nothing bounded a stalled reader: the engine kept generating and every later token was
buffered for it until the generation ended (32 MiB for one ``n: 16`` stream with alternatives).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any, Callable, ContextManager

import pytest

from lightllm.server.http.server_options import HttpLimits
from uvicorn_in_thread import serving_in_thread

SEND_TIMEOUT = 0.5
CHUNK = b"data: " + b"x" * 8186 + b"\n\n"


class EndlessStream:
    """An ASGI app streaming chunks until its client goes away; records how the stream ended."""

    def __init__(self, pause_s: float = 0.0) -> None:
        self.pause_s = pause_s
        self.sent = 0
        self.disconnected = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()

        watcher = asyncio.ensure_future(watch())
        try:
            while not self.disconnected.is_set():
                await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
                self.sent += 1
                await asyncio.sleep(self.pause_s)
        finally:
            watcher.cancel()


def _serving(app: EndlessStream, send_timeout: float = SEND_TIMEOUT) -> ContextManager[int]:
    return serving_in_thread(app, HttpLimits(send_timeout=send_timeout), lifespan="off")


def _stream_request(port: int, receive_buffer: int = 4096) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)  # a client that reads little fills up
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    return sock


def test_a_client_that_stops_reading_is_disconnected_and_its_request_ends():
    app = EndlessStream()
    with _serving(app) as port:
        sock = _stream_request(port)
        try:
            # The bound is generous: the close is due SEND_TIMEOUT after the buffers fill.
            assert app.disconnected.wait(60), "a stalled reader was never disconnected"
            sent_by_then = app.sent
            time.sleep(0.3)
            assert app.sent == sent_by_then  # the stream stopped with the connection
            sock.settimeout(10)
            with pytest.raises((ConnectionResetError, BrokenPipeError)):
                while sock.recv(65536):
                    pass
                raise ConnectionResetError  # an orderly end is an end too
        finally:
            sock.close()


def test_a_client_that_reads_is_not_cut():
    app = EndlessStream()
    with _serving(app) as port:
        sock = _stream_request(port)
        try:
            received = 0
            stop = time.monotonic() + 8 * SEND_TIMEOUT
            while time.monotonic() < stop:
                received += len(sock.recv(65536))
            assert received > len(CHUNK) and not app.disconnected.is_set()
        finally:
            sock.close()


def test_a_client_reading_slowly_keeps_its_stream():
    """A reader far slower than the stream keeps it: its progress is seen in the kernel's send queue.

    asyncio's own buffer moves into the kernel only when the socket turns writable, after about half
    of a send queue of megabytes drained: watched alone it showed no progress for half a minute at
    40 KB/s, and the deadline cut this client.
    """
    app = EndlessStream()
    with _serving(app, send_timeout=2.0) as port:
        sock = _stream_request(port, receive_buffer=2048)
        try:
            received = 0
            stop = time.monotonic() + 10
            while time.monotonic() < stop:
                received += len(sock.recv(2048))  # about 40 KB/s
                time.sleep(0.05)
            assert received > 0 and not app.disconnected.is_set()
        finally:
            sock.close()
