"""Waiting on the event loop for a condition that no event signals."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

POLL_SECONDS = 0.05


async def wait_until(condition: Callable[[], bool], timeout: float, poll_seconds: float = POLL_SECONDS) -> bool:
    """Poll ``condition`` every ``poll_seconds`` for up to ``timeout`` seconds; True once it holds.

    Used where the state is a counter or a table that many code paths change (requests in
    flight), so a wake-up event would have to be set on every one of them.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        await asyncio.sleep(min(poll_seconds, remaining))
    return True
