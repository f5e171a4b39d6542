"""What a draining PD node learns from the master's answers: whether continuation segments may still come.

A node that drains (it got SIGTERM) still takes the continuation segments of generations already
streaming when no serving node of its role is left, so its drain must not end while the master
may still send one.  The master's answer to each registration and heartbeat carries
``continuations_pending`` (:data:`~lightllm.server.pd.protocol.membership.CONTINUATIONS_PENDING_KEY`):
for a draining node, the number of generations in flight on the master while no node of its role
serves (each may still need a continuation), else 0.  :class:`ContinuationsWatch` keeps what the
last answered call said; the node's registration client
(:mod:`lightllm.server.pd.node.registration_client`) feeds it and heartbeats every
:data:`DRAIN_POLL_S` at most while it drains, so a drain ends soon after the last generation, and
a count that rises again (the last serving node of the role left) reaches the node before it
leaves.

Versions: a master older than the field answers without it, which reads as 0 (such a master
learns no state or sends a draining node nothing); a node older than the field ignores it.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from lightllm.server.pd.protocol.membership import CONTINUATIONS_PENDING_KEY, STATE_DRAINING

# A draining node heartbeats this often (at most), for a fresh count of the continuations to come.
DRAIN_POLL_S = 0.25


class ContinuationsWatch:
    """The state the last answered call reported and the master's ``continuations_pending`` then.

    Attributes:
        answered_state: the ``state`` the last answered registration or heartbeat carried (None:
            it carried none).
        pending: the master's count in that answer (0 when it sent none).
    """

    def __init__(self) -> None:
        self._state_sent: Optional[str] = None
        self.answered_state: Optional[str] = None
        self.pending = 0

    def sent(self, state: Optional[str]) -> None:
        """A call is on its way carrying ``state`` (None: without the report fields)."""
        self._state_sent = state

    def answered(self, body: Mapping[str, Any]) -> None:
        """The master accepted the call last :meth:`sent`; ``body`` is its answer."""
        self.answered_state = self._state_sent
        pending = body.get(CONTINUATIONS_PENDING_KEY)
        # An older master sends none: it sends no continuation to a draining node either.
        self.pending = pending if isinstance(pending, int) and not isinstance(pending, bool) and pending > 0 else 0

    def interval(self, heartbeat_interval_s: float) -> float:
        """The pause between heartbeats: at most :data:`DRAIN_POLL_S` once the node reports draining."""
        return min(heartbeat_interval_s, DRAIN_POLL_S) if self._state_sent == STATE_DRAINING else heartbeat_interval_s

    def may_come(self) -> bool:
        """True until the master answered a call that said the node drains with ``continuations_pending`` 0."""
        return self.answered_state != STATE_DRAINING or self.pending > 0
