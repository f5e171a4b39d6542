"""A PD request's generation events as the node's stream events (the lines the master reads).

Pure functions: rank 0's notices of the request (which arrive before the token or finish they
explain) and one :class:`~lightllm.server.request_manager.GenerationEvent` in, the
:class:`~lightllm.server.pd.protocol.node_events.PdNodeEvent` values to send out.
"""

from __future__ import annotations

import dataclasses
from typing import List, Mapping, Optional

from lightllm.server.core.objs.io_messages import PdNotice
from lightllm.server.pd.protocol.node_events import (BUSY, ERROR, GENERATION_FAILED, GRAMMAR_FAILED, HANDED_OFF,
                                                     SEGMENT_END, TOKEN, PdNodeEvent)
from lightllm.server.pd.protocol.outcomes import CLIENT_FINISH_REASONS, node_outcome
from lightllm.server.request_manager import GenerationEvent

# PdNotice.kind values other than "reserved" (which becomes a stream event of its own): the
# details of an outcome whose finish or token follows in the same stream.
NOTICE_TRANSFERRED = "transferred"
NOTICE_TRANSFER_FAILED = "transfer_failed"
NOTICE_BUSY = "busy"


def error_event(message: str, error_kind: str, transfer_broken: bool = False) -> PdNodeEvent:
    """An ERROR stream event of ``error_kind``; ``transfer_broken`` makes the master set the (P, D) pair up again."""
    return PdNodeEvent(ERROR, message=message, error_kind=error_kind, transfer_broken=transfer_broken)


def _with_transfer(event: PdNodeEvent, transferred: Optional[PdNotice]) -> PdNodeEvent:
    if transferred is not None:
        event.transfer_seconds, event.transfer_bytes = transferred.seconds, transferred.nbytes
    return event


def translate(
    event: GenerationEvent, request_id: int, notices: Mapping[str, PdNotice], first_on_decode: bool
) -> List[PdNodeEvent]:
    """The stream events of one generation event of a PD request.

    ``notices`` holds the request's notices so far by kind (they arrive before the token or
    finish they explain); ``first_on_decode``: this is a decode node's first token, which
    carries its transfer's seconds and bytes.  The PD finish reasons are named by
    :func:`~lightllm.server.pd.protocol.outcomes.node_outcome`.
    """
    reason = event.finish_reason
    client_finish = reason is None or reason in CLIENT_FINISH_REASONS
    out: List[PdNodeEvent] = []
    if event.token_id >= 0:
        token = event if client_finish else dataclasses.replace(event, finish_reason=None)
        token_event = PdNodeEvent(TOKEN, token=token)
        out.append(_with_transfer(token_event, notices.get(NOTICE_TRANSFERRED)) if first_on_decode else token_event)
    elif reason is not None and client_finish:
        # A finish without a new token (the event protocol allows one; the detokenizer reads a
        # step's last token and status together, so length/stop normally carry a token) goes
        # out as a token-less finish, which the master reads as the end of the request; dropped,
        # the stream would end without a result.
        out.append(PdNodeEvent(TOKEN, token=event))
    if client_finish:
        return out
    outcome = node_outcome(reason)
    if outcome is None and reason == "error":
        # The rank ended the request with an error (a grammar that cannot go on, a failed forward),
        # as a normal server's rank does: the client gets that server's answer.
        out.append(error_event(f"request {request_id} failed on the node while generating (see the node's log)",
                               GENERATION_FAILED))
    elif outcome is None and reason == GRAMMAR_FAILED:
        # Its structured-output grammar could not go on: the client's input, answered as a normal server does.
        out.append(error_event(f"request {request_id}: its structured-output grammar could not go on (see the "
                               "node's log)", GRAMMAR_FAILED))
    elif outcome is None:  # "abort" (a stop string never ends a PD node's request: the master decides)
        out.append(error_event(f"request {request_id} ended on the node: {reason}", "internal"))
    elif outcome.event == HANDED_OFF:
        out.append(_with_transfer(PdNodeEvent(HANDED_OFF), notices.get(NOTICE_TRANSFERRED)))
    elif outcome.event == BUSY:
        # Rank 0's notice names the limit it hit (KV tokens or request slots) with its numbers.
        busy = notices.get(NOTICE_BUSY)
        why = busy.message if busy is not None else "no KV or request slot to reserve for it now"
        out.append(PdNodeEvent(BUSY, message=f"request {request_id}: {why}"))
    elif outcome.event == SEGMENT_END:
        out.append(PdNodeEvent(SEGMENT_END, reason=outcome.reason))
    else:  # the KV transfer failed; rank 0's notice says how
        failure = notices.get(NOTICE_TRANSFER_FAILED)
        kind = failure.error_kind if failure is not None else NOTICE_TRANSFER_FAILED
        message = failure.message if failure is not None else f"request {request_id}: the KV transfer failed"
        out.append(error_event(message, kind, transfer_broken=kind == "transfer_broken"))
    return out
