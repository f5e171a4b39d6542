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

When the watcher itself did not run (more than :data:`WATCHER_GAP_SECONDS` between two of its
checks, which are :data:`WATCH_ROUND_SECONDS` apart normally: the launcher paused with Ctrl-Z, a
frozen virtual machine, an overloaded host), the children may or may not have run meanwhile; it
cannot know, so the part of the interval beyond :data:`WATCHER_GAP_SECONDS` is not counted against
them: it is subtracted from each child's silence (only the part after the child's last beat).  At
most :data:`WATCHER_GAP_SECONDS` of each interval between checks is counted, so a hung child is
reported however often the watcher is held up, and with the checks a steady ``T`` seconds apart
(``T`` over 1 s) at most about ``timeout * T / 1 s`` after its last beat (1.1 times the timeout
for checks 1.1 s apart); no later for checks up to 1 s apart.  The report gives the real silence
and how much of it was not counted; the credited time is logged, one warning per
:data:`GAP_WARNING_INTERVAL_SECONDS` at most (and at once when a stall is reported).

The check is pure (a clock and a reader of the stamps are injected), so tests drive it with
their own clock.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

log = logging.getLogger(__name__)

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
# between: the part of the interval beyond this is credited to the children (the module docstring).
WATCHER_GAP_SECONDS = 1.0
# The credited gaps are summed into one warning at most this often.
GAP_WARNING_INTERVAL_SECONDS = 30.0
# Credited time that sums to less than this between two warnings is not warned about: rounds a
# few ms late are a loaded machine's scheduling noise (a 2-core VM logged "0.0 s beyond 1 s"), and
# half a second is under 4% of the shortest --watchdog_timeout (15 s). Summed, not per gap, so a
# watcher that is steadily a little late (and credits a large share of the time) is still told.
GAP_WARNING_MIN_SECONDS = 0.5


@dataclass(frozen=True)
class Stall:
    """A watched process that made no progress for longer than the timeout.

    ``silent_seconds`` is the real time since its last beat (or the arming); ``credited_seconds``
    the part of it not counted, because the watcher itself did not run (the module docstring).
    """

    name: str
    silent_seconds: float
    credited_seconds: float = 0.0


class Watchdog:
    """Which of ``names`` made no progress for ``timeout_seconds``.

    Args:
        timeout_seconds: ``--watchdog_timeout`` (> 0).
        names: the watched processes, in the order of their heartbeat fields.
        last_beat: the monotonic time of field ``i``'s last beat (0.0: none yet).
        clock: the clock the beats are stamped with (``time.monotonic`` in every process).

    A process is judged from :meth:`arm` on (the children's readiness): one that has not beaten
    since counts from then, so the time it took to reach its loop is not held against it.  Its
    silence leaves out the watcher's own gaps (the module docstring): the credited seconds are one
    running total, and each process's share is the total now less the total at its last beat, so a
    check costs the same however long a process has been silent.
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
        # Every second credited since the arming (only grows), and for each process the time of the
        # last beat seen and the part of the total that came before it (credits nothing to it).
        self._credited = 0.0
        self._since: List[float] = []
        self._credited_before: List[float] = []
        # Credited gaps not logged yet (their count, their sum, the longest), and when the last warning went out.
        self._unlogged = (0, 0.0, 0.0)
        self._gaps_since = self._clock()  # when the gaps summed in _unlogged began to be summed
        self._warned_at: Optional[float] = None

    def arm(self) -> None:
        """Start judging from now (call once every watched child reported ready)."""
        self._armed_at = self._last_check = self._clock()
        self._credited = 0.0
        self._since = [self._armed_at] * len(self.names)
        self._credited_before = [0.0] * len(self.names)

    def stalled(self) -> List[Stall]:
        """The processes silent for longer than the timeout, longest silence first; [] before :meth:`arm`."""
        if self._armed_at is None:
            return []
        now = self._clock()
        assert self._last_check is not None
        # The watcher did not run for the part of the interval beyond the threshold: credit that part,
        # taken as the end of the interval (from ``gap_start`` to now).
        gap = max(0.0, now - self._last_check - WATCHER_GAP_SECONDS)
        gap_start = now - gap
        if self._unlogged[1] < GAP_WARNING_MIN_SECONDS and now - self._gaps_since >= GAP_WARNING_INTERVAL_SECONDS:
            # Scattered small gaps too few to warn about in one interval are forgotten, so that
            # hours apart they do not add up to a warning about nothing.
            self._unlogged, self._gaps_since = (0, 0.0, 0.0), now
        if gap > 0:
            count, total, longest = self._unlogged
            self._unlogged = (count + 1, total + gap, max(longest, gap))
        self._credited += gap
        self._last_check = now
        stalls = []
        for slot, name in enumerate(self.names):
            since = max(self._last_beat(slot), self._armed_at)
            if since != self._since[slot]:
                # A beat since the last check: this check's gap counts for it only after the beat.
                self._since[slot] = since
                self._credited_before[slot] = self._credited - max(0.0, min(gap, now - max(since, gap_start)))
            silent = now - since
            credited = self._credited - self._credited_before[slot]
            if silent - credited > self.timeout_seconds:
                stalls.append(Stall(name, silent, credited))
        # A stall ends the server: the gaps held back for the next warning go out now.
        self._log_gaps(now, force=bool(stalls))
        return sorted(stalls, key=lambda stall: -stall.silent_seconds)

    def _log_gaps(self, now: float, force: bool = False) -> None:
        count, total, longest = self._unlogged
        # The credited time summed, not each gap: a watcher steadily 0.4 s late credits 29% of the
        # wall time, which must be said even though no single gap is large.
        if total < GAP_WARNING_MIN_SECONDS or (not force and self._warned_at is not None
                                               and now - self._warned_at < GAP_WARNING_INTERVAL_SECONDS):
            return
        log.warning("the launcher's child watcher did not run for %.1f s beyond %g s between its checks (%d gap%s, "
                    "the longest %.1f s: a paused server or an overloaded machine); that time is not counted toward "
                    "--watchdog_timeout %g (one such line per %g s at most)", total, WATCHER_GAP_SECONDS, count,
                    "" if count == 1 else "s", longest, self.timeout_seconds, GAP_WARNING_INTERVAL_SECONDS)
        self._unlogged, self._gaps_since = (0, 0.0, 0.0), now
        self._warned_at = now


def _silence(stall: Stall) -> str:
    """``16 s``, or ``1516 s, 1216 s of it not counted: the watcher was held up``."""
    text = f"{stall.silent_seconds:.0f} s"
    if stall.credited_seconds >= 0.5:
        text += f", {stall.credited_seconds:.0f} s of it not counted: the watcher was held up"
    return text


def describe_stalls(stalls: Sequence[Stall], timeout_seconds: float) -> str:
    """``model_rank1 made no progress for 16 s (--watchdog_timeout 15)``; several: each with its silence.

    The silence is the real time since the last beat; the part not counted (the watcher held up) follows it.
    """
    if not stalls:
        raise ValueError("no stall to describe")
    flag = f"(--watchdog_timeout {timeout_seconds:g})"
    if len(stalls) == 1:
        return f"{stalls[0].name} made no progress for {_silence(stalls[0])} {flag}"
    named = [f"{stall.name} ({_silence(stall)})" for stall in stalls]
    return f"{', '.join(named[:-1])} and {named[-1]} made no progress {flag}"
