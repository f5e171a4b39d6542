"""ASGI middleware that checks a request's shape before any endpoint sees it.

* ``405`` answers carry ``Allow`` with every method the path accepts.
* A ``POST`` to an endpoint with a content type other than JSON gets ``415``. ``application/json``
  and ``application/*+json`` are accepted, with ``charset=utf-8`` or no charset (JSON is UTF-8);
  a request without ``Content-Type`` is read as JSON, so plain HTTP clients that send none keep
  working, while ``curl -d`` (form-urlencoded unless ``-H 'content-type: application/json'``) is refused.
* Headers the server reads once must appear once, a body may not be framed by both
  ``Content-Length`` and ``Transfer-Encoding``, nor compressed (``Content-Encoding``: 415), and a
  ``POST`` to an endpoint may not carry a query string (its parameters go in the body): each would
  otherwise be read in part or not at all (:func:`header_refusal`).
* The body is read here, before routing: a declared ``Content-Length`` over the limit gets ``413``
  without reading a byte; a body that grows past the limit while it arrives (chunked, or a lying
  length) gets ``413`` as soon as it does, so at most the limit is ever held; a body that does not
  arrive within the body timeout gets ``408``. Each of these answers closes the connection.
  The endpoint then receives the body in one piece. A body still arriving
  :data:`STEP_ASIDE_SECONDS` after reading began gives up its request's place among its client's
  requests being prepared while the rest arrives (:class:`~lightllm.server.http.middleware.client_share.ClientPlace`)
  and takes one again, in turn, once it is complete.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Awaitable, Callable, Dict, List, Optional

from fastapi.responses import JSONResponse
from starlette.routing import Match

from lightllm.server.http.errors import INVALID_REQUEST, error_body
from lightllm.server.admission_scope import CLIENT_SHARE_KEY

Scope = Dict[str, Any]
Message = Dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# How long a body may take to arrive before its request lets the client's next request have its place:
# long enough that a body crossing a network in several packets keeps it, short against the deadline.
STEP_ASIDE_SECONDS = 1.0
PROBED_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def header(scope: Scope, name: bytes) -> Optional[str]:
    """The first value of request header ``name`` (lower case), decoded as latin-1."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def is_json_content_type(value: Optional[str]) -> bool:
    """True for a missing content type and for JSON media types in UTF-8."""
    if value is None:
        return True
    media_type, _, params = value.partition(";")
    media_type = media_type.strip().lower()
    if media_type != "application/json" and not (media_type.startswith("application/") and media_type.endswith("+json")):
        return False
    for param in params.split(";"):
        name, _, param_value = param.partition("=")
        if name.strip().lower() == "charset" and param_value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return False
    return True


def error_response(status: int, message: str, code: str, headers: Optional[Dict[str, str]] = None,
                   param: Optional[str] = None) -> JSONResponse:
    """A JSON error answer; ``connection: close`` because the request body may be unread."""
    return JSONResponse(error_body(message, INVALID_REQUEST, param, code), status_code=status,
                        headers={"connection": "close", **(headers or {})})


# Headers read once per request: a second copy would be dropped unread (RFC 9110 section 5.3).
SINGLE_HEADERS = (b"authorization", b"content-type", b"content-encoding")


def header_refusal(scope: Scope) -> Optional[JSONResponse]:
    """The 400/415 for request headers the server would otherwise read only in part; None when they are fine.

    A header the server reads once appears at most once; a body is not framed twice
    (``Content-Length`` with ``Transfer-Encoding``: RFC 9112 section 6.1, a request-smuggling
    risk behind a proxy); a body is not compressed (``Content-Encoding`` other than
    ``identity``: the server would read compressed bytes as JSON); and a ``POST`` carries its
    parameters in the body, not in the query string, which no endpoint reads.
    """
    names = [key.lower() for key, _ in scope.get("headers", ())]
    for name in SINGLE_HEADERS:
        if names.count(name) > 1:
            return error_response(400, f"The request has the header '{name.decode()}' {names.count(name)} times; "
                                  "send it once", "invalid_http_request")
    if b"content-length" in names and b"transfer-encoding" in names:
        return error_response(400, "The request has both Content-Length and Transfer-Encoding: send one "
                              "(RFC 9112 section 6.1)", "invalid_http_request")
    encoding = header(scope, b"content-encoding")
    if encoding is not None and encoding.strip().lower() != "identity":
        return error_response(415, f"Content-Encoding '{encoding}' is not supported: send the body uncompressed",
                              "unsupported_media_type")
    if scope["method"] in BODY_METHODS and scope.get("query_string") and has_route(scope):
        query = scope["query_string"].decode("latin-1")
        return error_response(400, f"{scope['method']} {scope['path']} reads its parameters from the JSON body, "
                              f"not the query string (got '?{query[:200]}')", "invalid_http_request")
    return None


