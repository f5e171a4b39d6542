"""How a PD request's end on a node is named: one table from the rank's finish status to the stream line.

A PD outcome starts as a rank finish status (:mod:`lightllm.server.core.objs.finish_status`),
reaches the node's HTTP process as that status's name (``FINISH_REASON_NAMES``, the
detokenizer's ``finish_reason``), leaves the node as one stream event (``busy``,
``segment_end`` with a reason, ``handed_off`` or ``error``) and is read back by the master
(a ``segment_end`` reason becomes its ``SegmentEnd``).  :data:`NODE_OUTCOMES` is the only
place that pairs these names; the node (:mod:`lightllm.server.pd.node.service`) translates with
:func:`node_outcome` and the master parses ``segment_end`` reasons with :class:`SegmentEndReason`.

``stop`` and ``length`` are not PD outcomes: they finish the client's request and travel on the
last token line (:data:`CLIENT_FINISH_REASONS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Dict, FrozenSet, Optional, Tuple

from lightllm.server.core.objs.finish_status import (
    FINISH_BUSY,
    FINISH_HANDED_OFF,
    FINISH_LENGTH,
    FINISH_REASON_NAMES,
    FINISH_SEGMENT_KV,
    FINISH_SEGMENT_LIMIT,
    FINISH_STOP,
    FINISH_TRANSFER_FAILED,
)
from lightllm.server.pd.protocol.node_events import BUSY, ERROR, HANDED_OFF, SEGMENT_END


class SegmentEndReason(str, Enum):
    """``reason`` of a ``segment_end`` line: why the decode node ended a segment of an unfinished request."""

    KV_PRESSURE = "kv_pressure"  # KV ran out while decoding: the request gave its KV back
    SEGMENT_LIMIT = "segment_limit"  # the segment generated --pd_max_segment_tokens tokens


SEGMENT_END_REASONS: Tuple[str, ...] = tuple(reason.value for reason in SegmentEndReason)


@dataclass(frozen=True)
class NodeOutcome:
    """One PD finish status and the stream event that reports it.

    Attributes:
        status: the rank's finish status (``FINISH_*``).
        event: the node event kind (:mod:`.node_events`) the node sends for it.
        reason: a ``segment_end``'s reason (:class:`SegmentEndReason` value); empty otherwise.
    """

    status: int
    event: str
    reason: str = ""

    @property
    def finish_reason(self) -> str:
        """The status's name as the node's HTTP process receives it (the detokenizer's name)."""
        return FINISH_REASON_NAMES[self.status]


NODE_OUTCOMES: Tuple[NodeOutcome, ...] = (
    NodeOutcome(FINISH_HANDED_OFF, HANDED_OFF),
    NodeOutcome(FINISH_BUSY, BUSY),
    NodeOutcome(FINISH_SEGMENT_KV, SEGMENT_END, SegmentEndReason.KV_PRESSURE.value),
    NodeOutcome(FINISH_SEGMENT_LIMIT, SEGMENT_END, SegmentEndReason.SEGMENT_LIMIT.value),
    NodeOutcome(FINISH_TRANSFER_FAILED, ERROR),
)
_BY_FINISH_REASON: Dict[str, NodeOutcome] = {outcome.finish_reason: outcome for outcome in NODE_OUTCOMES}

# Finish reasons that end the client's request; they ride on the last token line.
CLIENT_FINISH_REASONS: FrozenSet[str] = frozenset(FINISH_REASON_NAMES[s] for s in (FINISH_STOP, FINISH_LENGTH))


def node_outcome(finish_reason: Optional[str]) -> Optional[NodeOutcome]:
    """The PD outcome a finish reason names, or None (no finish, a client finish, abort or error)."""
    if finish_reason is None:
        return None
    return _BY_FINISH_REASON.get(finish_reason)
