"""The h11 connection of the guarded HTTP/1.1 protocol: a request-head size limit on every head,
complete or not, HTTP/1.x request lines only, and the reason a request was refused, for the answer to name.

Split from :mod:`lightllm.server.http.transport.protocol`, which answers what this connection refuses.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import h11

from lightllm.server.http.transport.probe_parsing import MAX_HEAD_BYTES

# h11 quotes the offending bytes of a line it refuses; the 400 keeps a line's worth of them.
MAX_REASON_CHARS = 160
_H11_LINE_TOO_LONG = "Receive buffer too long"
_BYTEARRAY = re.compile(r"bytearray\((b'.*'|b\".*\")\)", re.DOTALL)
# Where h11 ends a request head: a blank line, with or without its carriage return.
_HEAD_END = re.compile(rb"\n\r?\n")
# Empty lines before a request line (a client's stray CRLF after a body): RFC 9112 section 2.2.
_LEADING_EMPTY_LINES = re.compile(rb"(?:\r?\n)+")


def _readable_reason(text: str) -> str:
    """h11's error text with its ``bytearray(b'...')`` shown as the bytes, cut to a line's length."""
    if text == _H11_LINE_TOO_LONG:
        # h11's size limit, hit by a line after the head (ours comes first for heads).
        return f"a chunk-size line or trailer is larger than {MAX_HEAD_BYTES // 1024} KiB"
    text = _BYTEARRAY.sub(r"\1", text) or "malformed"
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS] + "..."


class HeadLimitedConnection(h11.Connection):
    """An h11 server connection that refuses every request head over ``MAX_HEAD_BYTES``, complete or not.

    h11's ``max_incomplete_event_size`` is checked only while a head is incomplete, so a complete
    head of any size that arrives in one read (up to 256 KiB from asyncio), or on a keep-alive
    follow-up, would be parsed. This keeps the first ``MAX_HEAD_BYTES + 1`` bytes of each head
    as they arrive and refuses the head once they show it is longer than the limit.
    """

    def __init__(self) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._head = bytearray()  # the start of the next request head, at most MAX_HEAD_BYTES + 1 bytes
        self._searched = 0  # bytes of _head already searched for the head's end
        # True once bytes arrived after a complete request the client ended with Connection: close.
        self.data_after_close = False
        # What h11 found wrong with the request (its error's text), for the 400 to name.
        self.refusal_reason: Optional[str] = None
        # The status of that refusal's answer: 400, or 505 for a version other than HTTP/1.x.
        self.refusal_status = 400

    def receive_data(self, data: bytes) -> None:
        """Feed bytes from the socket (``b""`` at end of input)."""
        super().receive_data(data)
        if self.their_state is h11.IDLE:
            self._keep(data)

    def start_next_cycle(self) -> None:
        """Reset for the next request on this connection; bytes already received start its head."""
        super().start_next_cycle()
        self._head.clear()
        self._searched = 0
        self._keep(self.trailing_data[0])

    def next_event(self) -> Any:
        """The next h11 event; raises ``h11.RemoteProtocolError`` for a head over the limit."""
        # The head's kept start mirrors h11's buffer while idle, so only a head that starts with a
        # line end costs a look at the buffer (trailing_data copies it).
        if self.their_state is h11.IDLE and self._head[:1] in (b"\r", b"\n"):
            self._skip_empty_lines()
            if self._head == b"\r" and self.trailing_data == (b"\r", False):
                return h11.NEED_DATA  # an empty line's CR whose LF is still on its way
        if self.their_state is h11.IDLE and self._head_too_large():
            # uvicorn answers a RemoteProtocolError with its 400 (GuardedH11Protocol.send_400_response).
            self.refusal_reason = f"its head is larger than {MAX_HEAD_BYTES // 1024} KiB"
            raise h11.RemoteProtocolError(f"request head larger than {MAX_HEAD_BYTES} bytes", error_status_hint=431)
        state = self.their_state
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            # h11 refuses bytes after a request sent with Connection: close (it expects EOF).
            self.data_after_close = state is h11.MUST_CLOSE
            self.refusal_reason = _readable_reason(str(exc))
            raise
        if isinstance(event, h11.Request):
            self._head.clear()
            self._searched = 0
            self._check_version(event.http_version)
        return event

    def _check_version(self, version: bytes) -> None:
        """Refuse a request line of another major version than 1 (RFC 9110 section 15.6.6: 505).

        h11 parses any ``HTTP/d.d``: an ``HTTP/2.0`` or ``HTTP/0.9`` request line was served as
        HTTP/1.1, whose framing the client may not be using (an HTTP/2 client sends a binary
        preface, not a request line; a 0.9 client expects no status line).
        """
        if not version.startswith(b"1."):
            self.refusal_status = 505
            self.refusal_reason = (f"HTTP/{version.decode('ascii', 'replace')} is not supported; "
                                   "this server speaks HTTP/1.1 (and 1.0)")
            raise h11.RemoteProtocolError(self.refusal_reason, error_status_hint=505)

    def _skip_empty_lines(self) -> None:
        """Drop empty lines received where a request line is due (RFC 9112 section 2.2: ignore them).

        Some clients end a POST body with a CRLF its Content-Length does not count; h11 refuses
        a request that starts with an empty line, so the keep-alive connection got a 400 after its
        200 (and the client's next request read that 400). h11 has no public way to drop buffered
        bytes, so its receive buffer's own extraction is used; without it the line is refused as before.
        """
        extract = getattr(getattr(self, "_receive_buffer", None), "_extract", None)
        if extract is None:
            return
        match = _LEADING_EMPTY_LINES.match(self.trailing_data[0])
        if match is None:
            return
        extract(match.end())
        # The head's size counts from the request line: its first bytes are the buffer's from here.
        self._head.clear()
        self._searched = 0
        self._keep(self.trailing_data[0])

    def _keep(self, data: bytes) -> None:
        room = MAX_HEAD_BYTES + 1 - len(self._head)
        if room > 0 and data:
            self._head += data[:room]

    def _head_too_large(self) -> bool:
        # Resume two bytes back: the end of the head may straddle two reads.
        end = _HEAD_END.search(self._head, max(0, self._searched - 2))
        self._searched = len(self._head)
        if end is not None:
            self._searched = end.start()  # found again on the next call, until the request is parsed
            return end.end() > MAX_HEAD_BYTES
        return len(self._head) > MAX_HEAD_BYTES
