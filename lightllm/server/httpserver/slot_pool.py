"""The HTTP process's pool of free shared-memory request slots."""

from __future__ import annotations

import asyncio
from typing import List, Optional

from lightllm.server.manager_errors import ServerBusyError, ServerUnavailableError


class SlotPool:
    """Free slot indexes; a request waits here (bounded) until one is free or the server fails.

    Only the HTTP process allocates and releases slots, all on its event loop.
    """

    def __init__(self, slot_num: int, wait_seconds: float):
        # Popped from the end: slot 0 is handed out first.
        self._free: List[int] = list(range(slot_num - 1, -1, -1))
        self._slot_num = slot_num
        self._wait_seconds = wait_seconds
        self._changed: Optional[asyncio.Condition] = None
        # Set by fail(): every waiting and later take() raises it.
        self._failure: Optional[ServerUnavailableError] = None

    def start(self) -> None:
        """Create the wait condition; called on the event loop that will use the pool."""
        self._changed = asyncio.Condition()

    async def take(self, wait_seconds: Optional[float] = None) -> int:
        """A free slot index; raises ``ServerBusyError`` after the wait bound (``wait_seconds``,
        default the pool's; 0: only a slot free now), or the failure."""
        wait = self._wait_seconds if wait_seconds is None else wait_seconds
        async with self._changed:
            try:
                if not self._free and self._failure is None:  # wait_for(..., 0) would not even look
                    await asyncio.wait_for(
                        self._changed.wait_for(lambda: bool(self._free) or self._failure is not None), wait
                    )
            except asyncio.TimeoutError as exc:
                # Names the limit hit, so a busy answer says which one (a PD decode node's KV and
                # request-row limits are named by its model rank).
                waited = f" and none became free within {wait:g} s" if wait > 0 else ""
                raise ServerBusyError(
                    f"server is busy: all {self._slot_num} shared-memory request slots are in use{waited}"
                ) from exc
            if self._failure is not None:
                raise self._failure
            return self._free.pop()

    async def put(self, slot: int) -> None:
        """Return ``slot`` to the pool and wake one waiter."""
        async with self._changed:
            self._free.append(slot)
            self._changed.notify()

    def fail(self, failure: ServerUnavailableError) -> None:
        """Make every waiting and later :meth:`take` raise ``failure``."""
        self._failure = failure
        if self._changed is not None:
            asyncio.ensure_future(self._wake_all())

    async def _wake_all(self) -> None:
        async with self._changed:
            self._changed.notify_all()
