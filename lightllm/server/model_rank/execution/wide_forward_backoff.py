"""Wide forwards stop while they run slower than narrow ones: another program holds the borrowed core.

:class:`~lightllm.server.model_rank.execution.forward_threads.WideForwardRule` prices a wide
forward assuming the core it borrows is shared only with the server's own front end.  When
another program keeps that core busy (a shared host, a neighbour's container, a test suite), each
of the forward's parallel regions waits for the descheduled thread: measured on the small demo
model with one busy-loop process on a 2-core VM, 300 streamed tokens took 16-25 s wide against
1.6-2.3 s narrow (1.0-2.0 s either way on the quiet machine).

So the rank keeps checking, by what the forwards themselves take.  Every ``trial_interval_s`` the
forwards the rule wants wide run narrow ``trial_forwards`` times, and their seconds per second of
estimated work are compared with the last wide forwards': when narrow did better, wide forwards
pause (1 s first, doubling up to 30 s while each trial after a pause finds wide still slower) and
the rank runs narrow; a trial in which wide does at least as well ends the pause.  Seconds per
estimated second, not seconds, because consecutive forwards differ in size; the estimate leaves
out a forward's fixed costs, which both arms pay alike.  Waiting for a CPU alone is no reason to
stop: the front end's own processes make a wide forward wait too, and the rule already priced that
(64 decode rows of the small model still ran a fifth faster wide with 64 streams to serve).
A trial costs ``trial_forwards`` forwards at the narrow count; the next one waits at least
``trial_interval_s`` and long enough that trials take at most ``trial_share`` (2%) of the time
(measured: the medium model's 64-request bursts lost 5-10% of their throughput to trials every
2 s that fell on 200 ms prefill chunks).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Tuple

log = logging.getLogger("lightllm.model_rank")

# States of the check.
_WIDE, _NARROW_TRIAL, _PAUSED, _WIDE_TRIAL = "wide", "narrow trial", "paused", "wide trial"


@dataclass
class WideForwardBackoff:
    """Decides, for each forward the rule wants wide, whether it runs wide; learns from how long they take.

    ``clock`` is injected so that tests drive it; :meth:`record` takes the forward's measured wall
    seconds and its estimated work (seconds at the narrow count, from the rule's cost model).
    """

    clock: Callable[[], float] = time.monotonic
    trial_interval_s: float = 2.0
    trial_forwards: int = 2
    # At most this share of the time runs narrow trials: a trial of long forwards (prefill chunks)
    # waits longer for the next one (two 200 ms chunks: 20 s).
    trial_share: float = 0.02
    first_pause_s: float = 1.0
    longest_pause_s: float = 30.0
    _state: str = field(default=_WIDE, init=False)
    _next_trial: float = field(default=0.0, init=False)
    _paused_until: float = field(default=0.0, init=False)
    _pause_s: float = field(default=0.0, init=False)
    _wide: Deque[Tuple[float, float]] = field(default_factory=deque, init=False)
    _narrow: Deque[Tuple[float, float]] = field(default_factory=deque, init=False)
    _trial: list = field(default_factory=list, init=False)
    _logged_at: float = field(default=float("-inf"), init=False)

    def __post_init__(self) -> None:
        self._wide = deque(maxlen=self.trial_forwards)
        self._narrow = deque(maxlen=self.trial_forwards)
        self._next_trial = self.clock() + self.trial_interval_s

    def runs_wide(self) -> bool:
        """Whether the next forward the rule wants wide runs wide."""
        now = self.clock()
        if self._state == _WIDE and now >= self._next_trial and len(self._wide) == self.trial_forwards:
            self._state, self._trial = _NARROW_TRIAL, []
        elif self._state == _PAUSED and now >= self._paused_until and len(self._narrow) == self.trial_forwards:
            self._state, self._trial = _WIDE_TRIAL, []
        return self._state in (_WIDE, _WIDE_TRIAL)

    def record(self, wide: bool, wall_s: float, estimated_s: float) -> None:
        """A forward the rule wanted wide has run (wide or not) in ``wall_s`` for ``estimated_s`` of work."""
        if estimated_s <= 0 or wall_s < 0:
            return
        sample = (wall_s, estimated_s)
        (self._wide if wide else self._narrow).append(sample)
        if self._state not in (_NARROW_TRIAL, _WIDE_TRIAL):
            return
        self._trial.append(sample)
        if len(self._trial) < self.trial_forwards:
            return
        trial = _rate(self._trial)
        now = self.clock()
        if self._state == _NARROW_TRIAL:
            narrow_wins = trial < _rate(self._wide_before_trial())
        else:
            narrow_wins = _rate(self._narrow) < trial
        if narrow_wins:
            was_wide = self._state == _NARROW_TRIAL
            self._pause_s = self.first_pause_s if was_wide else min(self.longest_pause_s, self._pause_s * 2)
            self._state, self._paused_until = _PAUSED, now + self._pause_s
            if was_wide:
                self._say(now, "wide forwards paused: narrow ones ran faster per unit of work (another program "
                               "is using the cores); trying wide again in %.0f s" % self._pause_s)
        else:
            if self._state == _WIDE_TRIAL:
                self._say(now, "wide forwards resumed: they ran at least as fast as narrow ones again")
            spent = sum(wall for wall, _ in self._trial) if self._state == _NARROW_TRIAL else 0.0
            self._state, self._pause_s = _WIDE, 0.0
            self._next_trial = now + max(self.trial_interval_s, spent / self.trial_share)

    def _wide_before_trial(self) -> list:
        # The wide samples were taken before the trial began: the deque holds only wide forwards.
        return list(self._wide)

    def _say(self, now: float, message: str) -> None:
        # One line a minute at most: a machine whose load comes and goes would flip every few seconds.
        if now - self._logged_at >= 60.0:
            log.info(message)
            self._logged_at = now
        else:
            log.debug(message)


def _rate(samples: list) -> float:
    """Wall seconds per second of estimated work over ``samples``."""
    estimated = sum(estimate for _, estimate in samples)
    return sum(wall for wall, _ in samples) / estimated if estimated > 0 else float("inf")
