"""uvicorn's HTTP/1.1 (h11) protocol with the guards a public endpoint needs against stalled clients.

uvicorn times out only idle keep-alive connections: a client that opens a connection and then
sends its request head slowly (slowloris), or nothing at all, holds it forever, and there is no
cap on open connections. :class:`GuardedH11Protocol` adds

* a head deadline: the request line and headers must arrive within ``header_timeout`` seconds of
  the connection (or of the first byte of a follow-up request on a keep-alive connection); the
  deadline is not pushed back by further bytes, so dripping one header a second does not help;
* a connection cap: a connection beyond ``max_connections`` is answered 503 at once and closed;
* a hand-over from the front door (:mod:`lightllm.server.http.transport.front_door`): a connection it accepted
  arrives with the bytes it read (``front_door_data``) and the head deadline it started
  (``front_door_deadline``); the front door enforces the connection limits then, and is told when
  the connection closes (``front_door_release``);
* a lingering close: when the server answers before it has read the whole request (413, 408, the
  503 above), it stops writing, then reads and discards input for up to ``LINGER_SECONDS`` before
  closing, so a client still sending its body reads the answer instead of a connection reset;
* a request-head size limit of :data:`~lightllm.server.http.transport.probe_parsing.MAX_HEAD_BYTES`
  (16 KiB) on every request of the connection, complete heads included (h11's own limit only
  bounds a head that is still arriving), applied by its connection
  (:class:`~lightllm.server.http.transport.head_limited_connection.HeadLimitedConnection`);
* a JSON body on uvicorn's own 400 for a malformed request, naming what h11 refused;
* an answer after a half-close: a client that shuts down its sending side after a complete
  ``GET``/``HEAD``/``OPTIONS`` request (``nc -N``, HTTP/1.0 scripts) may still read, so the
  connection stays open until the requests read before the EOF are answered, then closes.
  asyncio closed it on the EOF, and this app's middleware yields to the loop before answering,
  so such clients got nothing (stock uvicorn answers them when the handler wins the race).  A
  client that closed altogether fails the write; one that reads nothing meets the send
  deadline.  A generation request after a half-close is its client gone, as in uvicorn and
  vLLM: it is aborted;
* a send deadline (:class:`~lightllm.server.http.transport.send_deadline.SendDeadline`): a connection whose
  client takes none of its answer for ``send_timeout`` seconds while uvicorn's writes are paused
  is closed, which aborts a request still running on it;
* no writes to a lost connection: once a send failed (the client reset the connection) asyncio
  calls ``connection_lost`` only on the loop's next turn, and a response writing several chunks
  in one turn (a PD master relaying a burst of a node's tokens) went on writing into the dead
  transport, one ``socket.send() raised exception.`` warning (no request id) per write from the
  fifth on.  The transport uvicorn sees
  (:class:`~lightllm.server.http.transport.guarded_transport.GuardedTransport`) drops such writes and marks
  the request's client disconnected at once, so the application sees the disconnect (and aborts
  the request) as it would after ``connection_lost``;
* a bounded end to an answer still being sent when the server stops: uvicorn waits its
  graceful-shutdown timeout for it, then cancels the request's task mid-write (a stream cut
  mid-event, an "Exception in ASGI application" traceback); such a connection is closed at
  :data:`SHUTDOWN_CLOSE_SHARE` of that timeout when its client takes nothing, or just before
  the timeout ends when it is still reading, which the request handles as its client's
  disconnect, with one log line.

The body deadline is enforced where the body is read (:mod:`lightllm.server.http.middleware.request_guard`).
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import time
from typing import Any, Callable, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from lightllm.server.http.errors import INVALID_REQUEST, SERVICE_UNAVAILABLE, error_body
from lightllm.server.http.transport.guarded_transport import GuardedTransport
from lightllm.server.http.transport.head_check import invalid_request_body
from lightllm.server.http.transport.head_limited_connection import HeadLimitedConnection
from lightllm.server.http.log_throttle import IntervalGate
from lightllm.server.http.retry_after import retry_after_head_lines
from lightllm.server.http.transport.send_deadline import SendDeadline
from lightllm.server.http.server_options import HttpLimits

# Long enough for a client on a fast link to finish sending a refused body and read the answer,
# short enough that a refused client cannot hold the socket.
LINGER_SECONDS = 2.0
REFUSAL_LOG_INTERVAL_SECONDS = 10.0
# The share of uvicorn's graceful-shutdown timeout after which a connection whose answer is
# still being sent is closed when its client takes nothing (its writes are paused).  A client
# still reading keeps its connection until SHUTDOWN_CANCEL_MARGIN_S before the timeout ends
# (checked every SHUTDOWN_RECHECK_S), which leaves the request time to end as a disconnect
# before uvicorn cancels it (0.1 s after the timeout).
SHUTDOWN_CLOSE_SHARE = 0.5
SHUTDOWN_CANCEL_MARGIN_S = 0.2
SHUTDOWN_RECHECK_S = 0.05
# Requests answered after their client half-closed its sending side: the safe methods (RFC 9110
# section 9.2.1), none of which generates here.  A POST is a client gone (its generation aborted).
HALF_CLOSE_ANSWERED_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

logger = logging.getLogger(__name__)


def raw_json_response(status: int, message: str, error_type: str, code: str) -> bytes:
    """A complete HTTP/1.1 response with an error body that closes the connection."""
    body = json.dumps(error_body(message, error_type, None, code)).encode("utf-8")
    head = (
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        + retry_after_head_lines(status, code)
        + "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with a request-head deadline, a connection cap and lingering close.

    Subclasses made by :func:`guarded_protocol_class` set ``limits``.
    """

    limits: HttpLimits = HttpLimits()
    # Set by the front door on a connection it hands over (see the module docstring).
    front_door_data: bytes = b""
    front_door_deadline: Optional[float] = None
    front_door_release: Optional[Callable[[], None]] = None
    # A flood of connections (or of stalled readers) must not become a flood of log lines.
    _refusal_log = IntervalGate(REFUSAL_LOG_INTERVAL_SECONDS)
    # Stalled readers can be many; their closes are logged at most once per interval, counted.
    _send_timeout_log = IntervalGate()
    _shutdown_close_log = IntervalGate()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Same 16 KiB as uvicorn's default incomplete-head limit, enforced on complete heads too.
        self.conn = HeadLimitedConnection()
        self._raw: Optional[asyncio.Transport] = None
        self._head_timer: Optional[asyncio.TimerHandle] = None
        self._linger_timer: Optional[asyncio.TimerHandle] = None
        self._send_deadline: Optional[SendDeadline] = None
        self.lingering = False
        self._lost = False
        self._ignore_input = False
        self._half_closed = False  # the client shut down its sending side; what it sent is still answered

    # ------------------------------------------------------------------ connection life

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Wrap the transport, refuse with a 503 a connection over the cap (unless the front door handed it
        over), arm the head deadline and replay the bytes the front door already read."""
        # The front door has counted a connection it hands over against its own limits.
        over_cap = self.front_door_release is None and len(self.connections) >= self.limits.max_connections
        self._raw = transport
        super().connection_made(GuardedTransport(transport, self))  # type: ignore[arg-type]
        if over_cap:
            self._log_refusal()
            message = (f"The server already holds its maximum of {self.limits.max_connections} connections; "
                       "retry later")
            self._refuse(raw_json_response(503, message, SERVICE_UNAVAILABLE, "too_many_connections"))
            return
        self._arm_head_timer(self.front_door_deadline)
        if self.front_door_data:
            data, self.front_door_data = self.front_door_data, b""
            self.data_received(data)

    def data_received(self, data: bytes) -> None:
        """Feed h11 (not while lingering or ignoring input); the head deadline runs while a request head is due."""
        if self.lingering or self._ignore_input:
            return  # input after a final answer, or after a request that said close, is not read
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            self._arm_head_timer()
        else:
            self._cancel_head_timer()

    def eof_received(self) -> Optional[bool]:
        """The client's EOF: keep the connection open while the answer to a GET, HEAD or OPTIONS request
        read before it is owed, else close it (a running generation is then aborted as for a client gone)."""
        if self.lingering and self._raw is not None:
            self._raw.close()
        elif self._answers_after_half_close():
            # Kept open for the answer, closed after it (on_response_complete): see the module docstring.
            self._half_closed = True
            return True
        # Anything else (a generation request, a request still arriving) is a client gone:
        # asyncio closes the connection, and a running generation is aborted.
        return super().eof_received()

    def _answers_after_half_close(self) -> bool:
        cycle = self.cycle
        return (cycle is not None and not cycle.response_complete and not cycle.disconnected
                and not cycle.more_body and cycle.scope["method"] in HALF_CLOSE_ANSWERED_METHODS)

    def on_response_complete(self) -> None:
        """After an answer: re-arm the head deadline for a pipelined head still arriving, and close a
        half-closed connection that owes no more answers."""
        super().on_response_complete()
        # A pipelined request whose head is still incomplete gets the same deadline, and the idle
        # keep-alive timer uvicorn just armed no longer applies: the connection is not idle, and
        # that timer would close it without the 408 (it is shorter than the head deadline).
        if not self.lingering and self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._unset_keepalive_if_required()
            self._arm_head_timer()
        if self._half_closed and not self._answers_after_half_close() and self._raw is not None:
            # Nothing more comes: the requests read before the EOF are answered, up to one that
            # generates (a client gone, as that EOF would have made it), then the connection closes.
            self._raw.close()

    def client_lost_on_write(self) -> None:
        """A write found the transport closing (a send failed, or it was closed): the client is
        gone for this response.  The cycle learns it now, as ``connection_lost`` will tell it on
        the loop's next turn: its sends stop writing and its ``receive`` answers ``http.disconnect``."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.disconnected:
            cycle.disconnected = True
            cycle.message_event.set()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        """Release the front door's count, cancel this connection's timers, then let uvicorn clean up."""
        self._lost = True
        if self.front_door_release is not None:
            self.front_door_release()
        self._cancel_head_timer()
        if self._send_deadline is not None:
            self._send_deadline.stop()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    def _should_upgrade(self) -> bool:
        # The server has no WebSocket (or HTTP/2) routes, so a request asking to upgrade is served
        # as the plain HTTP request it also is (a JSON 404 on every path).  uvicorn's upgrade would
        # hand the socket to another protocol, whose close this one never hears of: the front door
        # would count the connection for good, and a few thousand such requests locked everyone out.
        return False

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown; a lingering connection closes at once, and an answer its client is not
        reading is cut before uvicorn would cancel the request."""
        if self.lingering:
            self.close_transport(force=True)
            return
        super().shutdown()
        # uvicorn lets an answer still being sent finish for its graceful-shutdown timeout, then
        # cancels the request's task: the stream stopped mid-event and the log got an "Exception
        # in ASGI application" traceback for a routine stop.  Closing the connection a little
        # earlier ends the request as a client disconnect, which it handles.
        grace = self.config.timeout_graceful_shutdown
        if grace is not None and self._raw is not None and self._answer_unsent():
            last = self.loop.time() + max(grace * SHUTDOWN_CLOSE_SHARE, grace - SHUTDOWN_CANCEL_MARGIN_S)
            self.loop.call_later(grace * SHUTDOWN_CLOSE_SHARE, self._close_unsent_answer, last)

    def _answer_unsent(self) -> bool:
        return not self._lost and self.cycle is not None and not self.cycle.response_complete

    def _close_unsent_answer(self, last: float) -> None:
        if not self._answer_unsent() or self._raw is None:
            return
        if not self.flow.write_paused and self.loop.time() < last:
            # The client is taking the answer: let it go on until just before uvicorn's cancel.
            self.loop.call_later(SHUTDOWN_RECHECK_S, self._close_unsent_answer, last)
            return
        held = self._shutdown_close_log.passes(self.loop.time())
        if held is not None:
            logger.warning("closed a connection from %s whose answer was still being sent when the server stopped "
                           "(its client had not read it in time); the answer ends where it stood%s",
                           self.client[0] if self.client else "?",
                           f" ({held} more since the last such line)" if held else "")
        # close() would wait for the buffer to drain, which is what this client does not let happen.
        self._raw.abort()

    def send_400_response(self, msg: str) -> None:
        """Answer an unparsable request with a JSON 400 (505 for an HTTP version other than 1.x), then linger
        before closing; bytes after a request that said close get no answer and are no longer read."""
        if self.conn.data_after_close:
            # The request before them is complete and its answer is owed: a 400 here went out in
            # its place (the generation ran, its client never saw it).  RFC 9112 section 9.6: the
            # server does not read past a request that said close.
            self._ignore_input = True
            return
        body = json.dumps(invalid_request_body(self.conn.refusal_reason or "malformed")).encode("utf-8")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        self._cancel_head_timer()
        status = self.conn.refusal_status
        reason = http.HTTPStatus(status).phrase.encode("ascii")
        self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers, reason=reason)))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        # The rest of an oversized head may still be arriving: closing with it unread would reset
        # the connection, and the client could lose this answer.
        self._start_linger()

    # ------------------------------------------------------------------ closing

    def close_transport(self, force: bool = False) -> None:
        """Close the connection; linger first when the client may still be sending a request body."""
        raw = self._raw
        if raw is None:
            return
        unread_body = self.conn.their_state is h11.SEND_BODY
        if not force and not self._lost and not self.lingering and unread_body and not raw.is_closing():
            self._start_linger()
            return
        raw.close()

    @classmethod
    def _log_refusal(cls) -> None:
        held = cls._refusal_log.passes(asyncio.get_running_loop().time())
        if held is not None:
            logger.warning("refused %d connection(s) over --http_max_connections (%d)", held + 1,
                           cls.limits.max_connections)

    def _refuse(self, answer: bytes) -> None:
        assert self._raw is not None
        self._cancel_head_timer()
        self._raw.write(answer)
        self._start_linger()

    def _start_linger(self) -> None:
        raw = self._raw
        assert raw is not None
        self.lingering = True
        self._cancel_head_timer()
        if raw.is_closing():
            return
        try:
            if raw.can_write_eof():
                raw.write_eof()
        except OSError:
            # The client is already gone (it read the answer and closed): nothing to linger for.
            raw.close()
            return
        # uvicorn pauses reading while a request body waits to be consumed; the rest must drain.
        raw.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_SECONDS, raw.close)

    # ------------------------------------------------------------------ send deadline

    def pause_writing(self) -> None:
        """uvicorn's flow control, plus the send deadline: watched while the client takes nothing."""
        super().pause_writing()
        if self._send_deadline is None and self._raw is not None:
            self._send_deadline = SendDeadline(self.loop, self._raw, self.limits.send_timeout, self._on_send_timeout)
        if self._send_deadline is not None and not self._lost:
            self._send_deadline.start()

    def resume_writing(self) -> None:
        """uvicorn's flow control; the client took enough of the answer that the deadline stops."""
        super().resume_writing()
        if self._send_deadline is not None:
            self._send_deadline.stop()

    def _on_send_timeout(self) -> None:
        if self._lost or self._raw is None:
            return
        held = self._send_timeout_log.passes(self.loop.time())
        if held is not None:
            logger.info("closed a connection from %s that took none of its answer for %g seconds "
                        "(--http_send_timeout); a request still running on it is aborted%s",
                        self.client[0] if self.client else "?", self.limits.send_timeout,
                        f" ({held} more since the last such line)" if held else "")
        # close() would wait for the buffer to drain, which is what this client does not let happen.
        self._raw.abort()

    # ------------------------------------------------------------------ request-head deadline

    def _arm_head_timer(self, deadline: Optional[float] = None) -> None:
        """Start the head deadline: ``header_timeout`` from now, or at ``deadline`` (``time.monotonic``)."""
        if self._head_timer is None and not self.lingering:
            delay = self.limits.header_timeout if deadline is None else max(0.0, deadline - time.monotonic())
            self._head_timer = self.loop.call_later(delay, self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self.lingering or self._lost or self.conn.their_state is not h11.IDLE:
            return
        message = (f"The request head (request line and headers) did not arrive within "
                   f"{self.limits.header_timeout:g} seconds (--http_header_timeout)")
        self._refuse(raw_json_response(408, message, INVALID_REQUEST, "request_timeout"))


def guarded_protocol_class(limits: HttpLimits) -> type[GuardedH11Protocol]:
    """A :class:`GuardedH11Protocol` subclass bound to ``limits`` (uvicorn instantiates the class itself)."""
    # Each server its own log gates, as its own limits.
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "limits": limits, "_refusal_log": IntervalGate(REFUSAL_LOG_INTERVAL_SECONDS), "_send_timeout_log": IntervalGate(),
        "_shutdown_close_log": IntervalGate()})
