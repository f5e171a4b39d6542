"""Whether a request manager lets a new generation start: open, draining, or closed.

Draining (a stop signal): requests that arrived before it may still start their generations
(one being tokenized when the signal came is still in flight, see
:mod:`lightllm.server.http.middleware.in_flight`; the gate reads the arrival through
:mod:`lightllm.server.admission_scope`), and so may a request the caller marks exempt (a PD node's
continuation segment of a generation the cluster admitted earlier); later ones get the refusal.
Closed (a failure, or the graceful period spent): nothing starts any more, exempt or not.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from lightllm.server.admission_scope import admitted_before
from lightllm.server.manager_errors import ServerUnavailableError


class RequestGate:
    """The refusal new requests get, and which requests it spares."""

    def __init__(self) -> None:
        self.refusal: Optional[ServerUnavailableError] = None
        # Requests admitted before this moment (time.monotonic()) may still start.
        self._admitted_until = float("-inf")
        self._closed = False

    @property
    def open(self) -> bool:
        """True while new requests are taken."""
        return self.refusal is None

    def drain(self, message: str, code: str) -> None:
        """Refuse requests that arrive from now on with a 503 carrying ``message``."""
        if self.refusal is None:
            self.refusal = ServerUnavailableError(message, code)
            self._admitted_until = time.monotonic()

    def close(self, message: str, code: str) -> None:
        """Refuse every generation from now on, also of requests admitted earlier."""
        self.drain(message, code)
        self._admitted_until = float("-inf")
        self._closed = True

    def check(self, request: Any, drain_exempt: bool = False) -> None:
        """Raise the refusal unless the gate is open or ``request`` (the client's connection) arrived before it.

        ``drain_exempt``: the request may start while the gate drains (not once it is closed).
        """
        if self.refusal is None or (drain_exempt and not self._closed):
            return
        if not admitted_before(request, self._admitted_until):
            raise self.refusal
