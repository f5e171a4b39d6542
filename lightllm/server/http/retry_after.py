"""The ``Retry-After`` header on a 503 that a retry of the same request to the same server can cure.

A 503 means two different things to a client: "this server cannot take it now, ask again in a
moment" (busy, too many connections, still loading the model, a PD cluster still missing a node)
and "this server will not take it, go elsewhere" (shutting down, a process died, an event loop
that stopped turning). Only the first kind carries ``Retry-After`` (RFC 9110, section 10.2.3,
in whole seconds), so a client that honours it (the official OpenAI SDKs do, up to 60 s) waits
the right time instead of its own backoff, and a load balancer that sees no header moves on.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

# Seconds to wait, by the 503's ``code``. Busy and connection-cap refusals clear as soon as a
# request finishes (well under a second on a loaded server); loading a model or registering a PD
# node takes seconds, and a probe or retry every second would only add load.
RETRY_AFTER_SECONDS: Mapping[str, int] = {
    "server_busy": 1,
    "too_many_connections": 1,
    "too_many_client_connections": 1,
    "server_starting": 5,
    "pd_not_ready": 2,
}


def retry_after_seconds(status: int, code: Optional[str]) -> Optional[int]:
    """The ``Retry-After`` seconds for an answer with ``status`` and error ``code``, or None for no header."""
    if status != 503 or code is None:
        return None
    return RETRY_AFTER_SECONDS.get(code)


def retry_after_headers(status: int, code: Optional[str]) -> Dict[str, str]:
    """``{"retry-after": "N"}`` for a retryable 503, else an empty dict (merged into a response's headers)."""
    seconds = retry_after_seconds(status, code)
    return {} if seconds is None else {"retry-after": str(seconds)}


def retry_after_head_lines(status: int, code: Optional[str]) -> str:
    """The header lines (CRLF-ended) of :func:`retry_after_headers`, for an answer written as raw bytes."""
    return "".join(f"{name}: {value}\r\n" for name, value in retry_after_headers(status, code).items())


def body_error_code(body: Mapping[str, Any]) -> Optional[str]:
    """The ``code`` of an OpenAI error body ``{"error": {"code": ...}}``, or None for any other body."""
    error = body.get("error")
    code = error.get("code") if isinstance(error, Mapping) else None
    return code if isinstance(code, str) else None
