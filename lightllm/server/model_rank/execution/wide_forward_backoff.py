"""Wide forwards stop while they run slower than narrow ones: another program holds the borrowed core.

:class:`~lightllm.server.model_rank.execution.forward_threads.WideForwardRule` prices a wide
forward assuming the core it borrows is shared only with the server's own front end.  When
another program keeps that core busy (a shared host, a neighbour's container, a test suite), each
of the forward's parallel regions waits for the descheduled thread: measured on the small demo
model with one busy-loop process on a 2-core VM, 300 streamed tokens took 16-25 s wide against
1.6-2.3 s narrow (1.0-2.0 s either way on the quiet machine).

So the rank keeps checking, by what the forwards themselves take.  Every ``trial_interval_s`` the
forwards the rule wants wide run narrow until ``trial_forwards`` of them can be compared with wide
forwards of the same kind and size (seconds per second of estimated work, against the median of
the last wide ones of that size): when narrow did better, wide forwards pause (1 s first, doubling
up to 30 s while each trial after a pause finds wide still slower) and the rank runs narrow; a
trial in which wide does at least as well ends the pause.  Only forwards of one size are compared:
the estimate leaves out a forward's fixed costs, so a 1 ms decode's seconds per estimated second
are many times a 0.9 s prefill's, whatever the thread count (a first version compared across
sizes and paused on a quiet machine serving short and long prompts in turn).  Waiting for a CPU alone is no reason to
stop: the front end's own processes make a wide forward wait too, and the rule already priced that
(64 decode rows of the small model still ran a fifth faster wide with 64 streams to serve).
A trial costs ``trial_forwards`` forwards at the narrow count; the next one waits at least
``trial_interval_s`` and long enough that trials take at most ``trial_share`` (2%) of the time
(measured: the medium model's 64-request bursts lost 5-10% of their throughput to trials every
2 s that fell on 200 ms prefill chunks).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Tuple

log = logging.getLogger("lightllm.model_rank")

# States of the check.
_WIDE, _NARROW_TRIAL, _PAUSED, _WIDE_TRIAL = "wide", "narrow trial", "paused", "wide trial"


@dataclass
class WideForwardBackoff:
    """Decides, for each forward the rule wants wide, whether it runs wide; learns from how long they take.

    ``clock`` is injected so that tests drive it; :meth:`record` takes the forward's kind, its
    measured wall seconds and its estimated work (seconds at the narrow count, from the rule's cost
    model).  Forwards are compared only with forwards of their own kind and size (the estimate's
    power of two): a forward's fixed costs are not in the estimate, so a small forward's seconds
    per estimated second are many times a large one's, narrow or wide.  The first forward of a size
    is not counted (it builds kernels for its shapes).
    """

    clock: Callable[[], float] = time.monotonic
    trial_interval_s: float = 2.0
    trial_forwards: int = 2
    # At most this share of the time runs narrow trials: a trial of long forwards (prefill chunks)
    # waits longer for the next one (two 200 ms chunks: 20 s).
    trial_share: float = 0.02
    first_pause_s: float = 1.0
    longest_pause_s: float = 30.0
    # Samples kept per size and thread count (their median is the comparison).
    kept_samples: int = 5
    _state: str = field(default=_WIDE, init=False)
    _next_trial: float = field(default=0.0, init=False)
    _paused_until: float = field(default=0.0, init=False)
    _pause_s: float = field(default=0.0, init=False)
    _rates: Dict[Tuple[bool, str, int], Deque[float]] = field(default_factory=dict, init=False)
    _seen: Dict[Tuple[str, int], int] = field(default_factory=dict, init=False)
    _trial: List[float] = field(default_factory=list, init=False)
    _trial_forwards_run: int = field(default=0, init=False)
    _trial_wall: float = field(default=0.0, init=False)
    _logged_pause_at: float = field(default=float("-inf"), init=False)
    _pause_said: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._next_trial = self.clock() + self.trial_interval_s

    def runs_wide(self) -> bool:
        """Whether the next forward the rule wants wide runs wide."""
        now = self.clock()
        if self._state == _WIDE and now >= self._next_trial:
            self._begin(_NARROW_TRIAL)
        elif self._state == _PAUSED and now >= self._paused_until:
            self._begin(_WIDE_TRIAL)
        return self._state in (_WIDE, _WIDE_TRIAL)

    def record(self, kind: str, wide: bool, wall_s: float, estimated_s: float) -> None:
        """A ``kind`` forward ("prefill", "decode") the rule wanted wide has run (wide or not) in
        ``wall_s`` for ``estimated_s`` of work."""
        if not estimated_s > 0 or wall_s < 0:
            return
        size = (kind, math.floor(math.log2(estimated_s)))
        self._seen[size] = self._seen.get(size, 0) + 1
        if self._seen[size] == 1:
            return  # the first of its size builds kernels: not a fair sample
        rate = wall_s / estimated_s
        if self._state in (_NARROW_TRIAL, _WIDE_TRIAL):
            self._trial_forwards_run += 1
            self._trial_wall += wall_s
            other = self._rates.get((not wide, *size))
            if other:
                self._trial.append(rate / statistics.median(other))
        self._rates.setdefault((wide, *size), deque(maxlen=self.kept_samples)).append(rate)
        if self._state in (_NARROW_TRIAL, _WIDE_TRIAL):
            self._judge()

    def _begin(self, trial: str) -> None:
        self._state, self._trial, self._trial_forwards_run, self._trial_wall = trial, [], 0, 0.0

    def _judge(self) -> None:
        now = self.clock()
        if len(self._trial) < self.trial_forwards:
            if self._trial_forwards_run < 4 * self.trial_forwards:
                return
            # No forward of a size the other count has run: no evidence either way; go back.
            if self._state == _NARROW_TRIAL:
                self._resume(now)
            else:
                self._state, self._paused_until = _PAUSED, now + self._pause_s
            return
        # The trial arm's time over the other arm's, per unit of work (geometric mean over the trial).
        ratio = math.exp(sum(math.log(value) for value in self._trial) / len(self._trial))
        narrow_wins = ratio < 1.0 if self._state == _NARROW_TRIAL else ratio > 1.0
        if narrow_wins:
            was_wide = self._state == _NARROW_TRIAL
            self._pause_s = self.first_pause_s if was_wide else min(self.longest_pause_s, self._pause_s * 2)
            self._state, self._paused_until = _PAUSED, now + self._pause_s
            if was_wide and now - self._logged_pause_at >= 60.0:
                # One pause line a minute at most: a machine whose load comes and goes would flip often.
                log.info("wide forwards paused: narrow ones ran faster per unit of work (another program is "
                         "using the cores); trying wide again in %.0f s", self._pause_s)
                self._logged_pause_at, self._pause_said = now, True
        else:
            self._resume(now)

    def _resume(self, now: float) -> None:
        if self._state == _WIDE_TRIAL and self._pause_said:
            # Said whenever a pause was, so the log never ends on a pause that is over.
            log.info("wide forwards resumed: they ran at least as fast as narrow ones again")
            self._pause_said = False
        spent = self._trial_wall if self._state == _NARROW_TRIAL else 0.0
        self._state, self._pause_s = _WIDE, 0.0
        self._next_trial = now + max(self.trial_interval_s, spent / self.trial_share)
