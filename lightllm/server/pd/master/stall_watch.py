"""How long the PD master itself did not run, told from the gaps between its expiry checks.

A node is dropped when the master heard no heartbeat from it for ``interval x count`` seconds.
A master whose event loop does not run (a blocked loop, or a process starved of CPU on a loaded
machine) hears nothing either, though the nodes keep sending: their heartbeats wait unread in its
sockets.  When the loop resumes, its timers can run before those heartbeats are read, and a
stall of a few seconds dropped healthy nodes and failed every request in flight on them.  The
expiry sweeper checks every ``period_s`` on a running loop, so a longer gap between two checks
is time the master did not run; :class:`MasterStallWatch` measures it so the registry can leave
it out of the nodes' silence.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

logger = logging.getLogger(__name__)

# A check later than its period by at most this much is ordinary scheduling jitter, not a stall.
STALL_MIN_S = 0.5
# At most one warning this often: on a machine short of CPU for minutes a late sweep comes every
# few seconds, and one line per sweep would bury the log; the lines in between are summed up.
WARN_EVERY_S = 30.0


class MasterStallWatch:
    """Measures the master's own stalls from the gaps between expiry checks (see the module docstring).

    Args:
        period_s: the longest gap between two checks on a running loop (the sweeper's period).
        clock: the registry's clock.
    """

    def __init__(self, period_s: float, clock: Callable[[], float]) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s!r}")
        self.period_s = period_s
        self._clock = clock
        self._last_check = clock()
        self.stalled_s = 0.0  # every stall measured so far (lightllm_pd_master_stalled_seconds_total)
        self._last_warned: Optional[float] = None
        self._unwarned = (0, 0.0)  # stalls and seconds since the last warning

    def stall_before(self, now: float) -> float:
        """Seconds the master did not run since the last check (0.0 for none); ``now`` is this check."""
        stalled = now - self._last_check - self.period_s
        self._last_check = now
        if stalled <= STALL_MIN_S:
            self._flush_unwarned(now)
            return 0.0
        self.stalled_s += stalled
        count, seconds = self._unwarned[0] + 1, self._unwarned[1] + stalled
        if self._last_warned is not None and now - self._last_warned < WARN_EVERY_S:
            self._unwarned = (count, seconds)
            return stalled
        self._last_warned, self._unwarned = now, (0, 0.0)
        more = f" ({count} stalls, {seconds:.1f} s in all, since the last such line)" if count > 1 else ""
        logger.warning("PD master: its event loop did not run for %.1f s beyond its %.2g s expiry sweep (blocked, "
                       "or the process got no CPU)%s; the nodes' heartbeats of that time wait unread, so it does "
                       "not count against them", stalled, self.period_s, more)
        return stalled

    def _flush_unwarned(self, now: float) -> None:
        """Log the stalls held back since the last warning once its interval passed (they may be the last)."""
        count, seconds = self._unwarned
        if not count or self._last_warned is None or now - self._last_warned < WARN_EVERY_S:
            return
        self._last_warned, self._unwarned = now, (0, 0.0)
        logger.warning("PD master: its event loop stalled %d more time(s), %.1f s in all, since the last such line "
                       "(blocked, or the process got no CPU); not counted against the nodes", count, seconds)
