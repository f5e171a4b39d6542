"""The model backend's step: filter, order, select under budget, allocate, forward, post-process.

``ModeBackend`` knows nothing about processes, shared memory or zmq: the rank process feeds it
requests and turns its :class:`StepReport` into shared-memory writes and messages.  That keeps
the step testable in one process with a real model.

One request never takes the rank down: a request whose parameters fail the admission check
(``admission.py``) is rejected, and a request whose sampling fails (``row_sampling.py``) is
finished, both with ``FINISH_ERROR`` (its client gets an error) while the rest of the batch goes
on.  Under tensor parallelism rank 0's sampled tokens are broadcast, and a failed row travels as
token ``-1``, so every rank finishes the same requests.  A failing forward pass fails the
requests of that batch on a single rank; with several ranks it cannot be recovered (their
collectives would be out of step) and is raised.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from lightllm.common.basemodel.forward_batch import ForwardBatch
from lightllm.common.basemodel.transformer_model import DecoderOnlyTransformer
from lightllm.common.sampling import Sampler, SamplingParams
from lightllm.server.core.objs.finish_status import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from lightllm.server.router.model_infer.infer_context import InferenceContext
from lightllm.server.router.model_infer.infer_req import InferReq
from lightllm.server.router.model_infer.mode_backend.admission import check_request
from lightllm.server.router.model_infer.mode_backend.prefill_queue_strategy import PrefillQueueStrategy
from lightllm.server.router.model_infer.mode_backend.processed_token_counter import ProcessedPrefillTokenCounter
from lightllm.server.router.model_infer.mode_backend.prompt_logprobs import (
    PromptLogprobEntry,
    collect_prompt_logprobs,
    prefill_logit_rows,
)
from lightllm.server.router.model_infer.mode_backend.row_sampling import FAILED_TOKEN, sample_rows
from lightllm.server.router.model_infer.mode_backend.step_planner import StepPlan, StepPlanner, submit_prefill
from lightllm.server.router.model_infer.mode_backend.structured_output import GrammarConstraints

TokenSync = Callable[[torch.Tensor], torch.Tensor]

log = logging.getLogger("lightllm.model_rank")

# A forward pass that fails step after step means the model or device is broken, not a request.
MAX_CONSECUTIVE_FORWARD_FAILURES = 3


@dataclass
class StepReport:
    """What one step produced, for the caller to publish.

    ``tokens`` holds ``(request, token_id, logprob)`` in generation order; ``finished`` the
    requests that ended this step with their finish status (they are already released).
    ``top_logprobs`` maps the request id of a request that asked for alternatives to this
    step's ``(token_id, logprob)`` pairs, most likely first.
    """

    tokens: List[Tuple[InferReq, int, float]] = field(default_factory=list)
    top_logprobs: Dict[int, List[Tuple[int, float]]] = field(default_factory=dict)
    # ``(request, [(position, logprob, top)])`` of prompt tokens whose logprobs this step computed.
    prompt_logprobs: List[Tuple[InferReq, List[PromptLogprobEntry]]] = field(default_factory=list)
    finished: List[Tuple[InferReq, int]] = field(default_factory=list)
    paused: List[InferReq] = field(default_factory=list)
    prefill_token_num: int = 0
    decode_batch_size: int = 0
    schedule_seconds: float = 0.0
    forward_seconds: float = 0.0
    post_seconds: float = 0.0

    @property
    def did_work(self) -> bool:
        """Whether any forward ran."""
        return self.prefill_token_num > 0 or self.decode_batch_size > 0


class ModeBackend:
    """Runs the requests of one rank, one scheduling step at a time (normal mode)."""

    no_decode = False
    strict_prefill = False

    def __init__(
        self,
        model: DecoderOnlyTransformer,
        context: InferenceContext,
        strategy: PrefillQueueStrategy,
        planner: StepPlanner,
        sampler: Sampler,
        eos_token_ids: Sequence[int],
        max_req_total_len: int,
        token_sync: Optional[TokenSync] = None,
        grammar: Optional[GrammarConstraints] = None,
    ):
        self.model = model
        # Structured output; None refuses requests that carry a grammar.
        self.grammar = grammar
        self.context = context
        self.strategy = strategy
        self.planner = planner
        self.sampler = sampler
        self.eos_token_ids = list(eos_token_ids)
        self.max_req_total_len = max_req_total_len
        self.counter = ProcessedPrefillTokenCounter()
        # Under tensor parallelism rank 0's sampled tokens are the truth every rank follows.
        self.token_sync = token_sync
        self.vocab_size = model.config.vocab_size
        self._pending_aborts: set[int] = set()
        self._rejected: List[InferReq] = []
        self._forward_failures = 0

    # --- requests in and out -----------------------------------------------------------------
    def add_request(
        self,
        request_id: int,
        prompt_ids: List[int],
        params: SamplingParams,
        high_priority_request: bool = False,
        shm_index: int = -1,
        infer_high_priority: int = 0,
    ) -> InferReq:
        """Create the request's :class:`InferReq` (snapshotting the prefill counter) and attach it.

        Raises :class:`~.admission.RequestRejected` (before touching any state) when
        :meth:`check_request` refuses the request.
        """
        self.check_request(prompt_ids, params)
        req = InferReq(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            max_new_tokens=params.max_new_tokens,
            arrival_processed_prefill_tokens=self.counter.snapshot(),
            infer_high_priority=infer_high_priority,
            high_priority_request=high_priority_request,
            shm_index=shm_index,
            sampling=params,
        )
        self.context.add(req)
        return req

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise :class:`~.admission.RequestRejected` unless this rank can run the request."""
        check_request(
            prompt_ids,
            params,
            vocab_size=self.vocab_size,
            max_req_total_len=self.max_req_total_len,
            grammar_enabled=self.grammar is not None,
        )

    def reject(self, request_id: int, shm_index: int = -1) -> None:
        """Finish a request that could not be admitted with ``FINISH_ERROR`` in the next step."""
        self._rejected.append(InferReq(request_id=request_id, prompt_ids=[], shm_index=shm_index, finished=True))

    def abort(self, request_id: int) -> None:
        """Mark a request aborted; it is released at the start of the next step."""
        req = self.context.requests.get(request_id)
        if req is not None:
            req.aborted = True

    @property
    def has_work(self) -> bool:
        """Whether any request is live (or a rejected one still has to be reported)."""
        return bool(self.context.requests) or bool(self._rejected)

    # --- the step ------------------------------------------------------------------------------
    def step(self) -> StepReport:
        """One scheduling step over every live request."""
        report = StepReport()
        started = time.perf_counter()
        report.finished.extend((req, FINISH_ERROR) for req in self._rejected)
        self._rejected = []
        self.filter_finished(report)
        ready = self.resume_paused()
        ordered = self.order(ready)
        plan = self.select(ordered)
        self.pause_starved(plan, report)
        report.schedule_seconds = time.perf_counter() - started
        if plan.has_prefill:
            self.run_prefill(plan, report)
        if plan.decode_reqs:
            self.run_decode(plan.decode_reqs, report)
        return report

    def filter_finished(self, report: StepReport) -> None:
        """Release aborted requests (finished ones were released when they finished)."""
        for req in [r for r in self.context.requests.values() if r.aborted]:
            self.context.release(req)
            report.finished.append((req, FINISH_ABORT))

    def resume_paused(self) -> List[InferReq]:
        """Ready requests; paused ones rejoin when the KV cache could hold what they need."""
        ready: List[InferReq] = []
        for req in self.context.requests.values():
            if req.paused:
                if self.context.allocatable_token_num() < req.total_len:
                    continue
                self.context.resume(req)
            ready.append(req)
        return ready

    def order(self, ready: List[InferReq]) -> List[InferReq]:
        """Apply the prefill-queue strategy (decode requests stay in front, in order)."""
        return self.strategy.reorder(
            ready, self.counter.value, no_decode=self.no_decode, strict_prefill=self.strict_prefill
        )

    def select(self, ordered: List[InferReq]) -> StepPlan:
        """Pick decode requests and prefill chunks under the token budget and free KV."""
        return self.planner.plan(
            ordered,
            self.context.allocatable_token_num,
            no_decode=self.no_decode,
            strict_prefill=self.strict_prefill,
        )

    def pause_starved(self, plan: StepPlan, report: StepReport) -> None:
        """Decode requests that found no KV slot give theirs back and wait for capacity."""
        for req in plan.kv_starved_decode:
            self.context.pause(req)
            report.paused.append(req)
        if not plan.has_prefill and not plan.decode_reqs:
            # Partly prefilled requests can hold the whole cache when admission overcommits
            # (router_token_ratio > 1); free the newest one so the others can move.
            holders = [r for r in self.context.requests.values() if not r.paused and r.cur_kv_len > 0]
            if holders:
                victim = holders[-1]
                self.context.pause(victim)
                report.paused.append(victim)

    def run_prefill(self, plan: StepPlan, report: StepReport) -> None:
        """Allocate KV for the chunks, run one prefill forward, sample where prompts complete."""
        chunks = plan.prefill_chunks
        slots = self.context.alloc_slots(sum(c.token_num for c in chunks))
        offset = 0
        token_ids: List[List[int]] = []
        for chunk in chunks:
            self.context.record_chunk(chunk.req, chunk.start, slots[offset : offset + chunk.token_num])
            token_ids.append(chunk.req.token_slice(chunk.start, chunk.end))
            offset += chunk.token_num
        batch = ForwardBatch.build(
            token_ids, [c.start for c in chunks], [c.req.req_row for c in chunks], slots, self.model.device
        )
        last_rows, prompt_rows = prefill_logit_rows(batch, chunks)
        report.prefill_token_num = submit_prefill(plan, self.counter)
        started = time.perf_counter()
        logits = self._forward(batch, slots, [c.req for c in chunks], report)
        report.forward_seconds += time.perf_counter() - started
        if logits is None:
            return
        report.prompt_logprobs.extend(collect_prompt_logprobs(logits, prompt_rows))
        done_rows: List[int] = []
        done_reqs: List[InferReq] = []
        for last_row, chunk in zip(last_rows, chunks):
            chunk.req.cur_kv_len = chunk.end
            if chunk.end == chunk.req.total_len:
                done_rows.append(last_row)
                done_reqs.append(chunk.req)
        if done_reqs:
            self.sample_and_finish(logits[done_rows], done_reqs, report)

    def run_decode(self, reqs: List[InferReq], report: StepReport) -> None:
        """One token for each decode request."""
        slots = self.context.alloc_slots(len(reqs))
        for req, slot in zip(reqs, slots):
            self.context.record_chunk(req, req.cur_kv_len, slot.view(1))
        batch = ForwardBatch.build(
            [[req.token_at(req.cur_kv_len)] for req in reqs],
            [req.cur_kv_len for req in reqs],
            [req.req_row for req in reqs],
            slots,
            self.model.device,
        )
        report.decode_batch_size = len(reqs)
        started = time.perf_counter()
        logits = self._forward(batch, slots, reqs, report)
        report.forward_seconds += time.perf_counter() - started
        if logits is None:
            return
        for req in reqs:
            req.cur_kv_len += 1
        self.sample_and_finish(logits, reqs, report)

    def _forward(
        self, batch: ForwardBatch, slots: torch.Tensor, reqs: List[InferReq], report: StepReport
    ) -> Optional[torch.Tensor]:
        """Run the forward pass; on a single rank a failure fails this batch's requests only.

        The step's freshly allocated KV slots go back to the allocator and the requests are
        released with ``FINISH_ERROR`` (their earlier KV is handed back as on any finish), so
        the KV accounting stays exact.  Returns None when the batch failed.
        """
        try:
            logits = self.model.forward(batch, self.context.kv_cache, self.context.req_manager.req_to_token)
        except Exception:
            self._forward_failures += 1
            if self.token_sync is not None or self._forward_failures >= MAX_CONSECUTIVE_FORWARD_FAILURES:
                raise
            log.exception("forward pass failed; finishing its %d request(s) with an error", len(reqs))
            self.context.kv_cache.free(slots)
            for req in reqs:
                self._finish(req, FINISH_ERROR, report)
            return None
        self._forward_failures = 0
        return logits

    def _finish(self, req: InferReq, status: int, report: StepReport) -> None:
        req.finished = True
        self.context.release(req)
        report.finished.append((req, status))

    def sample_and_finish(self, logits: torch.Tensor, reqs: List[InferReq], report: StepReport) -> None:
        """Sample next tokens, append them, and release requests that hit a stop condition.

        A request whose sampling failed (token ``FAILED_TOKEN`` after rank 0's tokens were
        shared) is released with ``FINISH_ERROR``.
        """
        started = time.perf_counter()
        grammar_failed: set[int] = set()
        if self.grammar is not None:
            try:
                logits = self.grammar.mask(logits, reqs)
            except Exception:  # noqa: BLE001 - a broken grammar fails its requests, not the batch
                log.exception("structured-output mask failed; finishing the constrained requests with an error")
                grammar_failed = {r.request_id for r in reqs if self.grammar.constrained(r)}
        tokens, logprobs, tops = sample_rows(self.sampler, logits, reqs, self.eos_token_ids)
        if self.token_sync is not None:
            tokens = self.token_sync(tokens)
        for req, token, logprob, top in zip(reqs, tokens.tolist(), logprobs, tops):
            if token == FAILED_TOKEN or req.request_id in grammar_failed:
                self._finish(req, FINISH_ERROR, report)
                continue
            req.output_ids.append(token)
            report.tokens.append((req, token, logprob))
            if top:
                report.top_logprobs[req.request_id] = top
            status = self.finish_status(req, token)
            if self.grammar is not None:
                ended = self.grammar.accept(req, token)  # None for unconstrained requests
                if ended == "error":
                    status = FINISH_ERROR
                elif ended == "stop" and not status:
                    status = FINISH_STOP
            if status:
                self._finish(req, status, report)
        if self.grammar is not None:
            self.grammar.forget(self.context.requests)
        report.post_seconds += time.perf_counter() - started

    def finish_status(self, req: InferReq, token: int) -> int:
        """Finish status after ``token`` was appended (0 while the request goes on)."""
        params: SamplingParams = req.sampling
        if token in params.stop_token_ids:
            return FINISH_STOP
        if not params.ignore_eos and token in self.eos_token_ids:
            return FINISH_STOP
        if len(req.output_ids) >= params.max_new_tokens or req.total_len >= self.max_req_total_len:
            return FINISH_LENGTH
        return 0
