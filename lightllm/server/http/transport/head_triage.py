"""What the front door does with a connection, given the bytes of its request head read so far.

Kept apart from the thread and selector that move bytes (:mod:`.front_door`) so that the rules a
connection meets before the event loop sees it read in one place and can be tested without a
socket. One call per read: the answer is to wait for more bytes, to answer here (a probe, a
refusal, an oversized head) or to hand the connection to the loop. What it answers is what the app
would answer: a probe's head is read with the loop's own HTTP parser (:mod:`.head_check`), and an
answer to a request carries the headers of the app's CORS layer
(:mod:`~lightllm.server.http.middleware.cors`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import h11

from lightllm.server.http.middleware.cors import CorsHeaders
from lightllm.server.http.errors import INVALID_REQUEST, SERVICE_UNAVAILABLE, error_body
from lightllm.server.http.transport.head_check import invalid_request_body, parse_head, small_head
from lightllm.server.http.service.health import (STARTING_MESSAGE, LoopHeartbeat, Readiness, health_answer,
                                                 stopping_reason)
from lightllm.server.http.transport.probe_parsing import (MAX_HEAD_BYTES, cors_request_headers, head_end, head_headers,
                                                          health_path, may_be_health, request_line, target_path)
from lightllm.server.http.middleware.request_guard import header_refusal
from lightllm.server.http.server_options import AuthPolicy, HttpLimits

HeaderPairs = Tuple[Tuple[bytes, bytes], ...]


@dataclass(frozen=True)
class Wait:
    """Read more: the head is incomplete and what arrived does not decide yet."""


@dataclass(frozen=True)
class Answer:
    """Answer here and close; ``refusal`` (a code) is counted in the refusal log when set; ``headers``:
    the CORS headers the app would have put on it (none for a head the app never reads as a request)."""

    status: int
    body: Dict[str, Any]
    head_only: bool = False
    refusal: Optional[str] = None
    headers: HeaderPairs = ()


@dataclass(frozen=True)
class HandOff:
    """Serve the connection on the loop, fed the bytes read so far."""


Verdict = Union[Wait, Answer, HandOff]


@dataclass(frozen=True)
class DoorState:
    """What the front door knows of the server at one moment (read under its lock)."""

    phase: str  # "starting", "serving" or "stopping"
    readiness: Readiness
    heartbeat: Optional[LoopHeartbeat]


class HeadTriage:
    """Decides a connection's :data:`Verdict` from its head's bytes; holds the key sets it checks and
    the app's CORS policy (``allowed_origins``: ``--allowed_origins``) its answers follow."""

    def __init__(self, limits: HttpLimits, auth: AuthPolicy, allowed_origins: Sequence[str] = ()) -> None:
        from lightllm.server.http.middleware.auth import KeySet

        self.limits = limits
        self._client_keys = KeySet((*auth.api_keys, *auth.admin_keys)) if auth.requires_key else None
        self._cluster_key = KeySet([auth.cluster_key]) if auth.cluster_key else None
        self._cors = CorsHeaders(allowed_origins)

    def verdict(self, data: bytes, reserve: bool, state: Callable[[], DoorState],
                reserve_can_serve: Callable[[], bool]) -> Verdict:
        """The verdict for ``data``; ``reserve``: the connection holds a reserve place.

        ``state`` is called only when the verdict depends on it (probes and complete requests).
        """
        end = head_end(data)
        head_complete = end >= 0
        # A complete head counts as much as one still arriving (probes included): the limit is on
        # the head, not on how it was sent; the loop's protocol applies it to the heads it reads.
        if (end if head_complete else len(data)) > MAX_HEAD_BYTES:
            return Answer(400, invalid_request_body(f"its head is larger than {MAX_HEAD_BYTES // 1024} KiB"))
        path = health_path(data)
        if path is not None:
            probe = self._probe(data, path, reserve, state)
            if probe is not None:
                return probe
        elif may_be_health(data) or (reserve and not head_complete):
            return Wait()
        now = state()
        if now.phase != "serving" and not head_complete:
            return Wait()  # its answer carries the CORS headers of its Origin: read the whole head first
        if now.phase != "serving":
            return self._unavailable(now, data)
        if reserve and not self.authenticated(data):
            message = (f"The server already holds its maximum of {self.limits.max_connections} connections "
                       "(--http_max_connections); retry later (requests with an API key are still served)")
            return self._full(message, data)
        if reserve and not reserve_can_serve():
            message = (f"The server already holds its maximum of {self.limits.max_connections} connections "
                       f"(--http_max_connections) and serves {self.limits.reserve_connections} more from its "
                       "reserve; retry later")
            return self._full(message, data)
        return HandOff()

    def at_eof(self, data: bytes, reserve: bool, state: Callable[[], DoorState]) -> Optional[Answer]:
        """The answer to a client that closed its sending side after ``data``, an incomplete head; None: drop it.

        While the server starts or stops, the 503 a complete head would get (as it got on its first
        bytes before the front door waited for whole heads); a probe's beginning, or a connection
        in the reserve, is dropped, as ever.
        """
        if not data or reserve or may_be_health(data):
            return None
        now = state()
        return None if now.phase == "serving" else self._unavailable(now, data)

    def _unavailable(self, now: DoorState, data: bytes) -> Answer:
        """The 503 while the server starts (``starting``) or stops (any later phase)."""
        if now.phase == "starting":
            return self._answer(503, error_body(STARTING_MESSAGE,
                                                SERVICE_UNAVAILABLE, None, "server_starting"), data)
        code, message = stopping_reason(now.readiness)
        return self._answer(503, error_body(message, SERVICE_UNAVAILABLE, None, code), data)

    def _probe(self, data: bytes, path: str, reserve: bool, state: Callable[[], DoorState]) -> Optional[Verdict]:
        """The verdict for a complete probe head; None when the app would not serve it as a probe
        (it refuses one of its headers), so it takes the path of any other request."""
        end = head_end(data)
        if not small_head(data, end):
            # Too large to parse here without holding up every probe behind it: the loop's protocol
            # reads it, if there is a loop to take it; otherwise answered as a probe unparsed.
            now = state()
            if now.phase == "serving" and not reserve:
                return HandOff()
            status, body = health_answer(path, now.readiness, now.heartbeat)
            method, headers = cors_request_headers(data)
            cors = tuple(self._cors.for_request(method, headers))
            return Answer(status, body, head_only=method == "HEAD", headers=cors)
        head = parse_head(data)
        if head is None:
            return None
        if head.request is None:
            # What the loop's protocol answers the same bytes (it sends no CORS headers either).
            return Answer(400, invalid_request_body(head.refusal or "malformed"))
        request = head.request
        method = request.method.decode("ascii")
        scope = {"type": "http", "method": method, "path": path, "headers": list(request.headers),
                 "query_string": request.target.partition(b"?")[2]}
        if header_refusal(scope) is not None:
            return None
        now = state()
        # Empty lines before a request are ignored (RFC 9112 2.2): a stray CRLF is not a pipelined request.
        if head.rest.strip(b"\r\n") and now.phase == "serving" and not reserve:
            # More follows the probe (pipelined requests, a body): the loop serves them all in turn;
            # answered here, they would be cut off by the probe's close.
            return HandOff()
        status, body = health_answer(path, now.readiness, now.heartbeat)
        return Answer(status, body, head_only=method == "HEAD", headers=self._cors_headers(request))

    def _cors_headers(self, request: h11.Request) -> HeaderPairs:
        return tuple(self._cors.for_request(request.method.decode("ascii"), list(request.headers)))

    def _answer(self, status: int, body: Dict[str, Any], data: bytes, refusal: Optional[str] = None) -> Answer:
        """An answer to the head in ``data``, with the CORS headers the app would add to it (a small
        complete head read by the parser: none if it refuses it; any other by its Origin lines)."""
        headers: HeaderPairs = ()
        if self._cors.enabled:
            end = head_end(data)
            if end >= 0 and small_head(data, end):
                head = parse_head(data)
                if head is not None and head.request is not None:
                    headers = self._cors_headers(head.request)
            else:
                headers = tuple(self._cors.for_request(*cors_request_headers(data)))
        return Answer(status, body, refusal=refusal, headers=headers)

    def authenticated(self, data: bytes) -> bool:
        """True if the head carries a client key, or the cluster key on a ``/pd/`` path."""
        from lightllm.server.http.middleware.auth import CLUSTER_PATH_PREFIX, bearer_token

        token = bearer_token({"headers": head_headers(data)})
        line, _ = request_line(data)
        parts = line.split(b" ")
        path = target_path(parts[1]) if len(parts) > 1 else ""
        if self._cluster_key is not None and path.startswith(CLUSTER_PATH_PREFIX):
            return self._cluster_key.contains(token)
        return self._client_keys is not None and self._client_keys.contains(token)

    def _full(self, message: str, data: bytes) -> Answer:
        code = "too_many_connections"
        return self._answer(503, error_body(message, SERVICE_UNAVAILABLE, None, code), data, refusal=code)


def request_head_timeout(seconds: float) -> Answer:
    """The 408 for a head that did not arrive within ``--http_header_timeout``."""
    message = (f"The request head (request line and headers) did not arrive within "
               f"{seconds:g} seconds (--http_header_timeout)")
    return Answer(408, error_body(message, INVALID_REQUEST, None, "request_timeout"))


def admission_refusal(refusal: Tuple[str, str]) -> Answer:
    """The 503 for a connection the connection book refused at accept (``(code, message)``)."""
    return Answer(503, error_body(refusal[1], SERVICE_UNAVAILABLE, None, refusal[0]))
