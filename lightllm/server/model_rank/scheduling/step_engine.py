"""One scheduling step, in plain Python: the part of a model rank that decides what runs.

    filter   -> release aborted requests
    resume   -> paused requests rejoin once the KV cache could hold them (a constrained request
                only runs once its grammar is ready); requests still prefilling share their
                computed prompt tokens through the prefix cache and pick up what others computed
    classify -> the mode's classifier splits the ready requests into decode and prefill, once,
                so the strategy and the planner cannot disagree about which is which
    order    -> the prefill-queue strategy orders the prefill requests (decode ones keep
                admission order)
    select   -> the step planner, under the token budget and the allocatable KV
    pause    -> decode requests left without KV give theirs back (and, when nothing at all could
                run, the newest KV holder does, so over-committed admission cannot deadlock)
    execute  -> reserve KV for the selected work, hand it to the ModelExecutor (one forward for
                a mixed plan: decode rows ride in the prefill forward)
    finish   -> append sampled tokens, apply stop rules, release finished requests

The engine imports no torch: it sees requests, a :class:`~.kv_view.KvView` and a
:class:`~.model_executor.ModelExecutor`.  A model rank plugs in the token-slot KV cache and the
torch executor; the scheduling simulator plugs in a token count and a cost model, so both run
exactly this code.  Mode backends (``backend_registry.py``) are subclasses that change the
classifier and the hooks :meth:`StepEngine.on_prompt_done` and :meth:`StepEngine.can_pause`.
Who is in the batch (joining, aborts, pauses and resumes, departures, a constrained request held
for its grammar) is :class:`~.request_membership.RequestMembership`, which the engine extends.

Every TP rank runs the same engine over the same requests, so every decision here must be
deterministic: no wall clock, no randomness, ties by admission order or request id.
"""

from __future__ import annotations

import time
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple

from lightllm.server.core.objs.finish_status import (FINISH_ABORT, FINISH_ERROR, FINISH_GRAMMAR_FAILED, FINISH_LENGTH,
                                                    FINISH_STOP)
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.kv_view import KvView
from lightllm.server.model_rank.scheduling.model_executor import ExecutionResult, ModelExecutor, SampledToken
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import PrefillQueueStrategy
from lightllm.server.model_rank.scheduling.processed_token_counter import ProcessedPrefillTokenCounter
from lightllm.server.model_rank.scheduling.request_classifier import (
    NORMAL_CLASSIFIER,
    ClassifiedRequests,
    RequestClassifier,
)
from lightllm.server.model_rank.scheduling.request_membership import RequestMembership
from lightllm.server.model_rank.scheduling.step_planner import PrefillChunk, StepPlan, StepPlanner, submit_prefill
from lightllm.server.model_rank.scheduling.step_report import StepReport
from lightllm.server.model_rank.scheduling.request_state import ReqState

_PAUSED = ReqState.PAUSED
_WAITING = ReqState.WAITING
_DECODING = ReqState.DECODING
# ``state in`` a tuple compares by identity in C (an enum's hash is a Python call).
_SCHEDULABLE_STATES = tuple(state for state in ReqState if state.schedulable)


