"""The step engine's classify phase: one split of the ready requests into decode and prefill.

The split is made once per step and handed on: the prefill-queue strategy orders only the
prefill list and the planner takes both, so neither can classify a request differently.  These
tests call the phase alone, then check what a running engine reports (``StepReport.ordered``).
"""

from __future__ import annotations

import random
from typing import List

import pytest
from prefill_queue_test_support import decode_req, ids, make_req, phase_engine

from lightllm.benchmark.simulator.cost_executor import CostModelExecutor
from lightllm.benchmark.simulator.cost_model import load_profile
from lightllm.server.model_rank.scheduling.backend_registry import build_backend
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.kv_view import TokenCountKvView
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import (
    available_strategy_names,
    build_prefill_queue_strategy,
)
from lightllm.server.model_rank.scheduling.request_classifier import (
    NO_DECODE_CLASSIFIER,
    NORMAL_CLASSIFIER,
    STRICT_PREFILL_CLASSIFIER,
    ClassifiedRequests,
    RequestClassifier,
)
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner


def _ready() -> List[InferReq]:
    """One request of each kind, interleaved, in admission order."""
    return [
        make_req(1, 400),  # fresh prompt
        decode_req(2),  # generated a token: one pending
        make_req(3, 50, cur_kv_len=49),  # the prefix cache left one prompt token
        make_req(4, 300, cur_kv_len=128),  # partly prefilled
        decode_req(5),
        make_req(6, 20, output_len=2, cur_kv_len=10),  # paused and resumed: recomputing
    ]


@pytest.mark.parametrize(
    ("classifier", "decode", "prefill"),
    [
        (NORMAL_CLASSIFIER, [2, 3, 5], [1, 4, 6]),
        (STRICT_PREFILL_CLASSIFIER, [2, 5], [1, 3, 4, 6]),
        (NO_DECODE_CLASSIFIER, [], [1, 2, 3, 4, 5, 6]),
    ],
    ids=lambda value: value.name if isinstance(value, RequestClassifier) else None,
)
def test_classify_splits_per_classifier_variant_in_input_order(
    classifier: RequestClassifier, decode: List[int], prefill: List[int]
) -> None:
    engine = phase_engine("hrrn", classifier, processed=700)
    ready = _ready()
    before = list(ready)
    classified = engine.classify(ready)
    assert isinstance(classified, ClassifiedRequests)
    assert (ids(classified.decode), ids(classified.prefill)) == (decode, prefill)
    # A phase of its own: it leaves the input, the requests, the counter and the strategy alone.
    assert ready == before
    assert all(req.strategy_state == {} and req.overtake is None for req in ready)
    assert engine.counter.value == 700


def test_classify_of_nothing_is_two_empty_lists() -> None:
    assert phase_engine().classify([]) == ClassifiedRequests([], [])


@pytest.mark.parametrize("strategy", available_strategy_names())
def test_report_orders_decode_first_in_admission_order_then_the_strategys_prefill_order(strategy: str) -> None:
    rng = random.Random(7)
    backend = build_backend("normal")(
        CostModelExecutor(load_profile("h100_qwen_0p8b")), TokenCountKvView(4000),
        build_prefill_queue_strategy(strategy), StepPlanner(128, 64), [], 4000)
    admitted: List[int] = []
    mixed_steps = 0
    for step in range(400):
        if step < 30 and step % 3 == 0:
            request_id = len(admitted)
            backend.join(InferReq(request_id, [0] * rng.randint(20, 300), max_new_tokens=rng.randint(4, 30),
                                  arrival_processed_prefill_tokens=backend.counter.snapshot()))
            admitted.append(request_id)
        if not backend.has_work:
            break
        report = backend.step()
        if report.plan is None:
            continue
        decode = report.plan.decode_reqs + report.plan.kv_starved_decode
        prefill = report.plan.prefill_reqs + report.plan.skipped
        assert ids(report.ordered[: len(decode)]) == ids(decode)
        assert ids(decode) == [rid for rid in admitted if rid in set(ids(decode))]
        assert sorted(ids(report.ordered[len(decode):])) == sorted(ids(prefill))
        mixed_steps += bool(decode) and bool(prefill)
    assert not backend.has_work
    assert mixed_steps > 0, "some steps should offer decode and prefill requests together"
