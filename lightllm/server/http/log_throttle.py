"""At most one line per interval for log messages a client can repeat at will.

uvicorn logs ``Invalid HTTP request received.`` for every malformed request, without the
client's address: one client sending garbage wrote a line per connection (43 lines from one
batch), while the front door's own refusals are summarised once per 10 s. :class:`LineThrottle`
lets the first such line through, drops the repeats for the interval, and adds their count to
the next line it lets through; the rule is :class:`IntervalGate`, which the front door's accept
pauses (:mod:`lightllm.server.http.transport.accept_pause`) log through too.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, FrozenSet, Optional

# uvicorn's message for a request its HTTP parser refused (each HTTP implementation uses it).
INVALID_REQUEST_LINE = "Invalid HTTP request received."
THROTTLE_INTERVAL_SECONDS = 10.0


class IntervalGate:
    """Lets one event through per interval and counts the events it held back in between."""

    def __init__(self, interval_s: float = THROTTLE_INTERVAL_SECONDS) -> None:
        self._interval_s = interval_s
        self._passed_at: Optional[float] = None
        self._held = 0

    def passes(self, now: float) -> Optional[int]:
        """The number of events held back since the last one passed, when the event at ``now``
        passes (the first always does); None when it is held back."""
        if self._passed_at is not None and now - self._passed_at < self._interval_s:
            self._held += 1
            return None
        held, self._held, self._passed_at = self._held, 0, now
        return held


class LineThrottle(logging.Filter):
    """A logging filter passing each of ``messages`` at most once per ``interval_s`` seconds."""

    def __init__(self, messages: FrozenSet[str], interval_s: float = THROTTLE_INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._gates: Dict[str, IntervalGate] = {message: IntervalGate(interval_s) for message in messages}
        self._clock = clock

    def filter(self, record: logging.LogRecord) -> bool:
        """Pass a throttled message at most once per interval, telling how many were held back since the
        last one passed (the record's text is rewritten); other messages always pass."""
        message = record.getMessage()
        gate = self._gates.get(message)
        if gate is None:
            return True
        held = gate.passes(self._clock())
        if held:
            record.msg, record.args = f"{message} ({held} more since the last such line)", ()
        return held is not None


def throttle_uvicorn_request_errors() -> None:
    """Install the throttle on uvicorn's error logger once per process."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(existing, LineThrottle) for existing in logger.filters):
        logger.addFilter(LineThrottle(frozenset({INVALID_REQUEST_LINE})))
