"""A stand-in for the supervisor's request manager: requests in flight that end only when failed."""

from __future__ import annotations

import asyncio
from typing import List, Optional, Tuple


class RequestsInFlight:
    """``count`` requests that end only when :meth:`fail_pending` fails them; records the refusal and failures."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.refused: Optional[str] = None
        self.failed: List[Tuple[str, str, bool]] = []
        self._idle = asyncio.Event()

    def refuse_new_requests(self, message: str, code: str) -> None:
        self.refused = code

    def fail_pending(self, message: str, code: str, backend_alive: bool) -> int:
        self.failed.append((message, code, backend_alive))
        self._idle.set()
        return self.count

    async def wait_until_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True
