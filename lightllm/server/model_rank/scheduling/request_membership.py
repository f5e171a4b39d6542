"""Who is in a rank's batch: requests join, may be asked to end, pause, resume and leave.

Each change of membership keeps the KV view, the executor and the prefill-queue strategy in step
with the live set: a joining request has its cached prefix attached and its arrival numbered (a
constrained one is held until its grammar is ready), a paused one gives its KV back and takes it
again on resume, a leaving one releases its KV and its executor state.  Requests that end between
steps and tokens received between steps wait here for the next step's report.

:class:`~.step_engine.StepEngine` adds the step's phases on top; like the engine this imports no
torch, and every TP rank changes membership identically (admission order, no clock).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.kv_view import KvView
from lightllm.server.model_rank.scheduling.model_executor import ModelExecutor
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import PrefillQueueStrategy
from lightllm.server.model_rank.scheduling.request_state import ReqState
from lightllm.server.model_rank.scheduling.step_report import StepReport


class RequestMembership:
    """The live requests of one rank and their joins, pauses, resumes and departures.

    Args:
        executor: computes the planned work (and compiles a constrained request's grammar).
        kv: the KV cache as the engine sees it.
        strategy: the prefill-queue strategy, which numbers each arrival.
    """

    def __init__(self, executor: ModelExecutor, kv: KvView, strategy: PrefillQueueStrategy) -> None:
        self.executor = executor
        self.kv = kv
        self.strategy = strategy
        # Live requests in admission order (the order ``resume`` and the strategies start from).
        self.requests: Dict[int, InferReq] = {}
        # Requests that ended between steps (rejected, finished on hand-in or hand-off); the next
        # step reports them, so the caller publishes every finish from one place.
        self._ended: List[Tuple[InferReq, int]] = []
        # Tokens requests received between steps (a decode node's first token, sampled by the
        # prefill node); the next step reports them ahead of its own, for the same reason.
        self._carried: List[Tuple[InferReq, int, float]] = []
        # Requests that have left, and how many had left when each paused request paused: a
        # paused request waits for room freed by a departure (see StepEngine.resume_paused).
        self._departures = 0
        self._paused_at: Dict[int, int] = {}

    def join(self, req: InferReq) -> None:
        """Take in a new request: it joins the live set, the KV view attaches its cached prefix and
        the strategy numbers its arrival; a constrained one is held while its grammar compiles."""
        if req.request_id in self.requests:
            raise ValueError(f"request {req.request_id} is already running")
        if req.state is not ReqState.WAITING:
            raise ValueError(f"request {req.request_id} must join in state waiting, not {req.state.value}")
        if req.sampling is not None and req.sampling.grammar is not None:
            self.executor.start_grammar(req)  # first: if it raises, the rejected request left no trace
            req.grammar_held = True  # until every rank marks its grammar ready (ModeBackend.grammars_ready)
        try:
            self.kv.attach(req)
        except BaseException:
            self.executor.forget(req)  # the rejected request's compile has no waiter any more
            raise
        self.requests[req.request_id] = req
        self.strategy.admit(req)

    def abort(self, request_id: int) -> None:
        """Ask for a request to end; it is released at the start of the next step.

        A request whose KV is being transferred ends when the transfer does (its KV must not be
        reused while another process reads or writes it).
        """
        req = self.requests.get(request_id)
        if req is not None:
            req.abort_requested = True

    def carry_token(self, req: InferReq, token_id: int, logprob: float = 0.0) -> None:
        """Report ``token_id``, which ``req`` received between steps, first in the next step's tokens."""
        self._carried.append((req, token_id, logprob))

    @property
    def has_work(self) -> bool:
        """Whether any request is live or an ended request or carried token still has to be reported."""
        return bool(self.requests) or bool(self._ended) or bool(self._carried)

    def finish(self, req: InferReq, status: int, report: Optional[StepReport] = None) -> None:
        """Release ``req`` with ``status``; reported in ``report``, or in the next step's report."""
        self._leave(req, ReqState.FINISHED, status, report.finished if report is not None else self._ended)

    def _pause(self, req: InferReq, report: StepReport) -> None:
        # Beyond its cached count it computed some of its prompt: its first scheduling is over.  One
        # holding only cached tokens (a stalled step pauses the newest holder, even a waiting one)
        # counts its hits again when it resumes.
        req.cache_count_final = req.cache_count_final or req.cur_kv_len > req.prompt_cache_len
        self.kv.pause(req)
        req.move_to(ReqState.PAUSED)
        self._paused_at[req.request_id] = self._departures
        report.paused.append(req)

    def _resume(self, req: InferReq) -> None:
        self.kv.resume(req)
        if not req.cache_count_final:
            req.prompt_cache_len = req.cur_kv_len  # what the cache gives it now, as at a join
        req.move_to(ReqState.PREFILLING)
        self._paused_at.pop(req.request_id, None)

    def _leave(self, req: InferReq, state: ReqState, status: int, finished: List[Tuple[InferReq, int]]) -> None:
        req.move_to(state)
        self.kv.release(req)
        del self.requests[req.request_id]
        self._paused_at.pop(req.request_id, None)
        self._departures += 1
        self.executor.forget(req)
        finished.append((req, status))
