"""The PD decode node's backend: requests arrive with their prompt's KV computed elsewhere.

Intake has two halves, so that KV is reserved before anything is sent (decode reserves first):

1. :meth:`DecodeBackend.reserve_prefilled` checks the request, attaches whatever prefix this
   node's cache already holds, and reserves slots for the rest of the prompt; the request waits
   in ``TRANSFERRING``.  When the KV cache cannot hold the prompt and ``max_new_tokens`` it
   raises :class:`KvReservationRefused` at once (the master answers "busy"), never after a wait.
   Only positions ``[cur_kv_len, input_len)`` need to move; the transfer writes them into the
   reserved slots.
2. :meth:`DecodeBackend.admit_prefilled` (the transfer arrived) marks the prompt computed, takes
   the prefill node's first token and the request decodes from the next step on, with the same
   stop rules as on a normal node.  :meth:`DecodeBackend.transfer_failed` releases the
   reservation and fails the request.

A request paused here for lack of KV recomputes its prompt locally, like on a normal node.
"""

from __future__ import annotations

from typing import Any, ClassVar, List

from lightllm.server.core.objs.finish_status import FINISH_ABORT, FINISH_ERROR
from lightllm.server.router.model_infer.infer_req import InferReq
from lightllm.server.router.model_infer.mode_backend.base_backend import ModeBackend
from lightllm.server.router.model_infer.request_state import ReqState


class KvReservationRefused(RuntimeError):
    """The KV cache cannot hold the request now: the caller answers busy."""


class DecodeBackend(ModeBackend):
    """Decode node: admits prefilled requests and decodes them."""

    run_mode: ClassVar[str] = "decode"

    def reserve_prefilled(self, request_id: int, prompt_ids: List[int], params: Any, **fields: Any) -> InferReq:
        """Check the request and reserve KV for its prompt; it waits for the transfer.

        ``fields`` are :meth:`new_request`'s optional keywords.
        """
        return self.reserve_for(self.new_request(request_id, prompt_ids, params, **fields))

    def reserve_for(self, req: InferReq) -> InferReq:
        """Reserve KV for an already built ``req`` and join it in ``TRANSFERRING``.

        Refused (nothing changes) unless the cache could hold the prompt plus ``max_new_tokens``
        beyond what the request already finds in the prefix cache.
        """
        needed = req.input_len + req.max_new_tokens
        if self.kv.allocatable_token_num() < needed:
            raise KvReservationRefused(
                f"request {req.request_id} needs {needed} KV tokens, {self.kv.allocatable_token_num()} allocatable"
            )
        self.join(req)
        self.kv.reserve(req, req.input_len - req.kv_slot_len)
        req.move_to(ReqState.TRANSFERRING)
        return req

    def admit_prefilled(self, req: InferReq, first_token: int) -> int:
        """The prompt's KV is in place: take the first token and decode from the next step.

        Returns the finish status when the first token already ends the request (it is then
        released and reported by the next step), else 0.
        """
        if req.state is not ReqState.TRANSFERRING or self.requests.get(req.request_id) is not req:
            raise ValueError(f"request {req.request_id} is not waiting for a transfer")
        req.cur_kv_len = req.input_len
        req.output_ids.append(first_token)
        req.move_to(ReqState.DECODING)
        if req.abort_requested:
            self.finish(req, FINISH_ABORT)
            return FINISH_ABORT
        status = self.finish_status(req, first_token)
        if status:
            self.finish(req, status)
        return status

    def transfer_failed(self, req: InferReq) -> None:
        """The transfer did not arrive: give the reservation back and fail the request."""
        if req.state is not ReqState.TRANSFERRING or self.requests.get(req.request_id) is not req:
            raise ValueError(f"request {req.request_id} is not waiting for a transfer")
        self.finish(req, FINISH_ERROR)
