"""A request deferred for a chunk planned for another takes it from the cache, and is not charged for it.

With the prefix cache on (the server's default), the planner defers a request whose next chunk
repeats one planned this step for another request (``defer_repeated_chunks``): next step it
adopts those tokens instead of computing them again.  Driven here through the real step engine,
inference context and radix cache, with an executor that computes nothing (a prefill forward
leaves its chunks' positions computed, which is all the cache needs).
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import pytest
import torch

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.common.req_manager import ReqManager
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.model_executor import ExecutionResult, SampledToken
from lightllm.server.model_rank.scheduling.prefill_backend import PrefillBackend
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.step_engine import StepEngine
from lightllm.server.model_rank.scheduling.request_state import ReqState
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.model_rank.scheduling.step_report import StepReport

MAX_LEN = 20_000


class RecordingExecutor:
    """Computes nothing; records each prefill forward's chunks as (request id, start, tokens)."""

    vocab_size = 1000
    grammar_enabled = False

    def __init__(self) -> None:
        self.prefills: List[List[Tuple[int, int, int]]] = []

    def prefill(self, chunks) -> ExecutionResult:
        self.prefills.append([(c.req.request_id, c.start, c.token_num) for c in chunks])
        return ExecutionResult(sampled=[SampledToken(c.req, 7, 0.0) for c in chunks if c.end == c.req.total_len])

    def decode(self, reqs) -> ExecutionResult:
        return ExecutionResult(sampled=[SampledToken(r, 7, 0.0) for r in reqs])

    def forget(self, req: InferReq) -> None:
        pass


def _engine(strategy: str, budget: int, chunk: int, engine_class: type = StepEngine,
            prompt_ends_cached_next_step: bool = True) -> Tuple[StepEngine, RecordingExecutor]:
    context = InferenceContext(KVCacheMemoryManager(400_000, 1, 1, 2, torch.float32), ReqManager(256, MAX_LEN + 1),
                               use_prefix_cache=True)
    executor = RecordingExecutor()
    planner = StepPlanner(budget, chunk, defer_repeated_chunks=True,
                          prompt_ends_cached_next_step=prompt_ends_cached_next_step)
    engine = engine_class(executor, context, build_prefill_queue_strategy(strategy), planner, eos_token_ids=[],
                          max_req_total_len=MAX_LEN)
    return engine, executor


def _join(engine: StepEngine, reqs: Sequence[InferReq]) -> None:
    for req in reqs:
        req.arrival_processed_prefill_tokens = engine.counter.snapshot()
        engine.join(req)


def _computed(executor: RecordingExecutor, request_id: int) -> List[Tuple[int, int]]:
    return [(start, tokens) for forward in executor.prefills for rid, start, tokens in forward if rid == request_id]


@pytest.mark.parametrize("strategy", ["promote_shortest", "hrrn", "lpm", "shortest_within_slack", "default"])
def test_a_deferred_request_adopts_the_chunk_of_a_request_admitted_after_it(strategy: str) -> None:
    """The engine offered each request the cache once, in admission order: a request deferred for a
    chunk planned for a request admitted after it (a strategy ordered that one first) looked before
    that chunk was published, waited a step for nothing and computed the same 1024 tokens itself."""
    shared = list(range(1, 1025))
    engine, executor = _engine(strategy, budget=2048, chunk=1024)
    long_tail = InferReq(request_id=1, prompt_ids=shared + list(range(2000, 5000)), max_new_tokens=1)
    short_tail = InferReq(request_id=2, prompt_ids=shared + list(range(6000, 6100)), max_new_tokens=1)
    other = InferReq(request_id=3, prompt_ids=list(range(7000, 8500)), max_new_tokens=1)
    _join(engine, [long_tail, short_tail, other])
    for _ in range(8):
        engine.step()
        if not engine.has_work:
            break
    assert not engine.has_work
    # The shared 1024 tokens were computed once, by one of the two.
    starts = [start for rid in (1, 2) for start, _ in _computed(executor, rid)]
    assert starts.count(0) == 1, executor.prefills
    assert sorted([long_tail.prompt_cache_len, short_tail.prompt_cache_len]) == [0, 1024]


def test_a_request_deferred_for_work_ahead_of_it_is_not_charged_for_the_budget_it_left() -> None:
    """Its chunk fit: the budget it left to later requests was counted as overtaking it, beyond
    default's own bound, (C - 1) x sum(ceil(P_q / C)) over the requests ahead of it (4096 overtaken
    tokens against 3069 here, in two steps of default's order)."""
    budget, chunk = 4096, 1024
    engine, executor = _engine("default", budget, chunk)
    shared = list(range(1, 2049))
    first = InferReq(request_id=1, prompt_ids=shared + [9001], max_new_tokens=1)
    repeat = InferReq(request_id=2, prompt_ids=shared + [9002], max_new_tokens=1)
    later = [InferReq(request_id=3 + i, prompt_ids=list(range(20_000 + 5000 * i, 22_048 + 5000 * i)),
                      max_new_tokens=1) for i in range(2)]
    _join(engine, [first, repeat, *later])
    ahead = first.pending_token_num
    plan = engine.step().plan
    while engine.has_work:
        engine.step()
    assert repeat.overtake.overtaken_tokens <= (chunk - 1) * math.ceil(ahead / chunk)
    assert plan.deferred == [(repeat, first)] and repeat not in plan.skipped
    assert repeat.prompt_cache_len == 2048 and _computed(executor, 2) == []


