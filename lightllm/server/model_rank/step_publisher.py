"""Rank 0's side of a finished step: its results into shared memory, the messages that announce
them, and the counters /metrics reads.

Write order (the shared-memory rules are in :mod:`lightllm.server.core.objs.shm_req_buffer`):
when each request was first scheduled and its prompt-cache length come before its first token;
prompt logprobs before the token sampled by the same prefill; every token before its request's
finish status; then one :class:`StepOutput` to the detokenizer naming, per request, the
``output_len`` this step published (it reads no further), and the released requests to the router.

Rank 0's messages for the HTTP process (a PD node's notices, :meth:`StepPublisher.notify`) ride
in the same :class:`StepOutput`, ahead of the step's updates: they were raised before the step
ran, and one path keeps them ahead of the tokens they explain.  When no step runs,
:meth:`StepPublisher.flush_notices` sends them on their own.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from typing import Any, Dict, List, Tuple

from lightllm.server.core.objs.iteration_tokens_histogram import IterationTokenCounts
from lightllm.server.core.objs.io_messages import RequestsReleased, StepOutput
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.core.objs.shm_stats import ShmStats
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.backend_registry import ModeBackend
from lightllm.server.model_rank.prefill_wait_tracker import PrefillWaitTracker
from lightllm.server.model_rank.scheduling.step_report import StepReport


class StepPublisher:
    """Publishes each step's report (rank 0 only; the other ranks publish nothing).

    Args:
        shm: the request records.
        stats: the counters /metrics reads.
        backend: the rank's backend (its requests and processed-prefill counter feed the stats).
        context: the KV view (its usage feeds the stats).
        wait_tracker: prefill waits, also fed by admission.
        to_detokenization, to_router: push sockets (zmq) for the step's messages.
    """

    def __init__(
        self,
        shm: ShmReqBuffer,
        stats: ShmStats,
        backend: ModeBackend,
        context: InferenceContext,
        wait_tracker: PrefillWaitTracker,
        to_detokenization: Any,
        to_router: Any,
    ) -> None:
        self.shm = shm
        self.stats = stats
        self.backend = backend
        self.context = context
        self.wait_tracker = wait_tracker
        self.to_detokenization = to_detokenization
        self.to_router = to_router
        self.steps = 0
        self.preemptions = 0  # requests paused for KV, cumulative (vLLM's preemptions)
        # Tokens per step that ran a forward (vLLM's iteration_tokens_total); rank 0 alone
        # publishes, so a TP group counts each step once.
        self.iteration_tokens = IterationTokenCounts()
        # Messages for the HTTP process raised since the last StepOutput (see the module docstring).
        self._notices: List[Any] = []

    def start(self, kv_total_tokens: int) -> None:
        """Publish the fixed KV capacity and the first counters (before the rank reports ready)."""
        self.stats.set("kv_total_tokens", kv_total_tokens)
        self.publish_stats()

    def notify(self, message: Any) -> None:
        """Queue ``message`` for the HTTP process; it leaves with the next step output."""
        self._notices.append(message)

    def flush_notices(self) -> None:
        """Send the queued notices now, in a step output of their own (no step runs to carry them)."""
        if self._notices:
            notices, self._notices = self._notices, []
            self.to_detokenization.send_pyobj(StepOutput(notices=notices))

    def publish(self, report: StepReport) -> None:
        """Write the step's tokens and finish states, announce them, update the counters."""
        started = time.perf_counter()
        self.steps += 1
        self.preemptions += len(report.paused)
        if report.forward_token_num > 0:
            self.iteration_tokens.observe(report.forward_token_num)
        self._stamp_first_scheduled(report)
        for req in report.prompt_cache_grown:  # before the first token, which reports it
            self.shm.set_prompt_cache_len(req.shm_index, req.request_id, req.prompt_cache_len)
        updates: Dict[int, Tuple[int, int, int]] = {}
        # Prompt logprobs come from the prefill that also samples the first token: written first.
        shm = self.shm
        for req, entries in report.prompt_logprobs:
            shm.publish_prompt_logprobs(req.shm_index, req.request_id, entries)
        self._publish_tokens(report, updates)
        released: List[Tuple[int, int]] = []
        for req, status in report.finished:
            shm.set_finish_status(req.shm_index, req.request_id, status)
            if req.request_id not in updates:
                updates[req.request_id] = (req.request_id, req.shm_index, shm.published_output_len(req.shm_index, req.request_id))
            released.append((req.request_id, req.shm_index))
        notices, self._notices = self._notices, []
        if updates or released or notices:
            self.to_detokenization.send_pyobj(StepOutput(list(updates.values()), released, notices))
        if released:
            self.to_router.send_pyobj(RequestsReleased([r for r, _ in released]))
        self.wait_tracker.on_step(
            (req for req, _, _ in report.tokens),
            (req for req, _ in report.finished),
            self.backend.requests.values(),
            self.backend.counter.value,
        )
        self.publish_stats()
        self._add_time("step_schedule_us", report.schedule_seconds)
        self._add_time("step_forward_us", report.forward_seconds)
        self._add_time("step_sample_us", report.post_seconds)
        self._add_time("step_publish_us", time.perf_counter() - started)

    def _publish_tokens(self, report: StepReport, updates: Dict[int, Tuple[int, int, int]]) -> None:
        """Write the step's tokens; ``updates`` gets each request's new ``output_len``.

        Requests with one token and no alternatives go in one indexed write per field; a request
        with top logprobs, or with two tokens in the step (a decode node's carried first token
        and its next one), goes token by token, in report order.
        """
        shm = self.shm
        tops = report.top_logprobs
        tokens_of = Counter(req.request_id for req, _, _ in report.tokens)
        batched, one_by_one = [], []
        for entry in report.tokens:
            request_id = entry[0].request_id
            (one_by_one if request_id in tops or tokens_of[request_id] > 1 else batched).append(entry)
        if batched:
            lengths = shm.publish_tokens([req.shm_index for req, _, _ in batched],
                                         [req.request_id for req, _, _ in batched],
                                         [token for _, token, _ in batched],
                                         [logprob for _, _, logprob in batched])
            for (req, _, _), length in zip(batched, lengths):
                updates[req.request_id] = (req.request_id, req.shm_index, length)
        for req, token, logprob in one_by_one:
            length = shm.publish_token(req.shm_index, req.request_id, token, logprob, tops.get(req.request_id))
            updates[req.request_id] = (req.request_id, req.shm_index, length)

    def _stamp_first_scheduled(self, report: StepReport) -> None:
        """Publish when each request was first selected (vLLM's queue time ends there): when the
        step's plan was made, before its forwards, so the first chunk's forward counts as prefill.

        Written before any of the step's tokens, so the HTTP side has it with the first output.
        A prompt whose prefix-cache hit leaves one token runs as decode work, so both lists count.
        """
        plan = report.plan
        if plan is None:
            return
        selected = report.selected_ns or time.monotonic_ns()
        for req in itertools.chain(plan.decode_reqs, plan.prefill_reqs):
            if not req.scheduled_ns:
                req.scheduled_ns = selected
                self.shm.set_scheduled_ns(req.shm_index, req.request_id, selected)

    def _add_time(self, field: str, seconds: float) -> None:
        self.stats.set(field, self.stats.get(field) + int(seconds * 1e6))

    def publish_stats(self) -> None:
        """Write the KV, queue-wait and step counters."""
        ctx = self.context
        stats = self.stats
        stats.set("kv_free_tokens", ctx.kv_cache.available)
        stats.set("kv_cached_tokens", ctx.radix_cache.total_token_num if ctx.radix_cache else 0)
        stats.set("kv_allocatable_tokens", ctx.allocatable_token_num())
        # A decode node's free KV for its PD master is what no reservation was promised.
        stats.set("kv_promised_tokens", self.backend.promised_token_num())
        stats.set("paused_requests", sum(1 for r in self.backend.requests.values() if r.is_paused))
        stats.set("grammar_held_requests", sum(1 for r in self.backend.requests.values() if r.grammar_held))
        stats.set("preemptions", self.preemptions)
        stats.set("processed_prefill_tokens", self.backend.counter.value)
        stats.set("backend_steps", self.steps)
        for name, value in self.wait_tracker.fields().items():
            stats.set(name, value)
        for name, value in self.iteration_tokens.fields().items():
            stats.set(name, value)
