"""The PD prefill node's backend: prompts only; each request is handed off after its first token.

Nothing decodes here (``NO_DECODE_CLASSIFIER``).  When a request's prompt is done and its first
token sampled, :meth:`PrefillBackend.on_prompt_done` moves it to ``TRANSFERRING`` and lists it
in the step's ``handoffs``: its KV stays reserved (it is neither decoded nor paused) until the
transfer layer reports the decode node's acknowledgement through :meth:`transfer_done`; only
then is the KV released (into the prefix cache).  An abort asked for meanwhile takes effect when
the transfer ends, since the transfer may still be reading that KV (the transfer layer gives up
a send that has not started at once).

On a server the backend's :class:`~.pd_node_backend.TransferIntake` admits requests, sends each
hand-off's KV right after its step and calls :meth:`transfer_done` with the agreed result.
"""

from __future__ import annotations

from typing import ClassVar

from lightllm.server.core.objs.finish_status import FINISH_ABORT, FINISH_ERROR, FINISH_HANDED_OFF
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.pd_node_backend import PdNodeBackend
from lightllm.server.model_rank.scheduling.request_classifier import (
    NO_DECODE_CLASSIFIER,
    RequestClassifier,
)
from lightllm.server.model_rank.scheduling.step_report import StepReport
from lightllm.server.model_rank.scheduling.request_state import ReqState


class PrefillBackend(PdNodeBackend):
    """Prefill node: runs prompts with the configured strategy and hands each request off."""

    run_mode: ClassVar[str] = "prefill"
    classifier: ClassVar[RequestClassifier] = NO_DECODE_CLASSIFIER

    def on_prompt_done(self, req: InferReq, report: StepReport) -> None:
        """Keep the KV for the transfer instead of decoding."""
        req.move_to(ReqState.TRANSFERRING)
        report.handoffs.append(req)

    def transfer_done(self, request_id: int, ok: bool, failure_status: int = FINISH_ERROR) -> None:
        """The decode node acknowledged (``ok``) or the transfer failed: release the request's KV.

        Reported in the next step's ``finished``: ``FINISH_HANDED_OFF`` on success, also when an
        abort was asked for meanwhile (the decode node has the KV and continues the request: the
        master closes this node's stream as soon as the decode node confirms that, which may
        overtake this node's own report); on failure ``FINISH_ABORT`` when the request was
        aborted (its transfer was given up, or failed because the decode side gave up too), else
        ``failure_status``.
        """
        req = self.requests.get(request_id)
        if req is None or req.state is not ReqState.TRANSFERRING:
            raise ValueError(f"request {request_id} has no transfer in flight")
        if ok:
            status = FINISH_HANDED_OFF
        elif req.abort_requested:
            status = FINISH_ABORT
        else:
            status = failure_status
        self.finish(req, status)
