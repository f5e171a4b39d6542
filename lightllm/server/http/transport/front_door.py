"""The front door: one thread that accepts every HTTP connection before the event loop sees it.

Why a thread: with hundreds of streams the event loop of the HTTP process is busy for up to a
second at a time on a small machine (``/health`` took 1.0 s at most under 400 streams on 2 cores,
up to 4.6 s under 1000), and anything answered on that loop, even in the protocol layer, waits
behind it. The front door runs on its own thread with its own selector, so it takes the
interpreter lock only for the few microseconds a probe needs, and it enforces the connection
limits before a connection costs the loop anything:

* per client (peer IP): a client holding ``--http_max_connections_per_client`` connections gets
  503 ``too_many_client_connections`` on its next one at once, so one client cannot fill the cap;
* the cap: beyond ``--http_max_connections`` (connections being read here plus those served by
  the loop), a connection enters a reserve of ``reserve_connections`` places where its request
  head is read; a health probe is answered and a request with a valid API key (or the PD cluster
  key on ``/pd/``) is served; anything else gets 503 ``too_many_connections``. So a full server
  still answers probes and authenticated clients;
* a fresh connection whose request is ``GET``/``HEAD`` on a health path
  (:data:`~lightllm.server.http.service.health.PROBE_PATHS`) is answered here, whatever the loop is
  doing; every other connection is handed to the loop with the bytes read so far, and the
  request-head deadline (``--http_header_timeout``) keeps running from its arrival;
* what it answers is what the app would: a probe head the protocol's parser refuses gets that
  parser's 400, a probe the app would refuse, one followed by a pipelined request or one whose
  head is too large to parse here cheaply (:func:`~.head_check.small_head`) goes to the loop, and every answer to a request carries the CORS headers of the app's CORS layer
  (``allowed_origins``, :mod:`~lightllm.server.http.middleware.cors`);
* an answer the front door gives itself (a probe, a refusal, a 408) is followed by reading and
  discarding the client's input until it closes (:mod:`.lingering_sockets`), so a client refused
  before it sent its request reads the 503 instead of a connection reset;
* while the model loads the port already listens: probes get their answer (live 200, ready 503
  ``server_starting``), other requests 503 ``server_starting`` once their head is complete (or
  their client half-closes before it is; 408 if it does not arrive in time); once uvicorn stops, 503
  ``server_shutting_down``.

What each connection meets is decided by :mod:`.head_triage` from the bytes read so far; this
module moves the bytes. The thread's death by an exception is fatal (:mod:`.fatal_thread`): it
closes its sockets and calls its death handler, before serving a SIGTERM to its own process (the
launcher's start-up cleanup), then the supervisor's ``front_door_died`` (exit 1, as for a dead
child).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from lightllm.server.http.transport.accept_pause import AcceptPause
from lightllm.server.http.transport.connection_book import ConnectionBook
from lightllm.server.http.transport.fatal_thread import FatalThread, stop_own_process
from lightllm.server.http.transport.head_triage import (
    Answer,
    DoorState,
    HandOff,
    HeadTriage,
    admission_refusal,
    request_head_timeout,
)
from lightllm.server.http.service.health import LoopHeartbeat, Readiness, starting_readiness
from lightllm.server.http.transport.lingering_sockets import LINGER_KEY, LingeringSockets
from lightllm.server.http.transport.probe_parsing import raw_response
from lightllm.server.http.transport.protocol import LINGER_SECONDS
from lightllm.server.http.server_options import AuthPolicy, HttpLimits

logger = logging.getLogger(__name__)

_READ_BYTES = 65536
_ACCEPTS_PER_WAKE = 256
_MAX_LINGERING = 256  # answered connections read until their client closes (lingering_sockets.py)


@dataclass
class _Pending:
    """A connection whose request head is being read on the front door's thread."""

    sock: socket.socket
    peer: str
    deadline: float
    reserve: bool
    data: bytearray = field(default_factory=bytearray)


