"""Reading just enough of a request head to tell a health probe, and the raw answers the front door writes.

The front door (:mod:`lightllm.server.http.transport.front_door`) runs before uvicorn's HTTP parser, so it
recognises probes from the raw bytes; anything it does not recognise goes to uvicorn unchanged.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Any, Dict, List, Optional, Sequence, Tuple

from lightllm.server.http.middleware.absolute_form import origin_form_path
from lightllm.server.http.service.health import PROBE_PATHS
from lightllm.server.http.retry_after import body_error_code, retry_after_head_lines

MAX_HEAD_BYTES = 16 * 1024  # uvicorn's h11 limit on a request head
_HEALTH_PREFIXES = (b"GET /health", b"HEAD /health", b"GET /ping", b"HEAD /ping")
# Lines end in CRLF or, as h11 (and so uvicorn) also accepts, a bare LF; a blank line ends the head.
_HEAD_END = re.compile(rb"\n\r?\n")
# The complete header lines the CORS layer reads (the front door's answers to heads it does not parse).
# A value is taken up to its line end and stripped afterwards: a lazy value followed by optional
# blanks backtracked over every blank run (seconds of the front door's thread for one 16 KiB line
# of spaces).  Cookie is read too: Starlette 0.x echoes the origin instead of "*" when one is sent.
_CORS_LINE = re.compile(rb"^(origin|access-control-request-method|cookie)[ \t]*:([^\r\n]*)\r?\n",
                        re.IGNORECASE | re.MULTILINE)


def head_end(data: bytes) -> int:
    """The length of the complete request head at the start of ``data``, or -1 while it is incomplete."""
    match = _HEAD_END.search(data)
    return -1 if match is None else match.end()


def request_line(data: bytes) -> Tuple[bytes, bool]:
    """The request line read so far (without its line end), and whether it is complete."""
    end = data.find(b"\n")
    return (data, False) if end < 0 else (data[:end].rstrip(b"\r"), True)


def _probe_target(line: bytes) -> Optional[str]:
    """The health path a complete ``GET``/``HEAD`` HTTP/1.x request line asks for, else None."""
    parts = line.split(b" ")
    if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD") or not parts[2].startswith(b"HTTP/1."):
        return None
    path = target_path(parts[1])
    return path if path in PROBE_PATHS else None


def target_path(target: bytes) -> str:
    """The path of a request target, without its query; an absolute-form target's own path
    (as :class:`~lightllm.server.http.middleware.absolute_form.AbsoluteFormMiddleware` routes it)."""
    path = target.split(b"?", 1)[0].decode("latin-1")
    return origin_form_path(path) or path


def health_path(data: bytes) -> Optional[str]:
    """The health path of a complete ``GET``/``HEAD`` head in ``data``; None for any other request."""
    line, complete = request_line(data)
    if not complete or head_end(data) < 0:
        return None
    return _probe_target(line)


def may_be_health(data: bytes) -> bool:
    """True while ``data`` is an incomplete head that could still become a health probe."""
    line, complete = request_line(data)
    if complete:
        return _probe_target(line) is not None
    return any(prefix.startswith(line) or line.startswith(prefix) for prefix in _HEALTH_PREFIXES)


def head_headers(data: bytes) -> List[Tuple[bytes, bytes]]:
    """The (lower-case name, value) header pairs of the request head in ``data``."""
    end = head_end(data)
    head = data if end < 0 else data[:end]
    headers = []
    for line in head.split(b"\n")[1:]:
        line = line.rstrip(b"\r")
        name, sep, value = line.partition(b":")
        if sep:
            headers.append((name.strip().lower(), value.strip()))
    return headers


def cors_request_headers(data: bytes) -> Tuple[str, List[Tuple[bytes, bytes]]]:
    """The method and the header lines the CORS layer reads (Origin, Access-Control-Request-Method, Cookie) of
    the head in ``data``, complete or not, found by one regular expression (a head of any size)."""
    line, _ = request_line(data)
    start = data.find(b"\n") + 1
    end = head_end(data)
    lines = _CORS_LINE.findall(data, start, end if end >= 0 else len(data)) if start else []
    return line.split(b" ", 1)[0].decode("latin-1"), [(name.lower(), value.strip(b" \t")) for name, value in lines]


def raw_response(status: int, body: Dict[str, Any], head_only: bool = False,
                 headers: Sequence[Tuple[bytes, bytes]] = ()) -> bytes:
    """A complete HTTP/1.1 JSON answer that closes the connection; ``headers``: more header lines (CORS)."""
    payload = json.dumps(body).encode("utf-8")
    extra = retry_after_head_lines(status, body_error_code(body))
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n{extra}").encode("ascii")
    head += b"".join(name + b": " + value + b"\r\n" for name, value in headers) + b"connection: close\r\n\r\n"
    return head if head_only else head + payload
