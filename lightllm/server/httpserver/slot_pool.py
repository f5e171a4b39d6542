"""The HTTP process's pools of free shared-memory slots: request records and top-logprob rows."""

from __future__ import annotations

import asyncio
import time
from typing import List, Optional, Tuple

from lightllm.server.manager_errors import ServerBusyError, ServerUnavailableError


class SlotPool:
    """Free slot indexes; a request waits here (bounded) until one is free or the server fails.

    Only the HTTP process allocates and releases slots, all on its event loop.
    """

    def __init__(self, slot_num: int, wait_seconds: float, what: str = "shared-memory request slots"):
        # Popped from the end: slot 0 is handed out first.
        self._free: List[int] = list(range(slot_num - 1, -1, -1))
        self._slot_num = slot_num
        self._what = what  # named in the busy answer
        self._wait_seconds = wait_seconds
        self._changed: Optional[asyncio.Condition] = None
        # Set by fail(): every waiting and later take() raises it.
        self._failure: Optional[ServerUnavailableError] = None
        self._waiting = 0  # take() calls waiting for a slot now

    def start(self) -> None:
        """Create the wait condition; called on the event loop that will use the pool."""
        self._changed = asyncio.Condition()

    async def take(self, wait_seconds: Optional[float] = None, bound: Optional[float] = None) -> int:
        """A free slot index; raises ``ServerBusyError`` after the wait bound (``wait_seconds``,
        default the pool's; 0: only a slot free now), or the failure.  ``bound``: the whole wait
        the busy answer names, when ``wait_seconds`` is what is left of a wait shared with another
        pool."""
        wait = self._wait_seconds if wait_seconds is None else wait_seconds
        stated = wait if bound is None else bound
        async with self._changed:
            try:
                if not self._free and self._failure is None:  # wait_for(..., 0) would not even look
                    self._waiting += 1
                    try:
                        await asyncio.wait_for(
                            self._changed.wait_for(lambda: bool(self._free) or self._failure is not None), wait
                        )
                    finally:
                        self._waiting -= 1
            except asyncio.TimeoutError as exc:
                # Names the limit hit, so a busy answer says which one (a PD decode node's KV and
                # request-row limits are named by its model rank).
                waited = f" and none became free within {stated:g} s" if stated > 0 else ""
                raise ServerBusyError(
                    f"server is busy: all {self._slot_num} {self._what} are in use{waited}"
                ) from exc
            if self._failure is not None:
                raise self._failure
            return self._free.pop()

    async def put(self, slot: int) -> None:
        """Return ``slot`` to the pool and wake one waiter."""
        async with self._changed:
            self._free.append(slot)
            self._changed.notify()

    def fail(self, failure: ServerUnavailableError) -> int:
        """Make every waiting and later :meth:`take` raise ``failure``; returns how many were waiting."""
        self._failure = failure
        if self._changed is not None:
            asyncio.ensure_future(self._wake_all())
        return self._waiting

    async def _wake_all(self) -> None:
        async with self._changed:
            self._changed.notify_all()


class RequestSlots:
    """A request slot for every request, plus a top-logprob slot for those that ask for top logprobs.

    Only requests whose ``logprobs`` or ``prompt_logprobs`` is above 0 touch the top-logprob pool
    (``--top_logprobs_slots`` rows, fewer than request slots since each costs 160 bytes per
    position).  A request takes its top-logprob slot first and then its request slot, both within
    one wait bound, so a request waiting for a top-logprob slot never holds a request slot that a
    request without top logprobs could use; both are given back together.
    """

    def __init__(self, slot_num: int, top_slot_num: int, wait_seconds: float):
        self.slot_num = slot_num
        self.top_slot_num = top_slot_num
        self._requests = SlotPool(slot_num, wait_seconds)
        self._tops = SlotPool(top_slot_num, wait_seconds, "shared-memory top-logprob slots (--top_logprobs_slots)")
        self._top_slot_num = top_slot_num
        self._wait_seconds = wait_seconds
        self._top_of: dict[int, int] = {}  # request slot -> the top-logprob slot taken with it

    def start(self) -> None:
        """Create the wait conditions; called on the event loop that will use the pools."""
        self._requests.start()
        self._tops.start()

    async def take(self, wait_seconds: Optional[float] = None, wants_top: bool = False) -> Tuple[int, Optional[int]]:
        """``(request slot, top-logprob slot or None)``; raises ``ServerBusyError`` when they are
        not both free within the wait bound (``wait_seconds``, default the pools'), or the failure."""
        wait = self._wait_seconds if wait_seconds is None else wait_seconds
        if not wants_top:
            return await self._requests.take(wait), None
        if self._top_slot_num == 0:
            # Waiting could not help: this layout has no top-logprob rows at all.
            raise ServerBusyError("server is busy: it keeps no shared-memory top-logprob slots (--top_logprobs_slots)")
        deadline = time.monotonic() + wait
        top = await self._tops.take(wait)
        try:
            slot = await self._requests.take(max(0.0, deadline - time.monotonic()), bound=wait)
        except BaseException:
            await self._tops.put(top)
            raise
        self._top_of[slot] = top
        return slot, top

    async def put(self, slot: int) -> None:
        """Give back ``slot`` and the top-logprob slot taken with it, if any."""
        top = self._top_of.pop(slot, None)
        if top is not None:
            await self._tops.put(top)
        await self._requests.put(slot)

    def fail(self, failure: ServerUnavailableError) -> int:
        """Make every waiting and later :meth:`take` raise ``failure``; returns how many were waiting
        (a request waits for its top-logprob slot, then for its request slot: it is counted once)."""
        return self._requests.fail(failure) + self._tops.fail(failure)
