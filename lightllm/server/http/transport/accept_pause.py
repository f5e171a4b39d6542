"""The front door's pause of ``accept()`` when the process is out of file descriptors.

Accepting again at once would spin on the same error; a short pause lets some connections
close first. Under an exhausted limit the pause repeats five times a second, so it is logged at
most once per :data:`PAUSE_LOG_INTERVAL_SECONDS` with the count of the pauses in between (it
was one line per pause: 60 lines in 12 s).
"""

from __future__ import annotations

import logging

from lightllm.server.http.log_throttle import IntervalGate

PAUSE_SECONDS = 0.2
PAUSE_LOG_INTERVAL_SECONDS = 10.0


class AcceptPause:
    """When accepting resumes (``until``; 0: not paused), and the rate-limited log of pauses."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self.until = 0.0
        self._log_gate = IntervalGate(PAUSE_LOG_INTERVAL_SECONDS)

    def start(self, reason: str, now: float) -> None:
        """Pause accepting from ``now`` (``reason``: the accept error), logging within the rate."""
        earlier = self._log_gate.passes(now)
        if earlier is not None:
            since = f" ({earlier} more pause{'s' if earlier != 1 else ''} since the last such line)" if earlier else ""
            self._logger.warning("cannot accept connections (%s); pausing accept for %gs%s", reason, PAUSE_SECONDS,
                                 since)
        self.until = now + PAUSE_SECONDS

    def ends(self, now: float) -> bool:
        """True once when a pause is over at ``now`` (accepting resumes)."""
        if self.until and now >= self.until:
            self.until = 0.0
            return True
        return False
