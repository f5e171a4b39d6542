"""``ModeBackend``: the step engine plus request intake, for one run mode.

A mode backend is the :class:`~.step_engine.StepEngine` with the hooks of its run mode and the
way requests come in.  This module holds the normal-mode backend, which is also the base of the
PD node backends (``prefill_backend.py``, ``decode_backend.py``); ``build_backend(run_mode)`` in
this package picks the class.  A backend knows nothing about processes, shared memory or zmq:
the rank process feeds it requests and turns its :class:`~.step_report.StepReport` into
shared-memory writes and messages, and the simulator drives the same classes in virtual time.

Adding a run mode: subclass :class:`ModeBackend`, set ``run_mode`` and, if it classifies
requests differently, ``classifier``; override the hooks (``on_prompt_done``, ``can_pause``)
and add the intake methods the mode needs; register it in ``backend_registry.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from lightllm.server.core.objs.finish_status import FINISH_ERROR
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.admission import check_request
from lightllm.server.model_rank.scheduling.step_engine import StepEngine
from lightllm.server.model_rank.scheduling.request_state import ReqState

if TYPE_CHECKING:
    from lightllm.server.core.objs.request_spec import RequestSpec


class ModeBackend(StepEngine):
    """Normal mode: a request is prefilled, then decoded here until it finishes."""

    run_mode: ClassVar[str] = "normal"

    def add_request(self, request_id: int, spec: "RequestSpec", shm_index: int = -1) -> InferReq:
        """Create ``spec``'s :class:`InferReq` (snapshotting the prefill counter) and join it.

        ``shm_index``: the request's shared-memory slot (-1: none, as in the simulator).  The
        spec is not checked again here: it was checked where it was built and, on a server, by
        rank 0's screen (:meth:`check_request`) before any rank admits it.
        """
        req = self.new_request(request_id, spec, shm_index)
        self.join(req)
        return req

    def new_request(self, request_id: int, spec: "RequestSpec", shm_index: int = -1) -> InferReq:
        """``spec``'s :class:`InferReq`, not yet joined."""
        return InferReq.from_spec(request_id, spec, shm_index=shm_index,
                                  arrival_processed_prefill_tokens=self.counter.snapshot())

    def check_request(self, spec: "RequestSpec") -> None:
        """Raise :class:`~.admission.RequestRejected` unless this rank can run ``spec`` (rank 0's screen)."""
        check_request(
            spec,
            vocab_size=self.executor.vocab_size,
            max_req_total_len=self.max_req_total_len,
            grammar_enabled=self.executor.grammar_enabled,
        )

    def reject(self, request_id: int, shm_index: int = -1, status: int = FINISH_ERROR) -> None:
        """Finish a request that could not be admitted with ``status`` (default ``FINISH_ERROR``) in the next step."""
        req = InferReq(request_id=request_id, prompt_ids=[], shm_index=shm_index)
        req.move_to(ReqState.FINISHED)
        self._ended.append((req, status))
