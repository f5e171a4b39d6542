"""At most one line per interval for log messages a client can repeat at will.

uvicorn logs ``Invalid HTTP request received.`` for every malformed request, without the
client's address: one client sending garbage wrote a line per connection (43 lines from one
batch), while the front door's own refusals are summarised once per 10 s. :class:`LineThrottle`
lets the first such line through, drops the repeats for the interval, and adds their count to
the next line it lets through.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, FrozenSet, Optional

# uvicorn's message for a request its HTTP parser refused (each HTTP implementation uses it).
INVALID_REQUEST_LINE = "Invalid HTTP request received."
THROTTLE_INTERVAL_SECONDS = 10.0


class LineThrottle(logging.Filter):
    """A logging filter passing each of ``messages`` at most once per ``interval_s`` seconds."""

    def __init__(self, messages: FrozenSet[str], interval_s: float = THROTTLE_INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._messages = messages
        self._interval_s = interval_s
        self._clock = clock
        self._passed_at: Dict[str, float] = {}
        self._dropped: Dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message not in self._messages:
            return True
        now = self._clock()
        last: Optional[float] = self._passed_at.get(message)
        if last is not None and now - last < self._interval_s:
            self._dropped[message] = self._dropped.get(message, 0) + 1
            return False
        dropped = self._dropped.pop(message, 0)
        if dropped:
            record.msg, record.args = f"{message} ({dropped} more since the last such line)", ()
        self._passed_at[message] = now
        return True


def throttle_uvicorn_request_errors() -> None:
    """Install the throttle on uvicorn's error logger once per process."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(existing, LineThrottle) for existing in logger.filters):
        logger.addFilter(LineThrottle(frozenset({INVALID_REQUEST_LINE})))
