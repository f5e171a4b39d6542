"""What the PD master does when a node answers busy (D cannot reserve KV, P's queue is full).

``LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS`` (read once when the master starts and passed in
as ``timeout_s``; 60 s by default, see ``envs_utils.DEFAULT_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS``)
is how long the master retries, sleeping ``initial_backoff_s``, then twice as long each time up
to ``max_backoff_s`` (never past the deadline): a burst waits for KV as on a normal server.  Once
the time is spent a busy answer becomes a
:class:`~lightllm.server.manager_errors.ServerBusyError` naming the busy role, which the API
answers with HTTP 503 (code ``server_busy``).  With 0 that answer comes at once: for a client
that knows its own latency budget and retries itself.  Each
attempt may pick another node: the ``attempt`` callable is called afresh every time.  Before an
attempt raises :class:`NodeBusy` the segment flow has already tried every other serving node of
the busy role (:mod:`.segment_flow`), so the policy only waits when the whole role is busy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Optional, TypeVar

from lightllm.server.manager_errors import ServerBusyError

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_INITIAL_BACKOFF_S = 0.05
DEFAULT_MAX_BACKOFF_S = 1.0


class NodeBusy(Exception):
    """A node's immediate "cannot take this now" answer; ``role`` is ``prefill`` or ``decode``,
    ``node_id`` the node that answered (empty when not known)."""

    def __init__(self, role: str, message: str, node_id: str = ""):
        super().__init__(message)
        self.role = role
        self.node_id = node_id


class BusyRetryPolicy:
    """Runs an attempt, retrying busy answers only while a positive timeout is not yet spent.

    Args:
        timeout_s: seconds to keep retrying; 0 answers the first busy with ``ServerBusyError``.
        initial_backoff_s / max_backoff_s / multiplier: the backoff between attempts.
        clock / sleep: time source and sleep (tests inject a fake pair).
        on_retry: called with the busy role before every retry (a metrics counter).
    """

    def __init__(
        self,
        timeout_s: float = 0.0,
        initial_backoff_s: float = DEFAULT_INITIAL_BACKOFF_S,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
        multiplier: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_retry: Optional[Callable[[str], None]] = None,
    ) -> None:
        if not timeout_s >= 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s!r}")
        if not 0 < initial_backoff_s <= max_backoff_s:
            raise ValueError(
                "backoff must satisfy 0 < initial_backoff_s <= max_backoff_s, "
                f"got {initial_backoff_s!r}, {max_backoff_s!r}"
            )
        if not multiplier >= 1:
            raise ValueError(f"multiplier must be >= 1, got {multiplier!r}")
        self.timeout_s = float(timeout_s)
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.multiplier = multiplier
        self._clock = clock
        self._sleep = sleep
        self._on_retry = on_retry

    def next_backoff(self, backoff: float) -> float:
        """The wait after one of ``backoff`` (the scheduling simulator replays the same schedule)."""
        return min(backoff * self.multiplier, self.max_backoff_s)

    async def run(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """``await attempt()`` until it does not raise :class:`NodeBusy` or the time is spent.

        Raises ``ServerBusyError`` naming the busy role (and, when retrying, how long it tried).
        """
        deadline = self._clock() + self.timeout_s
        backoff = self.initial_backoff_s
        retries = 0
        while True:
            try:
                return await attempt()
            except NodeBusy as busy:
                remaining = deadline - self._clock()
                if self.timeout_s == 0:
                    raise ServerBusyError(f"The {busy.role} node is busy: {busy}; retry later", busy.role) from None
                if remaining <= 0:
                    raise ServerBusyError(
                        f"The {busy.role} node is still busy after {retries} retries over {self.timeout_s:g} s "
                        f"(LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS): {busy}; retry later",
                        busy.role,
                    ) from None
                retries += 1
                if self._on_retry is not None:
                    self._on_retry(busy.role)
                logger.debug("%s node busy (%s); retry %d in %.3f s", busy.role, busy, retries, min(backoff, remaining))
                await self._sleep(min(backoff, remaining))
                backoff = self.next_backoff(backoff)
