"""Hang detection: which child processes made no progress for ``--watchdog_timeout`` seconds.

A child that dies is noticed at once (its process handle's sentinel); one that stops making
progress without dying (SIGSTOP, a kernel or a collective that never returns) was not: ``/health``
answered 200 and its requests waited forever.  Every watched child stamps its field of the
heartbeat block (:mod:`lightllm.server.core.objs.shm_heartbeats`) each time its main loop completes
an iteration; :class:`Watchdog` is the launcher's check of those stamps, called by the child
watcher (:mod:`.child_watch`) about five times a second once every child reported ready.  A
child whose last beat is older than the timeout is handed to the supervisor, which ends the
server as for a dead child (every request fails with 503 ``server_failed``, exit code 1).

What it cannot tell apart: a step that legitimately runs longer than the timeout (a first-time
kernel compile, a huge prefill forward on a slow CPU) looks like a hang.  Hence the default of 300 s
(SGLang's ``--watchdog-timeout``), far above any step the server is built to run, and
:data:`MIN_WATCHDOG_TIMEOUT_SECONDS`, far above the longest silence of an *idle* watched loop.

The check is pure (a clock and a reader of the stamps are injected), so tests drive it with
their own clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

# SGLang's default: far above a step the server runs (a start-up forward of the whole step budget
# runs before the ranks report ready, so the first-time compiles of the usual shapes are done then).
DEFAULT_WATCHDOG_TIMEOUT_SECONDS = 300.0
# The longest silence of an idle watched loop is a TP follower's: rank 0 sends it a keep-alive every
# 5 s (model_rank/command_channel.py KEEPALIVE_SECONDS), checked within rank 0's 1 s idle wake, so
# its beats can be 6 s apart; the router, the detokenizer and rank 0 beat at least once a second.
# 15 s leaves 2.5 times that for a loaded machine (test/unit/launch/test_watchdog.py holds the two
# together; this module imports no torch, so it cannot import the channel's constant).
MIN_WATCHDOG_TIMEOUT_SECONDS = 15.0
# The child watcher checks every 0.2 s.  If the check itself could not run for this long, the
# launcher was paused with its children (Ctrl-Z and fg, a frozen VM): their silence during the
# pause is not theirs, so the count starts again instead of failing a server that just resumed.
WATCHER_PAUSE_SECONDS = 5.0


@dataclass(frozen=True)
class Stall:
    """A watched process and how long it has made no progress (seconds)."""

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
    since counts from then, so the time it took to reach its loop is not held against it.
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

    def arm(self) -> None:
        """Start judging from now (call once every watched child reported ready)."""
        self._armed_at = self._last_check = self._clock()

    def stalled(self) -> List[Stall]:
        """The processes silent for longer than the timeout, longest silence first; [] before :meth:`arm`."""
        if self._armed_at is None:
            return []
        now = self._clock()
        assert self._last_check is not None
        if now - self._last_check > WATCHER_PAUSE_SECONDS:
            # The watcher itself did not run: the whole server was paused (see WATCHER_PAUSE_SECONDS).
            self._armed_at = now
        self._last_check = now
        stalls = []
        for slot, name in enumerate(self.names):
            silent = now - max(self._last_beat(slot), self._armed_at)
            if silent > self.timeout_seconds:
                stalls.append(Stall(name, silent))
        return sorted(stalls, key=lambda stall: -stall.silent_seconds)


def describe_stalls(stalls: Sequence[Stall], timeout_seconds: float) -> str:
    """``model_rank1 made no progress for 16 s (--watchdog_timeout 15)``; several: each with its silence."""
    if not stalls:
        raise ValueError("no stall to describe")
    flag = f"(--watchdog_timeout {timeout_seconds:g})"
    if len(stalls) == 1:
        return f"{stalls[0].name} made no progress for {stalls[0].silent_seconds:.0f} s {flag}"
    named = [f"{stall.name} ({stall.silent_seconds:.0f} s)" for stall in stalls]
    return f"{', '.join(named[:-1])} and {named[-1]} made no progress {flag}"
