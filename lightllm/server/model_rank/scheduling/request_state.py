"""The lifecycle of a request on a model rank: one state, with the allowed transitions checked.

::

    WAITING ──► PREFILLING ──► DECODING ──► FINISHED
       │  │         │   ▲  │        │
       │  │         ▼   │  ▼        ▼
       │  └──────► PAUSED ◄──── (KV ran out)
       │
       └─► TRANSFERRING ──► DECODING        (decode node: KV arrives from the prefill node)
    PREFILLING ──► TRANSFERRING ──► FINISHED (prefill node: KV leaves once acknowledged)

Every live state may also go to ``ABORTED`` (the client went away) or ``FINISHED`` (a stop
condition or an error).  ``FINISHED`` and ``ABORTED`` are terminal.  A transition not in
:data:`ALLOWED_TRANSITIONS` raises :class:`InvalidTransition`: a scheduling bug surfaces where
it happens instead of as a request that silently never runs again.
"""

from __future__ import annotations

import enum
from typing import Dict, FrozenSet


class ReqState(enum.Enum):
    """Where a request is in its life on this rank."""

    WAITING = "waiting"  # admitted; nothing computed yet beyond a prefix-cache hit
    PREFILLING = "prefilling"  # part of the prompt is in the KV cache
    DECODING = "decoding"  # the prompt is done; one token per step
    PAUSED = "paused"  # its KV was taken back for lack of room; it recomputes later
    TRANSFERRING = "transferring"  # its prompt KV is moving between nodes (either direction)
    FINISHED = "finished"  # stopped, hit a limit, handed off, or failed; KV released
    ABORTED = "aborted"  # the client went away; KV released

    @property
    def terminal(self) -> bool:
        """Whether no transition leaves this state."""
        return self in (ReqState.FINISHED, ReqState.ABORTED)

    @property
    def schedulable(self) -> bool:
        """Whether the step may plan work for a request in this state (paused ones resume first)."""
        return self in (ReqState.WAITING, ReqState.PREFILLING, ReqState.DECODING)


_ENDS = frozenset({ReqState.FINISHED, ReqState.ABORTED})

ALLOWED_TRANSITIONS: Dict[ReqState, FrozenSet[ReqState]] = {
    ReqState.WAITING: frozenset({ReqState.PREFILLING, ReqState.DECODING, ReqState.PAUSED, ReqState.TRANSFERRING})
    | _ENDS,
    ReqState.PREFILLING: frozenset({ReqState.DECODING, ReqState.PAUSED, ReqState.TRANSFERRING}) | _ENDS,
    ReqState.DECODING: frozenset({ReqState.PAUSED}) | _ENDS,
    ReqState.PAUSED: frozenset({ReqState.PREFILLING}) | _ENDS,
    ReqState.TRANSFERRING: frozenset({ReqState.DECODING}) | _ENDS,
    ReqState.FINISHED: frozenset(),
    ReqState.ABORTED: frozenset(),
}


class InvalidTransition(RuntimeError):
    """A request was asked to move between two states the lifecycle does not connect."""


def check_transition(request_id: int, current: ReqState, target: ReqState) -> None:
    """Raise :class:`InvalidTransition` unless ``current -> target`` is allowed."""
    if target not in ALLOWED_TRANSITIONS[current]:
        raise InvalidTransition(f"request {request_id} cannot go from {current.value} to {target.value}")
