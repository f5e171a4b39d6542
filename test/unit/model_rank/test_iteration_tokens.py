"""Tokens per engine step (vLLM's ``iteration_tokens_total``): what each step's forwards took in,
counted by the step engine, observed once per step by rank 0's publisher, exported by /metrics."""

from __future__ import annotations

import uuid
from typing import Dict, List, Sequence

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lightllm.server.core.objs.iteration_tokens_histogram import (ITERATION_TOKEN_BUCKETS, ITERATION_TOKEN_FIELDS,
                                                                   IterationTokenCounts)
from lightllm.server.core.objs.shm_stats import ShmStats
from lightllm.server.httpserver.metrics import ServerMetrics
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.kv_view import TokenCountKvView
from lightllm.server.model_rank.scheduling.model_executor import ExecutionResult, SampledToken
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.step_engine import StepEngine
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.model_rank.scheduling.step_report import StepReport

from prefill_queue_test_support import make_req
from step_publisher_test_support import publisher_over


class CountingForward:
    """Samples token 7 for every decode row and every chunk that completes its request's input;
    keeps the token count of each forward it ran."""

    def __init__(self) -> None:
        self.forwards: List[int] = []

    def prefill(self, chunks: Sequence) -> ExecutionResult:
        self.forwards.append(sum(chunk.token_num for chunk in chunks))
        done = [chunk.req for chunk in chunks if chunk.end >= chunk.req.total_len]
        return ExecutionResult(sampled=[SampledToken(req, 7, 0.0) for req in done])

    def decode(self, reqs: Sequence[InferReq]) -> ExecutionResult:
        self.forwards.append(len(reqs))
        return ExecutionResult(sampled=[SampledToken(req, 7, 0.0) for req in reqs])

    def forget(self, req: InferReq) -> None:
        pass


class PrefixKvView(TokenCountKvView):
    """A token count whose "cache" holds the first ``cached[request_id]`` tokens of a prompt."""

    def __init__(self, cached: Dict[int, int]) -> None:
        super().__init__(1 << 20)
        self.cached = cached

    def attach(self, req: InferReq) -> None:
        req.cur_kv_len = req.kv_slot_len = self.cached.get(req.request_id, 0)


def _engine(*, budget: int = 64, chunk: int | None = None, mixed: bool = False,
            cached: Dict[int, int] | None = None) -> StepEngine:
    return StepEngine(CountingForward(), PrefixKvView(cached or {}), build_prefill_queue_strategy("default"),
                      StepPlanner(batch_max_tokens=budget, chunked_prefill_size=chunk, mixed=mixed),
                      eos_token_ids=[], max_req_total_len=1 << 20)


def _join(engine: StepEngine, request_id: int, prompt_len: int, max_new_tokens: int) -> InferReq:
    req = make_req(request_id, prompt_len)
    req.max_new_tokens = max_new_tokens
    engine.join(req)
    return req


def _steps(engine: StepEngine) -> List[int]:
    tokens = []
    while engine.requests:
        tokens.append(engine.step().forward_token_num)
    return tokens


@pytest.mark.parametrize("mixed", [False, True])
def test_a_step_counts_its_prefill_chunks_and_decode_rows_once(mixed: bool) -> None:
    engine = _engine(mixed=mixed)
    _join(engine, 1, 10, max_new_tokens=3)
    assert engine.step().forward_token_num == 10  # the whole prompt
    _join(engine, 2, 6, max_new_tokens=2)
    # Request 1's decode row and request 2's prompt: one forward (mixed) or two, one step either way.
    report = engine.step()
    assert report.forward_token_num == 1 + 6
    assert engine.executor.forwards[1:] == ([7] if mixed else [6, 1])
    assert _steps(engine) == [2]  # both decode once more; both end
    # Every token the forwards took in is in exactly one step.
    assert sum(engine.executor.forwards) == 10 + 7 + 2


def test_chunked_prefill_counts_each_chunk_in_its_own_step() -> None:
    engine = _engine(budget=4, chunk=4)
    _join(engine, 1, 10, max_new_tokens=2)
    assert _steps(engine) == [4, 4, 2, 1]


def test_tokens_the_prefix_cache_held_are_not_counted() -> None:
    engine = _engine(cached={1: 8})
    _join(engine, 1, 12, max_new_tokens=2)  # 8 prompt tokens attached from the cache
    assert _steps(engine) == [4, 1]


def test_a_step_without_a_forward_counts_nothing() -> None:
    engine = _engine()
    assert engine.step().forward_token_num == 0


def _hist(counts: IterationTokenCounts) -> Dict[str, int]:
    return counts.fields()


def test_counts_fill_vllms_buckets_cumulatively() -> None:
    assert ITERATION_TOKEN_BUCKETS == (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    counts = IterationTokenCounts()
    for tokens in (1, 8, 9, 20000):
        counts.observe(tokens)
    fields = _hist(counts)
    assert fields["iteration_tokens_le_1"] == 1
    assert fields["iteration_tokens_le_8"] == 2
    assert fields["iteration_tokens_le_16"] == 3
    assert fields["iteration_tokens_le_16384"] == 3
    assert fields["iteration_tokens_le_inf"] == 4
    assert fields["iteration_tokens_sum"] == 1 + 8 + 9 + 20000
    assert set(fields) == set(ITERATION_TOKEN_FIELDS)


def test_rank_0_observes_each_step_with_a_forward_and_metrics_export_it_under_both_names() -> None:
    stats = ShmStats(f"lightllm_test_{uuid.uuid4().hex[:8]}", create=True)
    try:
        publisher = publisher_over(None)
        written: Dict[str, int] = {}
        publisher.stats = type("Stats", (), {"set": lambda self, k, v: stats.set(k, v) or written.__setitem__(k, v),
                                             "get": lambda self, k: stats.get(k)})()
        for tokens in (10, 0, 3, 1, 1):  # the 0 is a step that ran no forward
            publisher.publish(StepReport(forward_token_num=tokens))
        families = {f.name: f for f in text_string_to_metric_families(
            ServerMetrics("default", stats, "tiny").render()[0].decode())}
    finally:
        stats.close()
        stats.unlink()
    for name, labels in (("lightllm_iteration_tokens", {"strategy": "default"}),
                         ("vllm:iteration_tokens_total", {"engine": "0"})):
        family = families[name]
        assert family.type == "histogram"
        samples = {(s.name, s.labels.get("le")): s.value for s in family.samples
                   if all(s.labels.get(k) == v for k, v in labels.items())}
        assert samples[(f"{name}_count", None)] == 4
        assert samples[(f"{name}_sum", None)] == 15
        assert samples[(f"{name}_bucket", "1.0")] == 2
        assert samples[(f"{name}_bucket", "8.0")] == 3
        assert samples[(f"{name}_bucket", "16.0")] == 4
        assert samples[(f"{name}_bucket", "+Inf")] == 4
        assert {s.labels.get("le") for s in family.samples if s.name.endswith("_bucket")} == {
            *(f"{float(b)}" for b in ITERATION_TOKEN_BUCKETS), "+Inf"}
    # Not a live gauge of its own.
    assert not any(name.startswith("lightllm_iteration_tokens_le") for name in families)