class FrontDoor:
    """Accepts on ``sockets`` in a thread; answers probes and refusals there, hands the rest to a loop.

    Lifecycle: :meth:`start` (start-up, before the model loads), :meth:`serve` (on the serving
    loop, once uvicorn runs), :meth:`stop_serving` (uvicorn shuts down), :meth:`close`.
    """

    def __init__(self, sockets: List[socket.socket], limits: HttpLimits, auth: AuthPolicy,
                 allowed_origins: Sequence[str] = ()) -> None:
        self.sockets = sockets
        self.limits = limits
        # allowed_origins (--allowed_origins): the app's CORS policy, which this thread's answers follow too.
        self._triage = HeadTriage(limits, auth, allowed_origins)
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()  # guards the state, readiness and heartbeat below
        self._book = ConnectionBook(limits)
        self._pending: Dict[int, _Pending] = {}
        self._lingering = LingeringSockets(self._selector, LINGER_SECONDS, _MAX_LINGERING)
        self._state = "starting"
        self._readiness: Readiness = starting_readiness
        self._heartbeat: Optional[LoopHeartbeat] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._make_protocol: Optional[Callable[[], Any]] = None
        self._closed = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._accept_pause = AcceptPause(logger)
        self._worker = FatalThread(self._run, "http-front-door", "HTTP front door thread", logger,
                                   self._closed.is_set, self._abandon)
        self._thread = self._worker.thread

    # ------------------------------------------------------------------ lifecycle (any thread)

    @property
    def port(self) -> int:
        """The port of the first listening socket (the bound one when ``--port 0`` was given)."""
        return self.sockets[0].getsockname()[1]

    @property
    def serving(self) -> bool:
        """True once :meth:`serve` handed it a loop, until :meth:`stop_serving`."""
        return self._state == "serving"

    def start(self) -> None:
        """Start accepting: probes and requests are answered (503 ``server_starting``) from now on."""
        for sock in self.sockets:
            self._selector.register(sock, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._worker.start()

    def serve(self, loop: asyncio.AbstractEventLoop, make_protocol: Callable[[], Any], readiness: Readiness) -> None:
        """Hand requests to ``loop`` from now on, each on a protocol ``make_protocol()`` builds."""
        heartbeat = LoopHeartbeat()
        heartbeat.start(loop)
        with self._lock:
            self._loop, self._make_protocol, self._readiness, self._heartbeat = loop, make_protocol, readiness, heartbeat
            self._state = "serving"

    def stop_serving(self) -> None:
        """The loop takes no more connections: new ones get 503 ``server_shutting_down``."""
        with self._lock:
            self._state = "stopping"

    def close(self) -> None:
        """Stop the thread and close the listening sockets (idempotent)."""
        self._closed.set()
        self._wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)
        for pending in list(self._pending.values()):
            pending.sock.close()
        self._pending.clear()
        self._lingering.close_all()
        for sock in (*self.sockets, self._wake_r, self._wake_w):
            sock.close()

    def set_death_handler(self, handler: Callable[[str], None]) -> None:
        """Call ``handler(cause)`` when the thread dies of an exception; at once if it already has."""
        self._worker.set_death_handler(handler)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    # ------------------------------------------------------------------ the thread

    def _abandon(self) -> None:
        """The thread died: close the listening sockets and the connections held here (refused, not hanging)."""
        self._closed.set()
        for sock in (*self.sockets, *(pending.sock for pending in self._pending.values())):
            sock.close()  # never raises for an open or closed socket
        self._pending.clear()
        self._lingering.close_all()

    def _run(self) -> None:
        while not self._closed.is_set():
            now = time.monotonic()
            deadlines = [pending.deadline for pending in self._pending.values()]
            deadlines.extend(self._lingering.deadlines())
            if self._accept_pause.until:
                deadlines.append(self._accept_pause.until)
            log_due = self._book.next_log_due()
            if log_due is not None:
                deadlines.append(log_due)
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            for key, _ in self._selector.select(timeout):
                if key.data == "listen":
                    self._accept(key.fileobj)  # type: ignore[arg-type]
                elif key.data == "wake":
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                elif key.data == LINGER_KEY:
                    self._lingering.on_readable(key.fileobj)  # type: ignore[arg-type]
                elif key.fileobj.fileno() in self._pending:  # type: ignore[union-attr]
                    self._on_readable(self._pending[key.fileobj.fileno()])  # type: ignore[union-attr]
            self._expire(time.monotonic())
            self._book.log_refusals()

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accepting(exc)
                return
            self._admit(sock, str(address[0]))

    def _pause_accepting(self, exc: OSError) -> None:
        for sock in self.sockets:
            self._selector.unregister(sock)
        self._accept_pause.start(exc.strerror or str(exc), time.monotonic())

    def _admit(self, sock: socket.socket, peer: str) -> None:
        sock.setblocking(False)
        reserve, refusal = self._book.admit(peer)
        if refusal is not None:
            self._answer_and_close(sock, admission_refusal(refusal))
            return
        pending = _Pending(sock, peer, time.monotonic() + self.limits.header_timeout, reserve)
        self._pending[sock.fileno()] = pending
        self._selector.register(sock, selectors.EVENT_READ, "client")

    def _on_readable(self, pending: _Pending) -> None:
        try:
            chunk = pending.sock.recv(_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            # The client sent all it will: a partial head gets the 503 while starting or stopping.
            answer = self._triage.at_eof(bytes(pending.data), pending.reserve, self._door_state)
            if answer is None:
                self._drop(pending)
            else:
                self._finish(pending, answer)
            return
        pending.data += chunk
        data = bytes(pending.data)
        verdict = self._triage.verdict(data, pending.reserve, self._door_state, self._book.reserve_can_serve)
        if isinstance(verdict, Answer):
            if verdict.refusal is not None:
                self._book.count_refusal(verdict.refusal)
            self._finish(pending, verdict)
        elif isinstance(verdict, HandOff):
            self._hand_off(pending, data)
        # a Wait: the next read decides

    def _door_state(self) -> DoorState:
        with self._lock:
            return DoorState(self._state, self._readiness, self._heartbeat)

    def _expire(self, now: float) -> None:
        if self._accept_pause.ends(now):
            for sock in self.sockets:
                self._selector.register(sock, selectors.EVENT_READ, "listen")
        self._lingering.expire(now)
        for pending in [p for p in self._pending.values() if p.deadline <= now]:
            self._finish(pending, request_head_timeout(self.limits.header_timeout))

    # ------------------------------------------------------------------ leaving the thread

    def _forget(self, pending: _Pending, served: bool) -> None:
        self._selector.unregister(pending.sock)
        del self._pending[pending.sock.fileno()]
        self._book.leave_front_door(pending.peer, pending.reserve, served)

    def _drop(self, pending: _Pending) -> None:
        self._forget(pending, served=False)
        pending.sock.close()

    def _finish(self, pending: _Pending, answer: Answer) -> None:
        self._forget(pending, served=False)
        self._answer_and_close(pending.sock, answer)

    def _answer_and_close(self, sock: socket.socket, answer: Answer) -> None:
        try:
            # Unread input would make close() reset the connection before the client reads the answer.
            while sock.recv(_READ_BYTES):
                pass
        except OSError:
            pass
        try:
            # Small: fits an empty socket buffer.
            sock.send(raw_response(answer.status, answer.body, answer.head_only, answer.headers))
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        self._lingering.add(sock)  # read until the client closes, so it reads the answer

    def _hand_off(self, pending: _Pending, data: bytes) -> None:
        self._forget(pending, served=True)
        loop = self._loop
        try:
            assert loop is not None
            loop.call_soon_threadsafe(self._adopt, pending.sock, pending.peer, data, pending.deadline, pending.reserve)
        except (AssertionError, RuntimeError):  # the loop is closed
            self.release(pending.peer, pending.reserve)
            pending.sock.close()

    def _adopt(self, sock: socket.socket, peer: str, data: bytes, deadline: float, reserve: bool) -> None:
        """On the loop: serve ``sock`` with a fresh protocol fed ``data`` first (``reserve``: its place)."""
        assert self._loop is not None and self._make_protocol is not None
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.release(peer, reserve)

        def protocol() -> Any:
            proto = self._make_protocol()  # type: ignore[misc]
            proto.front_door_data = data
            proto.front_door_deadline = deadline
            proto.front_door_release = release
            return proto

        async def connect() -> None:
            try:
                await self._loop.connect_accepted_socket(protocol, sock)  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - the connection is lost, the server goes on
                logger.exception("could not serve an accepted connection")
                release()
                sock.close()

        asyncio.ensure_future(connect())

    def release(self, peer: str, reserve: bool) -> None:
        """A connection served by the loop closed (called on the loop's thread)."""
        self._book.release(peer, reserve)


def open_front_door(args: Any) -> FrontDoor:
    """Bind ``--host:--port`` and start answering there (raises ``PortUnavailableError``, one line).

    Called first thing at start-up, before the model loads, so a taken port fails within a second.
    """
    from lightllm.server.http.server_options import HttpServerOptions, ensure_file_descriptors
    from lightllm.server.http.transport.listen_sockets import bind_listeners

    options = HttpServerOptions.from_args(args)
    ensure_file_descriptors(options.limits)
    door = FrontDoor(bind_listeners(args.host, args.port), options.limits, options.auth, options.allowed_origins)
    # Until the supervisor takes over (SupervisedServer), a dead front door ends the start-up the
    # way a stop signal does, with the launcher's cleanup; the model may take minutes to load.
    door.set_death_handler(stop_own_process)
    door.start()
    return door
