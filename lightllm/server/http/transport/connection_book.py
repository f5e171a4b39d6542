"""The front door's ledger of connection places: per client, being read, served by the loop.

Kept apart from the thread and selector that move bytes (:mod:`.front_door`) because it is
the rule operators configure (``--http_max_connections``, ``--http_max_connections_per_client``
and the reserve beyond the cap) and both the front door's thread and the event loop update it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, Optional, Tuple

from lightllm.server.http.server_options import HttpLimits

# The front door's logger, not this module's: the refused-connection lines are the front door's
# behaviour, logged under its name before this ledger moved out of front_door.py, so a logging
# config or filter that names the front door still catches them.
logger = logging.getLogger("lightllm.server.http.transport.front_door")

_LOG_INTERVAL_SECONDS = 10.0

# (error code, message) of a refused connection.
Refusal = Tuple[str, str]


class ConnectionBook:
    """Places held per client address, by connections whose head is being read (in the normal
    share or the reserve) and by connections the loop serves. Thread-safe.

    The reserve has two budgets of ``reserve_connections`` places each: heads being read (so a
    probe is always read and answered, however many connections the reserve serves) and
    connections served from it, which keep their place until they close (counting reserve places
    only while heads were read let keyed clients open connections without end: 60 held on a cap
    of 20 and a reserve of 16).
    """

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._by_peer: Dict[str, int] = {}
        self._served = 0  # entered the normal share, handed to the loop and not closed yet
        self._served_reserve = 0  # the same, from the reserve
        self._pending_normal = 0
        self._pending_reserve = 0
        self._refusals: Dict[str, int] = {}
        self._last_log = float("-inf")

    def admit(self, peer: str) -> Tuple[bool, Optional[Refusal]]:
        """Take a place for a new connection from ``peer``: ``(in the reserve, None)``, or the refusal."""
        limits = self.limits
        with self._lock:
            if self._by_peer.get(peer, 0) >= limits.max_connections_per_client:
                return False, self._refused(
                    "too_many_client_connections",
                    f"This client already holds {limits.max_connections_per_client} connections "
                    "(--http_max_connections_per_client); close some or retry later")
            if self._served + self._pending_normal < limits.max_connections:
                self._pending_normal += 1
                reserve = False
            elif self._pending_reserve < limits.reserve_connections:
                self._pending_reserve += 1
                reserve = True
            else:
                return False, self._refused(
                    "too_many_connections",
                    f"The server already holds its maximum of {limits.max_connections} connections "
                    "(--http_max_connections); retry later")
            self._by_peer[peer] = self._by_peer.get(peer, 0) + 1
        return reserve, None

    def reserve_can_serve(self) -> bool:
        """Whether a reserve connection with a key may be served: fewer than the reserve's size are."""
        with self._lock:
            return self._served_reserve < self.limits.reserve_connections

    def leave_front_door(self, peer: str, reserve: bool, served: bool) -> None:
        """A connection whose head was being read leaves: handed to the loop (``served``) or closed."""
        with self._lock:
            if reserve:
                self._pending_reserve -= 1
            else:
                self._pending_normal -= 1
            if served and reserve:
                self._served_reserve += 1
            elif served:
                self._served += 1
            else:
                self._release_peer(peer)

    def release(self, peer: str, reserve: bool) -> None:
        """A connection served by the loop closed (``reserve``: it entered through the reserve)."""
        with self._lock:
            if reserve:
                self._served_reserve -= 1
            else:
                self._served -= 1
            self._release_peer(peer)

    def count_refusal(self, code: str) -> None:
        """Count a refusal decided elsewhere (a reserve connection without a key)."""
        with self._lock:
            self._refusals[code] = self._refusals.get(code, 0) + 1

    def next_log_due(self) -> Optional[float]:
        """When (``time.monotonic``) :meth:`log_refusals` has a line to write, or None with no refusal counted.

        The front door's thread waits on its selector until then: with no traffic after a burst
        of refusals nothing else would wake it to write the line.
        """
        with self._lock:
            return self._last_log + _LOG_INTERVAL_SECONDS if self._refusals else None

    def log_refusals(self) -> None:
        """At most one warning line per interval: a flood of connections must not flood the log."""
        now = time.monotonic()
        with self._lock:
            if not self._refusals or now - self._last_log < _LOG_INTERVAL_SECONDS:
                return
            counts = ", ".join(f"{count} {code}" for code, count in sorted(self._refusals.items()))
            self._refusals.clear()
            self._last_log = now
        logger.warning("refused connections: %s (--http_max_connections %d, --http_max_connections_per_client %d)",
                       counts, self.limits.max_connections, self.limits.max_connections_per_client)

    def _refused(self, code: str, message: str) -> Refusal:
        self._refusals[code] = self._refusals.get(code, 0) + 1
        return code, message

    def _release_peer(self, peer: str) -> None:
        left = self._by_peer.get(peer, 1) - 1
        if left > 0:
            self._by_peer[peer] = left
        else:
            self._by_peer.pop(peer, None)
