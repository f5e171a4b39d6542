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
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.step_engine import StepEngine
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner

MAX_LEN = 10_000


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


def _engine(strategy: str, budget: int, chunk: int) -> Tuple[StepEngine, RecordingExecutor]:
    context = InferenceContext(KVCacheMemoryManager(100_000, 1, 1, 2, torch.float32), ReqManager(16, MAX_LEN + 1),
                               use_prefix_cache=True)
    executor = RecordingExecutor()
    engine = StepEngine(executor, context, build_prefill_queue_strategy(strategy),
                        StepPlanner(budget, chunk, defer_repeated_chunks=True), eos_token_ids=[],
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


def test_a_deferred_request_is_not_charged_for_the_budget_it_left() -> None:
    """A deferred request's chunk fit: the budget it left to later requests was counted as overtaking
    it, beyond default's own bound, (C - 1) x sum(ceil(P_q / C)) over the requests ahead of it (4096
    overtaken tokens against 3069 here, in two steps of default's order)."""
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
    assert plan.deferred == [repeat] and repeat not in plan.skipped
    assert repeat.prompt_cache_len == 2048 and _computed(executor, 2) == []