def _routes(scope: Scope) -> List[Any]:
    app = scope.get("app")
    return list(getattr(app, "routes", ()) or ())


def allowed_methods(scope: Scope) -> List[str]:
    """Every method some route of the app accepts on ``scope``'s path.

    Each method is probed through the routes' own matching, which also looks inside included routers.
    """
    return [method for method in PROBED_METHODS if has_route({**scope, "method": method})]


def has_route(scope: Scope) -> bool:
    """True when a route accepts exactly this path and method."""
    return any(route.matches(scope)[0] is Match.FULL for route in _routes(scope))


class RequestGuardMiddleware:
    """Adds ``Allow`` to 405s, refuses non-JSON bodies (415), oversized (413) and stalled (408) bodies."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, body_timeout: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = self._with_allow_header(scope, send)
        refusal = header_refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        content_type = header(scope, b"content-type")
        if scope["method"] in BODY_METHODS and not is_json_content_type(content_type) and has_route(scope):
            message = (f"Content-Type '{content_type}' is not supported: send the body as JSON "
                       "with 'Content-Type: application/json'")
            await error_response(415, message, "unsupported_media_type")(scope, receive, send)
            return
        declared = header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(scope, receive, send)
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        await self.app(scope, self._replay(body, receive), send)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> Optional[bytes]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        place = scope.get(CLIENT_SHARE_KEY)
        # Counted from the start of reading, not from the last byte: a client dripping a byte a
        # second would otherwise keep its place until the body deadline.
        step_aside_at = loop.time() + STEP_ASIDE_SECONDS if place is not None else math.inf
        stepped_aside = False
        chunks: List[bytes] = []
        size = 0
        while True:
            message_arrives = asyncio.ensure_future(receive())
            try:
                while not message_arrives.done():
                    await asyncio.wait({message_arrives}, timeout=max(0.0, min(deadline, step_aside_at) - loop.time()))
                    if message_arrives.done():
                        break
                    if loop.time() >= deadline:
                        await self._body_timed_out(scope, receive, send)
                        return None
                    # Still arriving: the client's next request may have the place meanwhile.
                    # While as many of its requests stand aside already, it keeps the place and
                    # tries again a second later (one of them may have ended by then).
                    stepped_aside = place.step_aside()
                    step_aside_at = math.inf if stepped_aside else loop.time() + STEP_ASIDE_SECONDS
            finally:
                message_arrives.cancel()
            message = message_arrives.result()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return None
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                if stepped_aside and not await self._place_again(place, receive):
                    return None  # the client left while its request waited for a place
                return b"".join(chunks)

    @staticmethod
    async def _place_again(place: Any, receive: Receive) -> bool:
        """Wait for a place after standing aside, watching the connection; False when the client left.

        Before standing aside existed a request waiting for a place had read nothing, and its
        first ``receive`` on getting one reported the disconnect; with its body read, nothing
        else would notice, and the endpoint would serve a client that is gone.
        """
        gone = asyncio.ensure_future(receive())  # after the whole body only a disconnect comes
        back = asyncio.ensure_future(place.retake())
        try:
            await asyncio.wait({gone, back}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not back.done():
                back.cancel()
            await asyncio.wait({back})
        if back.cancelled():
            return False
        back.result()
        return True

    async def _body_timed_out(self, scope: Scope, receive: Receive, send: Send) -> None:
        text = f"The request body did not arrive within {self.body_timeout:g} seconds (--http_body_timeout)"
        if "chunked" in (header(scope, b"transfer-encoding") or "").lower():
            # A whole body with bare-LF chunk lines looks like this too: say what to check.
            text += ("; it is sent chunked, and its last chunk (a 0 line and an empty line) did not arrive, "
                     "or a chunk line did not end in CRLF")
        await error_response(408, text, "request_timeout")(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (f"The request body is larger than {self.max_body_bytes} bytes "
                   "(--max_request_body_bytes)")
        await error_response(413, message, "request_too_large")(scope, receive, send)

    @staticmethod
    def _replay(body: bytes, receive: Receive) -> Receive:
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            # Later calls watch for the client going away, as the endpoints expect.
            return await receive()

        return replay

    @staticmethod
    def _with_allow_header(scope: Scope, send: Send) -> Send:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and message.get("status") == 405:
                headers = [(key, value) for key, value in message.get("headers", ()) if key.lower() != b"allow"]
                headers.append((b"allow", ", ".join(allowed_methods(scope)).encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        return sending
