"""The model backend's step: filter, order, select under budget, allocate, forward, post-process.

``ModeBackend`` knows nothing about processes, shared memory or zmq: the rank process feeds it
requests and turns its :class:`StepReport` into shared-memory writes and messages.  That keeps
the step testable in one process with a real model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from lightllm.common.basemodel.forward_batch import ForwardBatch
from lightllm.common.basemodel.transformer_model import DecoderOnlyTransformer
from lightllm.common.sampling import Sampler, SamplingBatch, SamplingParams
from lightllm.server.core.objs.finish_status import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from lightllm.server.router.model_infer.infer_context import InferenceContext
from lightllm.server.router.model_infer.infer_req import InferReq
from lightllm.server.router.model_infer.mode_backend.prefill_queue_strategy import PrefillQueueStrategy
from lightllm.server.router.model_infer.mode_backend.processed_token_counter import ProcessedPrefillTokenCounter
from lightllm.server.router.model_infer.mode_backend.step_planner import StepPlan, StepPlanner, submit_prefill

TokenSync = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class StepReport:
    """What one step produced, for the caller to publish.

    ``tokens`` holds ``(request, token_id, logprob)`` in generation order; ``finished`` the
    requests that ended this step with their finish status (they are already released).
    """

    tokens: List[Tuple[InferReq, int, float]] = field(default_factory=list)
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
    ):
        self.model = model
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
        """Create the request's :class:`InferReq` (snapshotting the prefill counter) and attach it."""
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

    def abort(self, request_id: int) -> None:
        """Mark a request aborted; it is released at the start of the next step."""
        req = self.context.requests.get(request_id)
        if req is not None:
            req.aborted = True

    @property
    def has_work(self) -> bool:
        """Whether any request is live."""
        return bool(self.context.requests)

    # --- the step ------------------------------------------------------------------------------
    def step(self) -> StepReport:
        """One scheduling step over every live request."""
        report = StepReport()
        started = time.perf_counter()
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
        report.prefill_token_num = submit_prefill(plan, self.counter)
        started = time.perf_counter()
        logits = self.model.forward(batch, self.context.kv_cache, self.context.req_manager.req_to_token)
        report.forward_seconds += time.perf_counter() - started
        done_rows = []
        for row, chunk in enumerate(chunks):
            chunk.req.cur_kv_len = chunk.end
            if chunk.end == chunk.req.total_len:
                done_rows.append(row)
        if done_rows:
            reqs = [chunks[r].req for r in done_rows]
            self.sample_and_finish(logits[done_rows], reqs, report)

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
        logits = self.model.forward(batch, self.context.kv_cache, self.context.req_manager.req_to_token)
        report.forward_seconds += time.perf_counter() - started
        for req in reqs:
            req.cur_kv_len += 1
        self.sample_and_finish(logits, reqs, report)

    def sample_and_finish(self, logits: torch.Tensor, reqs: List[InferReq], report: StepReport) -> None:
        """Sample next tokens, append them, and release requests that hit a stop condition."""
        started = time.perf_counter()
        batch = SamplingBatch.build(
            [r.sampling for r in reqs],
            [r.prompt_ids for r in reqs],
            [r.output_ids for r in reqs],
            self.eos_token_ids,
            logits.shape[1],
            logits.device,
        )
        out = self.sampler.sample(logits, batch)
        tokens = out.next_token_ids
        if self.token_sync is not None:
            tokens = self.token_sync(tokens)
        for req, token, logprob in zip(reqs, tokens.tolist(), out.logprobs.tolist()):
            req.output_ids.append(token)
            report.tokens.append((req, token, logprob))
            status = self.finish_status(req, token)
            if status:
                req.finished = True
                self.context.release(req)
                report.finished.append((req, status))
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
