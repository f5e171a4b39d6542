"""ASGI middleware: an answer given before the request body was read closes the connection.

The request guard (:mod:`.request_guard`) reads every body under the size and time limits, but
the layers outside it answer first: the API-key check (401), a refused CORS preflight (400), a
draining server (503).  Their answers left the unread body on a keep-alive connection, and
uvicorn read and discarded it to reuse the connection with no bound at all: a client without a
key streamed 22 GB in 15 s into a server with a 4 KiB body limit, and a slow body after a 401
was held past ``--http_body_timeout``.  Such an answer now carries ``connection: close``, which
ends the connection through the protocol's bounded lingering close
(:mod:`~lightllm.server.http.transport.protocol`), as the guard's own 413 and 408 do.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Dict

from lightllm.server.http.middleware.request_guard import header

Scope = Dict[str, Any]
Message = Dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def declares_body(scope: Scope) -> bool:
    """Whether the request says a body follows (a non-zero ``Content-Length``, or any ``Transfer-Encoding``)."""
    length = header(scope, b"content-length")
    return header(scope, b"transfer-encoding") is not None or (length is not None and length.strip() not in ("", "0"))


class UnreadBodyCloseMiddleware:
    """Adds ``connection: close`` to an answer that starts before the request's whole body was received."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not declares_body(scope):
            await self.app(scope, receive, send)
            return
        body_read = False

        async def receiving() -> Message:
            nonlocal body_read
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                body_read = True
            return message

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and not body_read:
                headers = [(name, value) for name, value in message.get("headers", []) if name.lower() != b"connection"]
                message = {**message, "headers": headers + [(b"connection", b"close")]}
            await send(message)

        await self.app(scope, receiving, sending)
