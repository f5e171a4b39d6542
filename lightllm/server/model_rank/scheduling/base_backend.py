"""``ModeBackend``: the step engine plus request intake, for one run mode.

A mode backend is the :class:`~.step_engine.StepEngine` with the hooks of its run mode and the
way requests come in.  This module holds the normal-mode backend, which is also the base of the
PD node backends (``prefill_backend.py``, ``decode_backend.py``); ``build_backend(run_mode)`` in
this package picks the class.  A backend knows nothing about processes, shared memory or zmq:
the rank process feeds it requests and turns its :class:`~.step_report.StepReport` into
shared-memory writes and messages, and the simulator drives the same classes in virtual time.

Adding a run mode: subclass :class:`ModeBackend`, set ``run_mode`` and, if it classifies
requests differently, ``classifier``; override the hooks (``on_prompt_done``, ``can_pause``)
and add the intake methods the mode needs; register it in ``__init__.py``.
"""

from __future__ import annotations

from typing import Any, ClassVar, List, Sequence

from lightllm.server.core.objs.finish_status import FINISH_ERROR
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.admission import RequestRejected, check_request
from lightllm.server.model_rank.scheduling.step_engine import StepEngine
from lightllm.server.model_rank.scheduling.request_state import ReqState


class ModeBackend(StepEngine):
    """Normal mode: a request is prefilled, then decoded here until it finishes."""

    run_mode: ClassVar[str] = "normal"

    def add_request(self, request_id: int, prompt_ids: List[int], params: Any, **fields: Any) -> InferReq:
        """Check a request, create its :class:`InferReq` (snapshotting the prefill counter), join it.

        ``fields`` are :meth:`new_request`'s optional keywords.  Raises
        :class:`~.admission.RequestRejected` (before touching any state) when
        :meth:`check_request` refuses the request.
        """
        req = self.new_request(request_id, prompt_ids, params, **fields)
        self.join(req)
        return req

    def new_request(
        self,
        request_id: int,
        prompt_ids: List[int],
        params: Any,
        high_priority_request: bool = False,
        shm_index: int = -1,
        infer_high_priority: int = 0,
        segment_index: int = 0,
        generated_before: int = 0,
    ) -> InferReq:
        """A checked, not yet joined :class:`InferReq` (raises ``RequestRejected``)."""
        self.check_request(prompt_ids, params)
        if isinstance(generated_before, bool) or not isinstance(generated_before, int) or not (
            0 <= generated_before < len(prompt_ids)
        ):
            raise RequestRejected(
                f"generated_before must be an int in [0, {len(prompt_ids) - 1}], got {generated_before!r}"
            )
        return InferReq(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            max_new_tokens=params.max_new_tokens,
            arrival_processed_prefill_tokens=self.counter.snapshot(),
            infer_high_priority=infer_high_priority,
            high_priority_request=high_priority_request,
            segment_index=segment_index,
            generated_before=generated_before,
            shm_index=shm_index,
            sampling=params,
        )

    def check_request(self, prompt_ids: Sequence[int], params: Any) -> None:
        """Raise :class:`~.admission.RequestRejected` unless this rank can run the request."""
        check_request(
            prompt_ids,
            params,
            vocab_size=self.executor.vocab_size,
            max_req_total_len=self.max_req_total_len,
            grammar_enabled=self.executor.grammar_enabled,
        )

    def reject(self, request_id: int, shm_index: int = -1, status: int = FINISH_ERROR) -> None:
        """Finish a request that could not be admitted with ``status`` (default ``FINISH_ERROR``) in the next step."""
        req = InferReq(request_id=request_id, prompt_ids=[], shm_index=shm_index)
        req.move_to(ReqState.FINISHED)
        self._ended.append((req, status))
