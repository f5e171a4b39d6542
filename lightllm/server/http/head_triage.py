"""What the front door does with a connection, given the bytes of its request head read so far.

Kept apart from the thread and selector that move bytes (:mod:`.front_door`) so that the rules a
connection meets before the event loop sees it read in one place and can be tested without a
socket. One call per read: the answer is to wait for more bytes, to answer here (a probe, a
refusal, an oversized head) or to hand the connection to the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

from lightllm.server.http.errors import INVALID_REQUEST, SERVICE_UNAVAILABLE, error_body
from lightllm.server.http.health import LoopHeartbeat, Readiness, health_answer, stopping_reason
from lightllm.server.http.probe_parsing import (MAX_HEAD_BYTES, head_end, head_headers, health_path, may_be_health,
                                               request_line, target_path)
from lightllm.server.http.server_options import AuthPolicy, HttpLimits


@dataclass(frozen=True)
class Wait:
    """Read more: the head is incomplete and what arrived does not decide yet."""


@dataclass(frozen=True)
class Answer:
    """Answer here and close; ``refusal`` (a code) is counted in the refusal log when set."""

    status: int
    body: Dict[str, Any]
    head_only: bool = False
    refusal: Optional[str] = None


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
    """Decides a connection's :data:`Verdict` from its head's bytes; holds the key sets it checks."""

    def __init__(self, limits: HttpLimits, auth: AuthPolicy) -> None:
        from lightllm.server.http.auth import KeySet

        self.limits = limits
        self._client_keys = KeySet((*auth.api_keys, *auth.admin_keys)) if auth.requires_key else None
        self._cluster_key = KeySet([auth.cluster_key]) if auth.cluster_key else None

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
            message = f"Invalid HTTP request: its head is larger than {MAX_HEAD_BYTES // 1024} KiB"
            return Answer(400, error_body(message, INVALID_REQUEST, None, "invalid_http_request"))
        path = health_path(data)
        if path is not None:
            now = state()
            status, body = health_answer(path, now.readiness, now.heartbeat)
            return Answer(status, body, head_only=data.startswith(b"HEAD "))
        if may_be_health(data) or (reserve and not head_complete):
            return Wait()
        now = state()
        if now.phase == "starting":
            return Answer(503, error_body("The server is starting (loading the model); retry later",
                                          SERVICE_UNAVAILABLE, None, "server_starting"))
        if now.phase != "serving":
            code, message = stopping_reason(now.readiness)
            return Answer(503, error_body(message, SERVICE_UNAVAILABLE, None, code))
        if reserve and not self.authenticated(data):
            message = (f"The server already holds its maximum of {self.limits.max_connections} connections "
                       "(--http_max_connections); retry later (requests with an API key are still served)")
            return self._full(message)
        if reserve and not reserve_can_serve():
            message = (f"The server already holds its maximum of {self.limits.max_connections} connections "
                       f"(--http_max_connections) and serves {self.limits.reserve_connections} more from its "
                       "reserve; retry later")
            return self._full(message)
        return HandOff()

    def authenticated(self, data: bytes) -> bool:
        """True if the head carries a client key, or the cluster key on a ``/pd/`` path."""
        from lightllm.server.http.auth import CLUSTER_PATH_PREFIX, bearer_token

        token = bearer_token({"headers": head_headers(data)})
        line, _ = request_line(data)
        parts = line.split(b" ")
        path = target_path(parts[1]) if len(parts) > 1 else ""
        if self._cluster_key is not None and path.startswith(CLUSTER_PATH_PREFIX):
            return self._cluster_key.contains(token)
        return self._client_keys is not None and self._client_keys.contains(token)

    @staticmethod
    def _full(message: str) -> Answer:
        code = "too_many_connections"
        return Answer(503, error_body(message, SERVICE_UNAVAILABLE, None, code), refusal=code)


def request_head_timeout(seconds: float) -> Answer:
    """The 408 for a head that did not arrive within ``--http_header_timeout``."""
    message = (f"The request head (request line and headers) did not arrive within "
               f"{seconds:g} seconds (--http_header_timeout)")
    return Answer(408, error_body(message, INVALID_REQUEST, None, "request_timeout"))


def admission_refusal(refusal: Tuple[str, str]) -> Answer:
    """The 503 for a connection the connection book refused at accept (``(code, message)``)."""
    return Answer(503, error_body(refusal[1], SERVICE_UNAVAILABLE, None, refusal[0]))
