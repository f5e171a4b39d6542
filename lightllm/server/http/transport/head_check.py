"""A complete request head read as the loop's HTTP protocol reads it, for the answers the front door gives itself.

The front door (:mod:`lightllm.server.http.transport.front_door`) recognises health probes from the raw
bytes, before uvicorn's parser sees them.  It answered 200 to heads that parser refuses with a
400 (an HTTP/1.1 request without ``Host`` or with two, an illegal header line, a byte outside
ASCII in the target: RFC 9112), so the same bytes got a different verdict on a fresh connection
than on a keep-alive one.  Reading the head with the protocol's own h11 connection
(:class:`~lightllm.server.http.transport.head_limited_connection.HeadLimitedConnection`) gives the front
door the protocol's verdict and the parsed request its answers' CORS headers come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import h11

from lightllm.server.http.errors import INVALID_REQUEST, error_body
from lightllm.server.http.transport.head_limited_connection import HeadLimitedConnection


# The heads the front door reads with the parser: a real probe's is a few hundred bytes; a larger one
# (16 KiB of tiny headers took the parser 8 ms) would hold up every probe behind it.
SMALL_HEAD_BYTES = 2048
SMALL_HEAD_LINES = 32  # header lines


def small_head(data: bytes, end: int) -> bool:
    """True if the complete head ending at ``end`` in ``data`` is small enough to be parsed on the front door."""
    return end <= SMALL_HEAD_BYTES and data.count(b"\n", 0, end) <= SMALL_HEAD_LINES + 2


@dataclass(frozen=True)
class ParsedHead:
    """A complete head as the protocol reads it: the request, or why it answers 400."""

    request: Optional[h11.Request]  # None when refused
    refusal: Optional[str] = None  # the protocol's reason for its 400 (h11's, made readable)
    rest: bytes = b""  # what follows the head (a body, a pipelined request)


def parse_head(data: bytes) -> Optional[ParsedHead]:
    """``data``'s request head read by the protocol's parser; None while the head is incomplete."""
    conn = HeadLimitedConnection()
    conn.receive_data(data)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError:
        return ParsedHead(None, conn.refusal_reason or "malformed")
    if not isinstance(event, h11.Request):
        return None
    return ParsedHead(event, rest=conn.trailing_data[0])


def invalid_request_body(reason: str) -> Dict[str, Any]:
    """The error body of the 400 for a request head the protocol refuses (``reason``: what is wrong)."""
    return error_body(f"Invalid HTTP request: {reason}", INVALID_REQUEST, None, "invalid_http_request")