class StepEngine(RequestMembership):
    """Runs the live requests of one rank, one step at a time (see the module docstring).

    Args:
        executor: computes the planned work.
        kv: the KV cache as the engine sees it.
        strategy: the prefill-queue strategy.
        planner: selects under the token budget.
        eos_token_ids: tokens that end a request unless it ignores EOS.
        max_req_total_len: prompt plus output limit of one request.
    """

    classifier: ClassVar[RequestClassifier] = NORMAL_CLASSIFIER

    def __init__(
        self,
        executor: ModelExecutor,
        kv: KvView,
        strategy: PrefillQueueStrategy,
        planner: StepPlanner,
        eos_token_ids: Sequence[int],
        max_req_total_len: int,
    ) -> None:
        super().__init__(executor, kv, strategy)
        self.planner = planner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_req_total_len = max_req_total_len
        self.counter = ProcessedPrefillTokenCounter()
        # Requests whose prompt (or, after a pause, prompt and outputs) was completed by the last
        # step's forward: share_prefixes publishes their last chunk in the next step.
        self._prompt_completed: set[int] = set()

    # --- the step ------------------------------------------------------------------------------
    def step(self) -> StepReport:
        """One scheduling step over every live request."""
        report = StepReport()
        started = time.perf_counter()
        report.finished.extend(self._ended)
        self._ended = []
        if self._carried:
            report.tokens.extend(self._carried)
            report.carried_tokens = len(self._carried)
            self._carried = []
        self.filter_finished(report)
        ready = self.resume_paused()
        self.share_prefixes(ready, report)
        plan = None
        if ready:
            classified = self.classify(ready)
            ordered_prefill = self.order(classified.prefill)
            report.ordered = classified.decode + ordered_prefill
            plan = self.select(classified.decode, ordered_prefill)
            report.selected_ns = time.monotonic_ns()
        report.plan = plan
        if plan is not None:
            self.pause_starved(plan, report)
        report.schedule_seconds = time.perf_counter() - started
        if plan is not None:
            self.execute(plan, report)
        return report

    def filter_finished(self, report: StepReport) -> None:
        """Release requests whose abort was asked for (not while their KV is in transfer)."""
        for req in [r for r in self.requests.values() if r.abort_requested and r.state is not ReqState.TRANSFERRING]:
            self._leave(req, ReqState.ABORTED, FINISH_ABORT, report.finished)

    def resume_paused(self) -> List[InferReq]:
        """Schedulable requests in admission order; a paused one rejoins once its tokens would fit.

        Only room freed by a request that left counts for a paused request while others run: the
        room its own pause freed goes to the requests it paused for (resuming into it at once
        starved them again, and under an over-committing admission, ``router_token_ratio`` > 1,
        requests were paused and computed anew over and over: about 10x a burst's prompt tokens).
        Requests that computed nothing yet (``WAITING``) do not start while one waits and started
        requests run, since they would take that room.  With nothing running (a request held for
        its grammar runs nothing), the rule is off.
        """
        # Looked at only while some request is paused: otherwise this step has no paused one to hold.
        running = bool(self._paused_at) and any(
            req.state in _SCHEDULABLE_STATES and not req.grammar_held for req in self.requests.values())
        ready: List[InferReq] = []
        append = ready.append
        still_paused = False
        # Room promised to the requests resumed earlier in this pass: resuming only allocates
        # when they compute, so each would otherwise see the same free room and all come back.
        promised = 0
        # Module constants instead of enum attribute and property lookups: this loop runs over
        # every live request each step (a thousand at a full batch).
        for req in self.requests.values():
            state = None if req.grammar_held else req.state  # held for its grammar: neither resumed nor planned
            if state is _PAUSED:
                waits_for_departure = running and self._paused_at.get(req.request_id, -1) == self._departures
                if waits_for_departure or self.kv.allocatable_token_num() - promised < req.total_len:
                    still_paused = True
                    continue
                promised += req.total_len
                self._resume(req)
                state = req.state
            if state in _SCHEDULABLE_STATES:
                append(req)
        if still_paused:
            started = [req for req in ready if req.state is not _WAITING]
            # Only while started requests run, whose ends free room: with none, the waiting ones
            # must go (and a stalled step pauses a holder), or nothing would ever free any.
            if started:
                ready = started
        return ready

    def share_prefixes(self, ready: List[InferReq], report: StepReport) -> None:
        """Prefilling requests publish their computed tokens and adopt longer cached prefixes.

        A burst of prompts with a common prefix then computes the prefix about once instead of
        once per request.  Tokens a request that has produced nothing yet (and whose count is not
        final, see ``InferReq.cache_count_final``) takes from the cache count as its cached prompt
        tokens (``prompt_cache_len``, reported as cached usage).  A request whose last forward
        completed its prompt publishes it once more, in the next step
        (its first decoding step, or the first after the recompute of a paused request; on a PD
        decode node, the first step after its prompt's KV arrived): its last
        chunk would otherwise reach the cache only when the request ends, and the requests
        waiting for that chunk (the planner's ``defer_repeated_chunks``) would wait for nothing
        and compute it again.  Decoding requests are not visited after that (a lookup per token).

        Every visited request is looked at twice: in the first pass each publishes (and adopts
        what those before it published), in the second each adopts what those after it
        published.  In one pass a request deferred for a chunk planned for a request after it in
        admission order (a strategy ordered that one first) looked before the chunk was
        published, and then computed the same tokens itself a step later.
        """
        completed, self._prompt_completed = self._prompt_completed, set()
        # One output: also a PD decode node's request in its first step, its prompt's KV just received.
        visited = [req for req in ready
                   if req.state is not _DECODING or len(req.output_ids) == 1 or req.request_id in completed]
        grown: Dict[int, InferReq] = {}
        for _ in range(2):
            for req in visited:
                gained = self.kv.share_prefix(req)
                # After a pause the request recomputes what it lost, partly from the cache: those
                # tokens were counted (or computed) once already, and adding them again reported
                # a whole prompt as cached.  The last prompt token is never cached.
                if gained and not req.output_ids and not req.cache_count_final:
                    req.prompt_cache_len = min(req.input_len - 1, req.prompt_cache_len + gained)
                    grown[req.request_id] = req
        report.prompt_cache_grown.extend(grown.values())

    def classify(self, ready: List[InferReq]) -> ClassifiedRequests:
        """Split ``ready`` into decode and prefill requests with this mode's classifier.

        Done once per step so the strategy and the planner work from the same split.  Both lists
        keep admission order: decode requests are served in it, and the strategy starts from it.
        """
        return self.classifier.split(ready)

    def order(self, prefill_reqs: List[InferReq]) -> List[InferReq]:
        """Order the prefill requests with the prefill-queue strategy (and its overtaking bound)."""
        return self.strategy.order(prefill_reqs, self.counter.value)

    def select(self, decode_reqs: List[InferReq], ordered_prefill: List[InferReq]) -> StepPlan:
        """Pick decode requests and prefill chunks under the token budget and allocatable KV."""
        return self.planner.plan(decode_reqs, ordered_prefill, self.kv.allocatable_token_num)

    def pause_starved(self, plan: StepPlan, report: StepReport) -> None:
        """Decode requests that found no KV give theirs back; a stalled step frees the newest holder."""
        for req in plan.kv_starved_decode:
            self._pause(req, report)
        if not plan.has_prefill and not plan.decode_reqs:
            # Partly prefilled requests can hold the whole cache when admission over-commits
            # (router_token_ratio > 1); free the newest one so the others can move.
            holders = [r for r in self.requests.values() if self.can_pause(r) and r.cur_kv_len > 0]
            if holders:
                self._pause(holders[-1], report)

    def execute(self, plan: StepPlan, report: StepReport) -> None:
        """Run the plan: one forward for a mixed plan, else its prefill forward, then its decode forward."""
        if plan.mixed and plan.has_prefill and plan.decode_reqs:
            self.run_mixed(plan, report)
            return
        if plan.has_prefill:
            self.run_prefill(plan, report)
        if plan.decode_reqs:
            self.run_decode(plan.decode_reqs, report)

    def run_mixed(self, plan: StepPlan, report: StepReport) -> None:
        """Decode rows and prefill chunks in one forward: a decode row is a one-token chunk whose
        request ends with it, so the prefill path samples it like a prompt's last chunk."""
        report.decode_batch_size = len(plan.decode_reqs)
        rows = [PrefillChunk(req=req, start=req.cur_kv_len, token_num=1) for req in plan.decode_reqs]
        self.run_prefill(plan, report, rows)

    def run_prefill(self, plan: StepPlan, report: StepReport, decode_rows: Sequence[PrefillChunk] = ()) -> None:
        """Reserve KV for the chunks (and any decode rows riding along), count them as processed,
        run them in one forward, take the results.

        The strategy's overtaking bound is charged here, when the step is submitted, so it sees
        exactly the prefill work that ran (on every TP rank alike); decode rows overtake nobody,
        and a request deferred for the chunk of a request ahead of it in default's order (its
        chunk fit; it takes those tokens from the cache next step) is not charged.
        """
        chunks = [*decode_rows, *plan.prefill_chunks]
        self.kv.reserve_many([(chunk.req, chunk.token_num) for chunk in chunks])
        report.prefill_token_num = submit_prefill(plan, self.counter)
        report.forward_token_num += sum(chunk.token_num for chunk in chunks)
        self.strategy.charge([(chunk.req, chunk.token_num) for chunk in plan.prefill_chunks], plan.skipped,
                             plan.deferred)
        result = self.executor.prefill(chunks)
        self.take_results(result, [(chunk.req, chunk.end) for chunk in chunks], report)

    def run_decode(self, reqs: List[InferReq], report: StepReport) -> None:
        """One token for each decode request."""
        self.kv.reserve_many([(req, 1) for req in reqs])
        report.decode_batch_size = len(reqs)
        report.forward_token_num += len(reqs)
        result = self.executor.decode(reqs)
        self.take_results(result, [(req, req.cur_kv_len + 1) for req in reqs], report)

    # --- finish --------------------------------------------------------------------------------
    def take_results(
        self, result: ExecutionResult, computed: List[Tuple[InferReq, int]], report: StepReport
    ) -> None:
        """Advance what the forward computed, then take each sampled token in batch order."""
        report.forward_seconds += result.forward_seconds
        report.post_seconds += result.sample_seconds
        report.prompt_logprobs.extend(result.prompt_logprobs)
        failed = {id(req) for req in result.failed + result.grammar_failed}
        for req, end in computed:
            if failed and id(req) in failed:
                continue
            req.cur_kv_len = end
            if req.state is _WAITING and end < req.total_len:
                req.move_to(ReqState.PREFILLING)
        for req in result.failed:
            self.finish(req, FINISH_ERROR, report)
        for req in result.grammar_failed:
            self.finish(req, FINISH_GRAMMAR_FAILED, report)
        for sampled in result.sampled:
            self.take_token(sampled, report)

    def take_token(self, sampled: SampledToken, report: StepReport) -> None:
        """Append one sampled token; finish the request or move it on to decoding."""
        req = sampled.req
        token = sampled.token_id
        req.output_ids.append(token)
        report.tokens.append((req, token, sampled.logprob))
        if sampled.top:
            report.top_logprobs[req.request_id] = sampled.top
        status = self.finish_status(req, token, sampled.grammar_end)
        if status:
            self.finish(req, status, report)
        elif req.state is not _DECODING:
            self._prompt_completed.add(req.request_id)
            self.on_prompt_done(req, report)

    def finish_status(self, req: InferReq, token: int, grammar_end: Optional[str] = None) -> int:
        """Finish status after ``token`` was appended (0 while the request goes on).

        ``grammar_end`` is the token's :attr:`~.model_executor.SampledToken.grammar_end`: a
        grammar that could not go on fails the request whatever else holds; one the token
        completed stops it unless a stop token or the length ended it first.  The grammar's end
        is one of these rules, not a later override, so that a mode backend that adds its own
        end after them (a PD decode node's segment limit) sees a complete grammar as finished.
        """
        if grammar_end == "error":
            return FINISH_GRAMMAR_FAILED
        params = req.sampling
        if params is not None:
            if token in params.stop_token_ids:
                return FINISH_STOP
            if not params.ignore_eos and token in self.eos_token_ids:
                return FINISH_STOP
        # Lengths read once (this runs for every token of every step): output, then prompt + output.
        output_len = len(req.output_ids)
        if output_len >= req.max_new_tokens or len(req.prompt_ids) + output_len >= self.max_req_total_len:
            return FINISH_LENGTH
        if grammar_end == "stop":
            return FINISH_STOP
        return 0

    # --- hooks of the mode backends ------------------------------------------------------------
    def on_prompt_done(self, req: InferReq, report: StepReport) -> None:
        """The prompt (or a paused request's recompute) is done and the request goes on: decode it."""
        req.move_to(ReqState.DECODING)

    def can_pause(self, req: InferReq) -> bool:
        """Whether ``req``'s KV may be taken back to let others run."""
        return req.state.schedulable
