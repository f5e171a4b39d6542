"""Connections the front door has answered, read until their client closes so the answer arrives.

A client refused at accept (a connection limit) has not sent its request yet; closing its socket
at once would answer what it sends next with a reset, and a reset discards the refusal before
the client reads it (it sees a broken pipe instead of the documented 503).  So an answered socket
is half-closed and its input read and discarded until the client closes or ``linger_seconds``
pass, on the front door's own selector.  At most ``capacity`` sockets linger: a flood of refusals
must not hold a descriptor each, so beyond it they are closed at once as before.
"""

from __future__ import annotations

import selectors
import socket
import time
from typing import Dict, List, Tuple

_READ_BYTES = 65536
LINGER_KEY = "linger"  # the selector data of a lingering socket


class LingeringSockets:
    """Answered sockets on ``selector`` (registered with data :data:`LINGER_KEY`), each until EOF or its deadline."""

    def __init__(self, selector: selectors.BaseSelector, linger_seconds: float, capacity: int) -> None:
        self._selector = selector
        self._seconds = linger_seconds
        self._capacity = capacity
        self._sockets: Dict[int, Tuple[socket.socket, float]] = {}

    def __len__(self) -> int:
        return len(self._sockets)

    def add(self, sock: socket.socket) -> None:
        """Take over ``sock``, whose answer is sent and write side shut down (closed at once when full)."""
        if len(self._sockets) >= self._capacity:
            sock.close()
            return
        self._sockets[sock.fileno()] = (sock, time.monotonic() + self._seconds)
        self._selector.register(sock, selectors.EVENT_READ, LINGER_KEY)

    def on_readable(self, sock: socket.socket) -> None:
        """Discard what the client sent; close once it has closed."""
        try:
            chunk = sock.recv(_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(sock)

    def deadlines(self) -> List[float]:
        """When each lingering socket is due to be closed (``time.monotonic``)."""
        return [deadline for _, deadline in self._sockets.values()]

    def expire(self, now: float) -> None:
        """Close the sockets whose time is up."""
        for sock in [sock for sock, deadline in self._sockets.values() if deadline <= now]:
            self._close(sock)

    def close_all(self) -> None:
        """Close every lingering socket (the front door stops)."""
        for sock, _ in list(self._sockets.values()):
            sock.close()
        self._sockets.clear()

    def _close(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        del self._sockets[sock.fileno()]
        sock.close()
