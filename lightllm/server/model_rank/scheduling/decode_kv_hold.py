"""A decode node's KV hold: the request refused earliest gets the KV before later, smaller ones.

Every request that finishes on a decode node frees KV, and a small reservation fits into it at
once, so without a hold a large request could be refused for as long as small ones keep
arriving.  :class:`KvHoldLine` is the line of requests the node refused that still ask, in the
order of their first refusal; the first of them not reserved here now is held, and the backend
(:class:`~.decode_backend.DecodeBackend`) grants another reservation only if it leaves the held
request's need unpromised and, while the held request waits, keeps one request row for it.

Ordering by first refusal, not by who asks next, matters: the master retries a busy answer
after 50 ms, doubling up to 1 s (:mod:`lightllm.server.pd.master.busy_retry`), so a request
that waited long asks once a second and one just refused every 50 ms; the latter would win
every time.

The master does not tell the node when a request gives up or is placed on another decode node,
so a request stays in line only while it keeps asking: it leaves once :data:`HOLD_SECONDS` pass
without an ask and, on a node running requests, :data:`HOLD_STEPS` engine steps too.  Time alone
was too short on a loaded machine: an ask waits for the step running when it arrives, and with
CPU steps of a second or more the asks of a held request came 3.2 s apart, so it lost its place
and waited 20 s more (1P1D at load average 10).  Steps alone cannot end a stale hold on a node
running nothing, which steps only when it refuses.  The clock is rank 0's, sent with the
requests it admits (:attr:`~lightllm.server.core.objs.io_messages.AddRequests.leader_time`), and
steps are counted alike everywhere, so every TP rank decides the same; the simulator passes its
virtual time.

A request granted here keeps its place while it is reserved (its reservation's lease bounds
that) and for :data:`RELEASE_GRACE_SECONDS` after the reservation ends without its KV: if its
prefill node answers busy, the master gives the reservation back and asks again within about a
second, and the request is still first in line.  The same reservation also ends when the prefill
node's first token finished the request or its client went away, and the node cannot tell these
apart, so the grace is short: such a request holds the KV it needed for at most that long.  Its
KV arriving takes it out of line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

# How long a refused request keeps its place without asking again.  The master asks again at
# least every ~1 s (its longest backoff) plus an answer's round trip, which waits for the step
# running when the ask arrives (up to a few hundred ms for a CPU decode step); 3 s is over
# twice that, and a stale hold (its request gave up or went elsewhere) ends within 3 s.
HOLD_SECONDS = 3.0
# Engine steps that must also pass on a node running requests.  Between two asks of a waiting
# request come the master's backoff (at most 1 s) and the path of the ask into the rank loop,
# which waits for the step running then (a few steps at most): under 1 s / step + 4 steps.
# The steps matter only where 10 steps outlast 3 s (steps over 0.3 s), and there the gap is
# under 1 / 0.3 + 4 = 7.3 steps; for shorter steps the gap is under 1 s + 4 steps < 3 s.
# A stale hold ends after max(3 s, 10 steps): 5 s with CPU steps of half a second.
HOLD_STEPS = 10
# How long a request keeps its place after its reservation ended without its KV: the master's
# re-ask after a busy prefill node comes after its first backoffs (50, 100, 200 ms ...), under a
# second; a request that finished at its prefill node holds the KV it needed this long at most.
RELEASE_GRACE_SECONDS = 1.5


@dataclass
class WaitingRequest:
    """A request the node refused that still asks."""

    request_id: int
    tokens: int  # the KV tokens its reservation needs
    asked_at: float  # the agreed time of its last ask
    asked_step: int  # the node's step count at its last ask
    reserved: bool = False  # granted here and waiting for its KV: it keeps its place, nothing is held for it


class KvHoldLine:
    """Refused requests that still ask, in the order of their first refusal (see the module docstring).

    Args:
        hold_seconds: how long a request keeps its place without asking again.
        hold_steps: the engine steps that must pass too on a node running requests.
    """

    def __init__(self, hold_seconds: float = HOLD_SECONDS, hold_steps: int = HOLD_STEPS) -> None:
        if not hold_seconds > 0:
            raise ValueError(f"hold_seconds must be > 0, got {hold_seconds}")
        if hold_steps < 0:
            raise ValueError(f"hold_steps must be >= 0, got {hold_steps}")
        self.hold_seconds = hold_seconds
        self.hold_steps = hold_steps
        self.now = 0.0  # the agreed time: rank 0's clock as of the last requests it admitted
        self.steps = 0  # the node's engine steps
        self._waiting: Dict[int, WaitingRequest] = {}
        self._pruned_at: Optional[tuple] = None  # (time, steps, idle) of the last scan for expired entries

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting

    def observe(self, now: float) -> None:
        """The agreed time moved to ``now`` (never backwards: a stale stamp changes nothing)."""
        if now > self.now:
            self.now = now

    def observe_step(self) -> None:
        """The node ran an engine step."""
        self.steps += 1

    def held(self, idle: bool = False) -> Optional[WaitingRequest]:
        """The held request: the first one in line not reserved here now, after dropping the expired.

        ``idle``: the node runs nothing, so only time ends a wait (see the module docstring).
        """
        # Entries expire only as the time or the steps move, so one scan per new (time, steps)
        # is enough (not one per ask: thousands of refused requests would make every
        # reservation a long scan).
        key = (self.now, self.steps, idle)
        if self._pruned_at != key:
            self._pruned_at = key
            waiting, oldest, last_step = self._waiting, self.now - self.hold_seconds, self.steps - self.hold_steps
            for request_id in [r for r, w in waiting.items()
                               if w.asked_at < oldest and (idle or w.asked_step <= last_step) and not w.reserved]:
                del waiting[request_id]
        return next((w for w in self._waiting.values() if not w.reserved), None)

    def refused(self, request_id: int, tokens: int) -> None:
        """``request_id`` was refused needing ``tokens``: it keeps its place (its first refusal) and counts as asking."""
        waiting = self._waiting.setdefault(request_id, WaitingRequest(request_id, tokens, self.now, self.steps))
        waiting.tokens, waiting.asked_at, waiting.asked_step, waiting.reserved = tokens, self.now, self.steps, False

    def granted(self, request_id: int) -> None:
        """``request_id`` was granted: it keeps its place, and holds nothing, while it is reserved."""
        waiting = self._waiting.get(request_id)
        if waiting is not None:
            waiting.asked_at, waiting.asked_step, waiting.reserved = self.now, self.steps, True

    def released(self, request_id: int) -> None:
        """``request_id``'s reservation ended without its KV: it keeps its place for :data:`RELEASE_GRACE_SECONDS`."""
        waiting = self._waiting.get(request_id)
        if waiting is not None and waiting.reserved:
            waiting.reserved = False
            # From the agreed time now, however long it was reserved (a prompt may queue long on
            # its prefill node); that time moves with every ask, so it is late only when nobody asks.
            waiting.asked_at = self.now - self.hold_seconds + RELEASE_GRACE_SECONDS
            waiting.asked_step = self.steps - self.hold_steps  # the grace is time alone
            self._pruned_at = None  # it may have expired already: the next held() looks again

    def leave(self, request_id: int) -> None:
        """``request_id`` no longer waits (its KV arrived, or it can never fit)."""
        self._waiting.pop(request_id, None)
