"""What a PD node's service yields for one request (see /pd/node/* in the PD docs).

The node's PD endpoints turn each :class:`PdNodeEvent` into one NDJSON line for the master.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightllm.server.request_manager import GenerationEvent

# PdNodeEvent.kind values.
RESERVED = "reserved"  # decode node: KV reserved, receiving positions [kv_start, prompt_len)
TOKEN = "token"  # one token; the last one of a finished request carries finish_reason
BUSY = "busy"  # decode node: no KV or request slot to reserve; answered at once
SEGMENT_END = "segment_end"  # decode node: the segment ended (reason), the request goes on elsewhere
HANDED_OFF = "handed_off"  # prefill node: the decode node acknowledged the KV; P released it
ERROR = "error"
# Every kind a stream line may carry (its "event" key); the master reads nothing else.
NODE_EVENT_KINDS = frozenset({RESERVED, TOKEN, BUSY, SEGMENT_END, HANDED_OFF, ERROR})

# PdNodeEvent.error_kind values of the KV transfer: it failed, the decode node's reservation lease
# ran out before the KV arrived, or the pair's transfer group broke (the master sets it up again).
TRANSFER_FAILED = "transfer_failed"
LEASE_EXPIRED = "lease_expired"
TRANSFER_BROKEN = "transfer_broken"
# PdNodeEvent.error_kind values. "generation_failed": the node's model rank ended the request with
# an error (its grammar failed, a forward failed): the client gets what a normal server answers
# then (500 generation_failed), not a failed-node 503 (a dead node process is reported otherwise).
GENERATION_FAILED = "generation_failed"
# "grammar_failed": the request's structured-output grammar could not go on; the client gets what a
# normal server answers then (400 grammar_failed).
GRAMMAR_FAILED = "grammar_failed"
# The error kinds of a request the node's rank ended, each also the finish reason it has on a normal server.
RANK_FAILURE_REASONS = {GENERATION_FAILED: "error", GRAMMAR_FAILED: GRAMMAR_FAILED}
ERROR_KINDS = (TRANSFER_FAILED, LEASE_EXPIRED, TRANSFER_BROKEN, "epoch", "internal", GENERATION_FAILED,
               GRAMMAR_FAILED)


@dataclass
class PdNodeEvent:
    """One event of a PD node request's stream.

    ``kv_start``: "reserved"; ``token``: "token" (``finish_reason`` set on the last, only
    "stop" or "length"); ``reason``: "segment_end" (a :class:`~.outcomes.SegmentEndReason` value);
    ``message``: "busy" / "error"; ``transfer_broken``: "error" (the master sets the pair up
    again); ``error_kind``: "error" (one of :data:`ERROR_KINDS`); ``transfer_seconds`` /
    ``transfer_bytes``: this side's transfer on P's "handed_off" and on D's first "token".
    """

    kind: str
    kv_start: int = 0
    token: Optional[GenerationEvent] = None
    reason: str = ""
    message: str = ""
    transfer_broken: bool = False
    error_kind: str = ""
    transfer_seconds: float = 0.0
    transfer_bytes: int = 0
