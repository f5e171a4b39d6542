"""Hang detection: which child processes made no progress for ``--watchdog_timeout`` seconds.

A child that dies is noticed at once (its process handle's sentinel); one that stops making
progress without dying (SIGSTOP, a kernel or a collective that never returns) was not: ``/health``
answered 200 and its requests waited forever.  Every watched child stamps its field of the
heartbeat block (:mod:`lightllm.server.core.objs.shm_heartbeats`) before and right after each
blocking wait of its main loop, so a step (or any work between two waits) may last the whole
timeout; :class:`Watchdog` is the launcher's check of those stamps, called by the child watcher
(:mod:`.child_watch`) every :data:`WATCH_ROUND_SECONDS` once every child reported ready.  A child
whose last beat is older than the timeout is handed to the supervisor, which ends the server as for
a dead child (every request fails with 503 ``server_failed``, exit code 1).

What it cannot tell apart: a step that legitimately runs longer than the timeout (a first-time
kernel compile, a huge prefill forward on a slow CPU) looks like a hang.  Hence the default of 300 s
(SGLang's ``--watchdog-timeout``), far above any step the server is built to run, and
:data:`MIN_WATCHDOG_TIMEOUT_SECONDS`, far above the longest silence of an *idle* watched loop.

When the watcher itself did not run (a round more than :data:`WATCHER_GAP_SECONDS` late: the
launcher paused with Ctrl-Z, a frozen virtual machine, an overloaded host), the children may or may
not have run meanwhile; it cannot know, so that time is not counted against them: it is subtracted
from each child's silence (only the part after the child's last beat).  A hung child is therefore
reported once the watcher itself saw it silent for the timeout, however often the watcher is held
up; the credited gaps are logged, one warning per :data:`GAP_WARNING_INTERVAL_SECONDS` at most.

The check is pure (a clock and a reader of the stamps are injected), so tests drive it with
their own clock.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

log = logging.getLogger("lightllm.api_start")

# SGLang's default: far above a step the server runs (a start-up forward of the whole step budget
# runs before the ranks report ready, so the first-time compiles of the usual shapes are done then).
DEFAULT_WATCHDOG_TIMEOUT_SECONDS = 300.0
# The longest silence of an idle watched loop is a TP follower's: rank 0 sends it a keep-alive every
# 5 s (model_rank/command_channel.py KEEPALIVE_SECONDS), checked within rank 0's 1 s idle wake, so
# its beats can be 6 s apart; the router, the detokenizer and rank 0 beat at least once a second.
# 15 s leaves 2.5 times that for a loaded machine (test/unit/launch/test_watchdog.py holds the two
# together; this module imports no torch, so it cannot import the channel's constant).
MIN_WATCHDOG_TIMEOUT_SECONDS = 15.0
# How often the child watcher checks (launch/child_watch.py waits this long for a child's exit).
WATCH_ROUND_SECONDS = 0.2
# A check that comes more than this after the previous one means the watcher did not run in
# between: everything beyond its one round is credited to the children (see the module docstring).
WATCHER_GAP_SECONDS = 1.0
# The credited gaps are summed into one warning at most this often.
GAP_WARNING_INTERVAL_SECONDS = 30.0


@dataclass(frozen=True)
class Stall:
    """A watched process and how long it has made no progress (seconds, not counting the watcher's gaps)."""

    name: str
    silent_seconds: float


class Watchdog:
    """Which of ``names`` made no progress for ``timeout_seconds``.

    Args:
        timeout_seconds: ``--watchdog_timeout`` (> 0).
        names: the watched processes, in the order of their heartbeat fields.
        last_beat: the monotonic time of field ``i``'s last beat (0.0: none yet).
        clock: the clock the beats are stamped with (``time.monotonic`` in every process).

    A process is judged from :meth:`arm` on (the children's readiness): one that has not beaten
    since counts from then, so the time it took to reach its loop is not held against it.  Its
    silence leaves out the watcher's own gaps (the module docstring).
    """

    def __init__(self, timeout_seconds: float, names: Sequence[str], last_beat: Callable[[int], float],
                 clock: Callable[[], float] = time.monotonic):
        if not timeout_seconds > 0:
            raise ValueError(f"the watchdog's timeout must be > 0 seconds, got {timeout_seconds!r}")
        self.timeout_seconds = timeout_seconds
        self.names = tuple(names)
        self._last_beat = last_beat
        self._clock = clock
        self._armed_at: Optional[float] = None
        self._last_check: Optional[float] = None
        # The spans in which the watcher did not run, oldest first; dropped once every process beat after them.
        self._gaps: List[Tuple[float, float]] = []
        # Credited gaps not logged yet (their count, their sum, the longest), and when the last warning went out.
        self._unlogged = (0, 0.0, 0.0)
        self._warned_at: Optional[float] = None

    def arm(self) -> None:
        """Start judging from now (call once every watched child reported ready)."""
        self._armed_at = self._last_check = self._clock()

    def stalled(self) -> List[Stall]:
        """The processes silent for longer than the timeout, longest silence first; [] before :meth:`arm`."""
        if self._armed_at is None:
            return []
        now = self._clock()
        assert self._last_check is not None
        if now - self._last_check > WATCHER_GAP_SECONDS:
            # The watcher itself did not run: credit everything after the round it should have run.
            start = self._last_check + WATCH_ROUND_SECONDS
            self._gaps.append((start, now))
            count, total, longest = self._unlogged
            self._unlogged = (count + 1, total + now - start, max(longest, now - start))
        self._last_check = now
        self._log_gaps(now)
        stalls = []
        oldest = now
        for slot, name in enumerate(self.names):
            since = max(self._last_beat(slot), self._armed_at)
            oldest = min(oldest, since)
            silent = now - since - self._credit_after(since)
            if silent > self.timeout_seconds:
                stalls.append(Stall(name, silent))
        # A gap that ended before every process's last beat credits nobody any more.
        self._gaps = [gap for gap in self._gaps if gap[1] > oldest]
        return sorted(stalls, key=lambda stall: -stall.silent_seconds)

    def _credit_after(self, since: float) -> float:
        """The watcher's gaps after ``since`` (a gap a process beat in counts from the beat)."""
        return sum(end - max(start, since) for start, end in self._gaps if end > since)

    def _log_gaps(self, now: float) -> None:
        count, total, longest = self._unlogged
        if count == 0 or (self._warned_at is not None and now - self._warned_at < GAP_WARNING_INTERVAL_SECONDS):
            return
        log.warning("the launcher's child watcher did not run for %.1f s (%d gap%s, the longest %.1f s: a paused "
                    "server or an overloaded machine); that time is not counted toward --watchdog_timeout %g "
                    "(one such line per %g s at most)", total, count, "" if count == 1 else "s", longest,
                    self.timeout_seconds, GAP_WARNING_INTERVAL_SECONDS)
        self._unlogged = (0, 0.0, 0.0)
        self._warned_at = now


def describe_stalls(stalls: Sequence[Stall], timeout_seconds: float) -> str:
    """``model_rank1 made no progress for 16 s (--watchdog_timeout 15)``; several: each with its silence."""
    if not stalls:
        raise ValueError("no stall to describe")
    flag = f"(--watchdog_timeout {timeout_seconds:g})"
    if len(stalls) == 1:
        return f"{stalls[0].name} made no progress for {stalls[0].silent_seconds:.0f} s {flag}"
    named = [f"{stall.name} ({stall.silent_seconds:.0f} s)" for stall in stalls]
    return f"{', '.join(named[:-1])} and {named[-1]} made no progress {flag}"