def test_a_request_later_work_keeps_deferring_is_charged_and_protected() -> None:
    """Deferrals for later arrivals were not charged: under promote_shortest a long prompt that came
    first, deferred in every step for a later short prompt repeating half of its next chunk, was
    deferred 15 times, overtaken by 0 tokens, never protected, and waited 31233 processed tokens
    (the documented bound for it, A + L + overtaken + (B - 1) x ceil(L / C): 26616)."""
    budget, chunk = 2048, 1024
    engine, _ = _engine("promote_shortest", budget, chunk)
    prompt = list(range(100_000, 108_193))
    first = InferReq(request_id=1, prompt_ids=prompt, max_new_tokens=1)
    _join(engine, [first])
    arrival = engine.counter.value
    fresh = iter(range(200_000, 10**7))
    next_id = 2
    waited = None
    for step in range(100):
        start = 512 * step
        if start + 1024 <= len(prompt) - 1:
            repeat = InferReq(request_id=next_id, prompt_ids=prompt[:start + 512] + [next(fresh) for _ in range(512)],
                              max_new_tokens=1)
            filler = InferReq(request_id=next_id + 1, prompt_ids=[next(fresh) for _ in range(1024)], max_new_tokens=1)
            _join(engine, [repeat, filler])
            next_id += 2
        engine.step()
        if first.output_ids:
            waited = engine.counter.value - arrival
            break
    assert waited is not None and first.overtake.protected
    overtaken = first.overtake.overtaken_tokens
    assert waited <= len(prompt) + overtaken + (budget - 1) * math.ceil(len(prompt) / chunk)


@pytest.mark.parametrize("ends_cached", [True, False])
def test_a_chunk_that_ends_its_owners_prompt_is_waited_for_only_where_the_prompt_is_cached_next_step(
        ends_cached: bool) -> None:
    planner = StepPlanner(2048, 1024, defer_repeated_chunks=True, prompt_ends_cached_next_step=ends_cached)
    owner = InferReq(request_id=1, prompt_ids=list(range(1, 601)), max_new_tokens=1)
    longer = InferReq(request_id=2, prompt_ids=list(range(1, 601)) + list(range(5000, 5400)), max_new_tokens=1)
    plan = planner.plan([], [owner, longer], 100_000)
    assert [(req.request_id, other.request_id) for req, other in plan.deferred] == ([(2, 1)] if ends_cached else [])


def test_on_a_pd_prefill_node_later_requests_sharing_a_prefix_do_not_stall_an_earlier_one() -> None:
    """On a prefill node a finished prompt goes to a decode node and reaches the cache only when that
    node acknowledges its KV: a request deferred for such a chunk (a later short prompt with the same
    system prompt, ordered first) waited for nothing, step after step: with acknowledgements slow,
    after 40 steps it had not started (deferred 40 times, charged nothing)."""
    engine, _ = _engine("promote_shortest", 2048, 1024, engine_class=PrefillBackend, prompt_ends_cached_next_step=False)
    prompt = list(range(100_000, 104_097))
    first = InferReq(request_id=1, prompt_ids=prompt, max_new_tokens=16)
    _join(engine, [first])
    fresh = iter(range(200_000, 10**7))
    deferred = 0
    for step in range(40):
        start = first.cur_kv_len
        _join(engine, [InferReq(request_id=1000 + step, prompt_ids=prompt[:start + 512] + [next(fresh) for _ in range(100)],
                                max_new_tokens=16)])
        report = engine.step()  # no acknowledgement ever comes: every hand-off stays in transfer
        deferred += any(req is first for req, _ in report.plan.deferred)
        if first.state is not ReqState.WAITING and first.state is not ReqState.PREFILLING:
            break
    assert first.cur_kv_len == len(prompt) and deferred == 0


def test_a_resumed_request_publishes_the_chunk_that_ends_its_recompute() -> None:
    """A request paused under KV pressure recomputes its prompt and outputs when it resumes; its last
    chunk ends it back in decoding with several outputs, which share_prefixes did not visit, so that
    chunk reached the cache only when the request ended. A request deferred for it adopted nothing
    and computed the shared tokens itself a step later (uncharged: its owner is ahead of it)."""
    engine, executor = _engine("default", 2048, 1024)
    prompt = list(range(1, 2001))
    owner = InferReq(request_id=1, prompt_ids=prompt, max_new_tokens=50)
    _join(engine, [owner])
    while len(owner.output_ids) < 5:
        engine.step()
    engine._pause(owner, StepReport())  # what pause_starved does when KV runs out
    engine.kv.clear_prefix_cache()  # and its cached tokens evicted meanwhile
    engine.step()  # it resumes and recomputes its first chunk
    assert owner.cur_kv_len == 1024
    later = InferReq(request_id=2, prompt_ids=prompt + list(range(50_000, 50_500)), max_new_tokens=1)
    _join(engine, [later])
    plan = engine.step().plan
    assert [(req.request_id, other.request_id) for req, other in plan.deferred] == [(2, 1)]
    while not later.output_ids:
        engine.step()
    assert later.prompt_cache_len == 2000 and _computed(executor, 2) == [(2000, 500)]
