"""Reading just enough of a request head to tell a health probe, and the raw answers the front door writes.

The front door (:mod:`lightllm.server.http.front_door`) runs before uvicorn's HTTP parser, so it
recognises probes from the raw bytes; anything it does not recognise goes to uvicorn unchanged.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any, Dict, List, Optional, Tuple

from lightllm.server.http.health import HEALTH_PATHS

MAX_HEAD_BYTES = 16 * 1024  # uvicorn's h11 limit on a request head
_HEALTH_PREFIXES = (b"GET /health", b"HEAD /health")


def request_line(data: bytes) -> Tuple[bytes, bool]:
    """The request line read so far, and whether it is complete."""
    end = data.find(b"\r\n")
    return (data, False) if end < 0 else (data[:end], True)


def health_path(data: bytes) -> Optional[str]:
    """The health path of a complete ``GET``/``HEAD`` head in ``data``; None for any other request."""
    line, complete = request_line(data)
    if not complete or b"\r\n\r\n" not in data:
        return None
    parts = line.split(b" ")
    if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD") or not parts[2].startswith(b"HTTP/1."):
        return None
    path = parts[1].split(b"?", 1)[0].decode("latin-1")
    return path if path in HEALTH_PATHS else None


def may_be_health(data: bytes) -> bool:
    """True while ``data`` is an incomplete head that could still become a health probe."""
    line, complete = request_line(data)
    if complete:
        parts = line.split(b" ")
        return (len(parts) == 3 and parts[0] in (b"GET", b"HEAD")
                and parts[1].split(b"?", 1)[0].decode("latin-1") in HEALTH_PATHS)
    return any(prefix.startswith(line) or line.startswith(prefix) for prefix in _HEALTH_PREFIXES)


def head_headers(data: bytes) -> List[Tuple[bytes, bytes]]:
    """The (lower-case name, value) header pairs of the request head in ``data``."""
    head = data.split(b"\r\n\r\n", 1)[0]
    headers = []
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            headers.append((name.strip().lower(), value.strip()))
    return headers


def raw_response(status: int, body: Dict[str, Any], head_only: bool = False) -> bytes:
    """A complete HTTP/1.1 JSON answer that closes the connection."""
    payload = json.dumps(body).encode("utf-8")
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n").encode("ascii")
    return head if head_only else head + payload
