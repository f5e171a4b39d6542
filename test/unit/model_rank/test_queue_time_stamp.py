"""vLLM's queue time ends when a request is first scheduled, before the forward that computes its
first chunk: the step engine notes when it made its plan, before any forward, and rank 0's
publisher stamps each newly selected request with that moment (stamped at publish time, after the
forward, a one-chunk prompt's whole prefill counted as queueing and its prefill time was ~0)."""

from __future__ import annotations

import time
import types
from typing import Dict, List, Sequence

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.kv_view import TokenCountKvView
from lightllm.server.model_rank.scheduling.model_executor import ExecutionResult, SampledToken
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.step_engine import StepEngine
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner

from prefill_queue_test_support import make_req
from step_publisher_test_support import publisher_over


class ClockedForward:
    """Notes the monotonic clock as each forward starts; samples token 7 for finished inputs."""

    def __init__(self) -> None:
        self.started_ns: List[int] = []

    def prefill(self, chunks: Sequence) -> ExecutionResult:
        self.started_ns.append(time.monotonic_ns())
        done = [chunk.req for chunk in chunks if chunk.end >= chunk.req.total_len]
        return ExecutionResult(sampled=[SampledToken(req, 7, 0.0) for req in done])

    def decode(self, reqs: Sequence[InferReq]) -> ExecutionResult:
        self.started_ns.append(time.monotonic_ns())
        return ExecutionResult(sampled=[SampledToken(req, 7, 0.0) for req in reqs])

    def forget(self, req: InferReq) -> None:
        pass


class ScheduledStamps:
    """The request buffer's ``set_scheduled_ns``, kept."""

    def __init__(self) -> None:
        self.stamps: Dict[int, int] = {}

    def set_scheduled_ns(self, slot: int, request_id: int, scheduled_ns: int) -> bool:
        self.stamps[request_id] = scheduled_ns
        return True


def test_requests_are_stamped_when_the_plan_is_made_before_the_forward() -> None:
    executor = ClockedForward()
    engine = StepEngine(executor, TokenCountKvView(1 << 20), build_prefill_queue_strategy("default"),
                        StepPlanner(batch_max_tokens=64, chunked_prefill_size=64),
                        eos_token_ids=[], max_req_total_len=1 << 20)
    first = make_req(1, 40)
    engine.join(first)
    report = engine.step()
    assert 0 < report.selected_ns <= executor.started_ns[0]
    stamps = ScheduledStamps()
    publisher = publisher_over(types.SimpleNamespace())
    publisher.shm = stamps
    publisher._stamp_first_scheduled(report)
    assert stamps.stamps == {1: report.selected_ns} and first.scheduled_ns == report.selected_ns
    # A request keeps its first stamp; one selected in a later step gets that step's.
    second = make_req(2, 10)
    engine.join(second)
    later = engine.step()
    publisher._stamp_first_scheduled(later)
    assert stamps.stamps == {1: report.selected_ns, 2: later.selected_ns}
    assert later.selected_ns <= executor.started_ns[-1]
