"""Waiting for work on behalf of a client whose connection may close meanwhile."""

from __future__ import annotations

import asyncio
from typing import Any, Tuple


async def result_unless_gone(pending: "asyncio.Future[Any]", request: Any, poll_seconds: float) -> Tuple[bool, Any]:
    """``(True, result)`` once ``pending`` is done, or ``(False, None)`` once ``request``'s client has
    disconnected first (``pending`` is then cancelled).

    ``request.is_disconnected()`` is asked every ``poll_seconds`` while waiting: nothing else tells
    a handler waiting on other work that its client left.
    """
    while True:
        done, _ = await asyncio.wait({pending}, timeout=poll_seconds)
        if done:
            return True, pending.result()
        if await request.is_disconnected():
            pending.cancel()
            return False, None
