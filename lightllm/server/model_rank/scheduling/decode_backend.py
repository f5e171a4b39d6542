"""The PD decode node's backend: requests arrive with their prompt's KV computed elsewhere.

Intake has two halves, so that KV is reserved before anything is sent (decode reserves first):

1. :meth:`DecodeBackend.reserve_prefilled` creates the request, attaches whatever prefix this
   node's cache already holds, and reserves slots for the rest of the prompt; the request waits
   in ``TRANSFERRING``.  When the KV cache cannot hold the prompt and ``max_new_tokens``, or
   every request row is in use, it raises :class:`KvReservationRefused` naming that limit at
   once (the master answers "busy" with its message), never after a wait.
   Only positions ``[cur_kv_len, input_len)`` need to move; the transfer writes them into the
   reserved slots.
2. :meth:`DecodeBackend.admit_prefilled` (the transfer arrived) marks the prompt computed, takes
   the prefill node's first token (reported first in the next step's tokens, like a sampled one)
   and the request decodes from the next step on, with the same stop rules as on a normal node.
   :meth:`DecodeBackend.transfer_failed` releases the reservation and fails the request.

On a server the backend's :class:`~.pd_node_backend.TransferIntake` runs both halves: it
reserves (with :meth:`DecodeBackend.segment_tokens` as the decode allowance) and starts
receiving, and admits or fails the request on the agreed transfer result.

A KV hold (:mod:`.decode_kv_hold`) keeps a large request from starving behind small ones: the
node remembers the requests it refused (for KV tokens or for a request row) in the order of
their first refusal, in a :class:`~.decode_kv_hold.KvHoldLine`, and holds KV for the first of
them not reserved here: while the hold is live, another reservation is granted only if it leaves
the held request's need unpromised (``free - held >= needed``, where ``free`` is allocatable and
not promised), so smaller requests still use the KV beyond it but not the KV the held one waits
for, and one request row stays free for it.  The held request is granted on one of its retries
(the master retries a busy answer) once ``free`` reaches its need; the next one in line is held
then.  A request blocked by a hold is told so in its refusal (``N of them held for request R,
refused earlier``).  Never held: a request needing more than the whole KV cache
(:meth:`~.kv_view.KvView.capacity_token_num`; it would never fit and the hold would block the
node).  The line's clock is rank 0's (:meth:`observe_time`) and its engine steps, so every TP rank
decides the same.

A request paused here for lack of KV recomputes its prompt locally, like on a normal node,
unless ``end_segment_on_kv_pressure`` is set (a PD decode node's rank sets it): the request's
segment then ends with ``FINISH_SEGMENT_KV`` and the master continues it as a new segment,
since recomputing a prompt is the prefill node's work.  With ``max_segment_tokens`` > 0 a
segment also ends (``FINISH_SEGMENT_LIMIT``) once it generated that many tokens, the prefill
node's first token included, unless that token also finishes the request by the normal stop rules
(a completed structured-output grammar among them).  Both are constructor arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Dict, Optional, Sequence

from lightllm.server.core.objs.finish_status import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_SEGMENT_KV,
    FINISH_SEGMENT_LIMIT,
)
from lightllm.server.model_rank.scheduling.decode_kv_hold import KvHoldLine, WaitingRequest
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.kv_view import KvView
from lightllm.server.model_rank.scheduling.model_executor import ModelExecutor
from lightllm.server.model_rank.scheduling.pd_node_backend import PdNodeBackend, TransferIntake
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import PrefillQueueStrategy
from lightllm.server.model_rank.scheduling.step_planner import StepPlan, StepPlanner
from lightllm.server.model_rank.scheduling.step_report import StepReport
from lightllm.server.model_rank.scheduling.request_state import ReqState

if TYPE_CHECKING:
    from lightllm.server.core.objs.request_spec import RequestSpec


# Which limit refused a reservation (KvReservationRefused.limit); the message names it too.
LIMIT_KV_TOKENS = "kv_tokens"  # the KV cache cannot hold the prompt plus the segment's decode tokens
LIMIT_REQUEST_SLOTS = "request_slots"  # every request row (--running_max_req_size) is in use


class KvReservationRefused(RuntimeError):
    """The node cannot take the request now: the caller answers busy.

    ``limit``: :data:`LIMIT_KV_TOKENS` or :data:`LIMIT_REQUEST_SLOTS`; the message states the
    numbers (KV tokens needed and free, or the request rows in use).
    """

    def __init__(self, message: str, limit: str = LIMIT_KV_TOKENS) -> None:
        super().__init__(message)
        self.limit = limit


class DecodeBackend(PdNodeBackend):
    """Decode node: admits prefilled requests and decodes them.

    Args, after the :class:`~.pd_node_backend.PdNodeBackend` ones:
        end_segment_on_kv_pressure: end a KV-starved request's segment instead of pausing it.
        max_segment_tokens: end a segment after this many generated tokens (0: no limit).
        hold_line: the KV hold's line of refused requests (default: a new one, :data:`~.decode_kv_hold.HOLD_SECONDS`).
    """

    run_mode: ClassVar[str] = "decode"

    def __init__(
        self,
        executor: ModelExecutor,
        kv: KvView,
        strategy: PrefillQueueStrategy,
        planner: StepPlanner,
        eos_token_ids: Sequence[int],
        max_req_total_len: int,
        *,
        transfer: Optional[TransferIntake] = None,
        end_segment_on_kv_pressure: bool = False,
        max_segment_tokens: int = 0,
        hold_line: Optional[KvHoldLine] = None,
    ) -> None:
        super().__init__(executor, kv, strategy, planner, eos_token_ids, max_req_total_len, transfer=transfer)
        if max_segment_tokens < 0:
            raise ValueError(f"max_segment_tokens must be >= 0, got {max_segment_tokens}")
        self.end_segment_on_kv_pressure = end_segment_on_kv_pressure
        self.max_segment_tokens = max_segment_tokens
        # request id -> KV tokens its reservation was promised (prompt + decode allowance).
        self._promised: Dict[int, int] = {}
        self.hold_line = hold_line if hold_line is not None else KvHoldLine()

    def observe_time(self, now: float) -> None:
        """The agreed time (rank 0's clock, the same on every TP rank) moved to ``now``: the KV hold's clock."""
        self.hold_line.observe(now)

    def step(self) -> StepReport:
        """One engine step (see :class:`~.pd_node_backend.PdNodeBackend`), counted by the KV hold."""
        self.hold_line.observe_step()
        return super().step()

    def held_request(self) -> Optional[WaitingRequest]:
        """The request the KV hold is for now, if any (see the module docstring)."""
        return self.hold_line.held(idle=not self.requests)

    def segment_tokens(self, max_new_tokens: int) -> int:
        """What one segment of a request allowed ``max_new_tokens`` may generate here."""
        if self.max_segment_tokens > 0:
            return min(max_new_tokens, self.max_segment_tokens)
        return max_new_tokens

    def reserve_prefilled(
        self, request_id: int, spec: "RequestSpec", shm_index: int = -1, decode_tokens: Optional[int] = None
    ) -> InferReq:
        """Create ``spec``'s request and reserve KV for its prompt; it waits for the transfer.

        ``shm_index`` as in :meth:`add_request`; ``decode_tokens`` as in :meth:`reserve_for`.
        Refused (:class:`KvReservationRefused`, nothing changes) when every request row is in
        use, or as :meth:`reserve_for` refuses.
        """
        hold = self.held_request()
        rows = self.kv.max_requests()
        # While another request is held, one request row stays free for it: a row that frees
        # would otherwise go to whichever small request asks first, as KV would.
        kept = 1 if hold is not None and hold.request_id != request_id else 0
        if len(self.requests) >= rows - kept:
            needed = spec.prompt_len + (spec.params.max_new_tokens if decode_tokens is None else decode_tokens)
            if needed <= self.kv.capacity_token_num():
                self.hold_line.refused(request_id, needed)  # it waits for a row: it keeps its place
            reason = f"no request slot to reserve: all {rows} request slots (--running_max_req_size) are in use"
            if kept and len(self.requests) < rows:
                reason = (f"no request slot to reserve: {len(self.requests)} of {rows} request slots "
                          f"(--running_max_req_size) are in use, the last one kept for request "
                          f"{hold.request_id}, refused earlier")  # type: ignore[union-attr]
            raise KvReservationRefused(reason, LIMIT_REQUEST_SLOTS)
        return self.reserve_for(self.new_request(request_id, spec, shm_index), decode_tokens)

    def reserve_for(self, req: InferReq, decode_tokens: Optional[int] = None) -> InferReq:
        """Reserve KV for an already built ``req`` and join it in ``TRANSFERRING``.

        Refused (nothing changes) unless the cache could hold the prompt plus ``decode_tokens``
        (default ``max_new_tokens``; a PD node passes what one segment may generate) on top of
        what earlier reservations were promised and have not allocated yet: the prompt's slots
        are taken now, the decode tokens step by step, and a reservation must not be answered
        with KV another one still counts on.  While another request's KV hold is live it must
        also leave that request's need unpromised; a refusal for KV may make ``req`` the held
        request (see the module docstring).
        """
        needed = req.input_len + (req.max_new_tokens if decode_tokens is None else decode_tokens)
        free = self.kv.allocatable_token_num() - self.promised_token_num()
        hold = self.held_request()
        withheld = hold.tokens if hold is not None and hold.request_id != req.request_id else 0
        if free - withheld < needed:
            reason = (f"no KV to reserve: request {req.request_id} needs {needed} KV tokens (prompt {req.input_len} + "
                      f"{needed - req.input_len} to generate), {free} allocatable and not promised")
            capacity = self.kv.capacity_token_num()
            if needed <= capacity:  # it waits for the hold (one never fitting would block the node)
                self.hold_line.refused(req.request_id, needed)
            else:
                self.hold_line.leave(req.request_id)  # a later segment of it may need more than before
            now_held = self.held_request()
            if hold is not None and withheld:
                reason += f", {min(max(free, 0), withheld)} of them held for request {hold.request_id}, refused earlier"
            elif needed > capacity:
                reason += f"; more than the whole KV cache ({capacity} tokens), so it is not held"
            elif now_held is not None and now_held.request_id == req.request_id:
                reason += "; held: no other request takes the KV it waits for"
            raise KvReservationRefused(reason, LIMIT_KV_TOKENS)
        # Its place in line stays until its KV arrives: its prefill node may still answer busy.
        self.hold_line.granted(req.request_id)
        self.join(req)
        self.kv.reserve(req, req.input_len - req.kv_slot_len)
        req.move_to(ReqState.TRANSFERRING)
        self._promised[req.request_id] = needed
        return req

    def promised_token_num(self) -> int:
        """KV tokens live reservations may still allocate (their promise beyond the slots they hold)."""
        promised = self._promised
        total = 0
        for request_id in list(promised):
            req = self.requests.get(request_id)
            if req is None:
                del promised[request_id]  # the request left
                continue
            total += max(0, promised[request_id] - req.kv_slot_len)
        return total

    def admit_prefilled(self, req: InferReq, first_token: int) -> int:
        """The prompt's KV is in place: take the first token and decode from the next step.

        Returns the finish status when the first token already ends the request (it is then
        released and reported by the next step), else 0.
        """
        if req.state is not ReqState.TRANSFERRING or self.requests.get(req.request_id) is not req:
            raise ValueError(f"request {req.request_id} is not waiting for a transfer")
        self.hold_line.leave(req.request_id)
        req.cur_kv_len = req.input_len
        req.output_ids.append(first_token)
        # Published like a sampled token (the detokenizer needs its text), even if the request ends here.
        self.carry_token(req, first_token)
        req.move_to(ReqState.DECODING)
        if req.abort_requested:
            self.finish(req, FINISH_ABORT)
            return FINISH_ABORT
        status = self.finish_status(req, first_token)
        if status:
            self.finish(req, status)
        return status

    def transfer_failed(self, req: InferReq, status: int = FINISH_ERROR) -> None:
        """The transfer did not arrive: give the reservation back and fail the request with ``status``."""
        if req.state is not ReqState.TRANSFERRING or self.requests.get(req.request_id) is not req:
            raise ValueError(f"request {req.request_id} is not waiting for a transfer")
        self.hold_line.released(req.request_id)
        self.finish(req, FINISH_ABORT if req.abort_requested else status)

    def finish_status(self, req: InferReq, token: int, grammar_end: Optional[str] = None) -> int:
        """The normal stop rules, then the per-segment token limit.

        A structured-output grammar the token completed is one of the normal rules: the request
        finishes (``stop``), as on a normal server, even on the segment's last token.  Reported
        as a segment end instead, the master would send a continuation whose prefill node could only
        sample an end-of-sequence token, one token more than a normal server's answer.
        """
        status = super().finish_status(req, token, grammar_end)
        if not status and self.max_segment_tokens > 0 and len(req.output_ids) >= self.max_segment_tokens:
            return FINISH_SEGMENT_LIMIT
        return status

    def pause_starved(self, plan: StepPlan, report: StepReport) -> None:
        """With ``end_segment_on_kv_pressure``, starved decode requests end their segment instead of pausing."""
        if not self.end_segment_on_kv_pressure:
            super().pause_starved(plan, report)
            return
        for req in plan.kv_starved_decode:
            self.finish(req, FINISH_SEGMENT_KV, report)
