"""Tests of the prefill-queue strategy registry and the contract every strategy shares.

The ordering rules of each strategy are tested in ``test_prefill_queue_strategy_orders.py``
(default, promote_shortest, lpm), ``test_prefill_queue_strategy_hrrn.py`` and
``test_prefill_queue_strategy_slack.py`` (shortest_within_slack).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Dict, List, Sequence

import pytest
from prefill_queue_test_support import classify_and_order, decode_req, ids, make_req, order, phase_engine

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import (
    PREFILL_QUEUE_STRATEGIES,
    DefaultStrategy,
    HrrnStrategy,
    PrefillQueueStrategy,
    PromoteShortestStrategy,
    available_strategy_names,
    build_prefill_queue_strategy,
)
from lightllm.server.model_rank.scheduling.processed_token_counter import ProcessedPrefillTokenCounter
from lightllm.server.model_rank.scheduling.request_classifier import (
    NO_DECODE_CLASSIFIER,
    NORMAL_CLASSIFIER,
    STRICT_PREFILL_CLASSIFIER,
)

ALL_NAMES = ["default", "promote_shortest", "hrrn", "lpm", "shortest_within_slack"]


# --- registry ---------------------------------------------------------------------------------


def test_registry_names_and_classes() -> None:
    assert available_strategy_names() == ALL_NAMES
    assert PREFILL_QUEUE_STRATEGIES["default"] is DefaultStrategy
    assert PREFILL_QUEUE_STRATEGIES["promote_shortest"] is PromoteShortestStrategy
    assert PREFILL_QUEUE_STRATEGIES["hrrn"] is HrrnStrategy
    for name in ALL_NAMES:
        strategy = build_prefill_queue_strategy(name)
        assert isinstance(strategy, PrefillQueueStrategy)
        assert strategy.name == name


def test_build_returns_fresh_instances() -> None:
    assert build_prefill_queue_strategy("hrrn") is not build_prefill_queue_strategy("hrrn")


@pytest.mark.parametrize("bad", ["fcfs", "", "HRRN", None, 3])
def test_unknown_name_lists_valid_names(bad) -> None:
    with pytest.raises(ValueError) as info:
        build_prefill_queue_strategy(bad)
    message = str(info.value)
    assert "prefill_queue_strategy" in message
    for name in ALL_NAMES:
        assert name in message


# --- shared behaviour -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_NAMES)
def test_empty_and_singleton_queues(name: str) -> None:
    assert order(name, []) == []
    assert order(name, [make_req(4, 100)], processed=10) == [4]
    assert classify_and_order(name, [decode_req(4)]) == ([4], [])


@pytest.mark.parametrize("name", ALL_NAMES)
def test_decodes_are_set_aside_in_stable_order_before_the_strategy_orders(name: str) -> None:
    reqs = [
        make_req(10, 500, arrival=0),
        decode_req(7),
        make_req(11, 20, arrival=0),
        decode_req(3),
        make_req(12, 60, arrival=0, infer_high_priority=-1),
        decode_req(5),
    ]
    decode, prefill = classify_and_order(name, reqs, processed=1000)
    assert decode == [7, 3, 5]
    assert sorted(prefill) == [10, 11, 12]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_no_decode_lets_strategy_order_every_request(name: str) -> None:
    # A single-pending-token request is prefill work on a no-decode node, so it is not set
    # aside; promote_shortest and hrrn both put it before the longer request.
    reqs = [make_req(1, 400, arrival=0), decode_req(2, arrival=0)]
    assert classify_and_order(name, reqs, processed=100) == ([2], [1])
    decode, prefill = classify_and_order(name, reqs, processed=100, classifier=NO_DECODE_CLASSIFIER)
    expected = {
        "default": [1, 2],
        "promote_shortest": [2, 1],
        "hrrn": [2, 1],
        "lpm": [1, 2],
        "shortest_within_slack": [2, 1],
    }
    assert decode == [] and prefill == expected[name]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_strict_prefill_keeps_prefix_hit_prompt_in_prefill_group(name: str) -> None:
    long_prompt = make_req(1, 400)
    one_left = make_req(2, 50, cur_kv_len=49)  # prefix cache left one prompt token
    high = make_req(3, 90, infer_high_priority=-1)
    loose = classify_and_order(name, [long_prompt, one_left, high], processed=0)
    strict = classify_and_order(name, [long_prompt, one_left, high], processed=0, classifier=STRICT_PREFILL_CLASSIFIER)
    assert loose[0] == [2]  # counted as decode
    assert strict[0] == []
    assert strict[1][0] == 3  # prefill: the high-priority request goes ahead of it
    assert 2 in strict[1][1:]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_router_priority_does_not_reorder_but_infer_priority_does(name: str) -> None:
    # Request 2 is the longest and arrived last, so no strategy has another reason to move it.
    # The router's flag is not even part of the rank's request: it stays in the spec.
    flagged = RequestSpec.build(list(range(900)), SamplingParams(), high_priority_request=True)
    router_flag = [
        make_req(1, 100, arrival=0),
        InferReq.from_spec(2, flagged, arrival_processed_prefill_tokens=50),
    ]
    assert order(name, router_flag, processed=100) == [1, 2]
    infer_flag = [
        make_req(1, 100, arrival=0),
        make_req(2, 900, arrival=50, infer_high_priority=-1),
    ]
    assert order(name, infer_flag, processed=100) == [2, 1]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_order_does_not_mutate_input_or_request_fields(name: str) -> None:
    reqs = [
        make_req(4, 300, arrival=10),
        make_req(2, 40, arrival=30, cur_kv_len=8),
        make_req(6, 120, arrival=0, infer_high_priority=-2),
        make_req(1, 40, arrival=30),
    ]
    before_list = list(reqs)
    before_fields = [_fields_without_strategy_state(r) for r in copy.deepcopy(reqs)]
    result = build_prefill_queue_strategy(name).order(reqs, 500)
    assert reqs == before_list and all(a is b for a, b in zip(reqs, before_list))
    assert [_fields_without_strategy_state(r) for r in reqs] == before_fields
    assert _is_permutation(result, reqs)


def _fields_without_strategy_state(req: InferReq) -> Dict[str, object]:
    # The two fields a strategy may write: its own lazily bound metadata and the bound's record.
    fields = dataclasses.asdict(req)
    fields.pop("strategy_state")
    fields.pop("overtake")
    return fields


def _is_permutation(result: Sequence[InferReq], reqs: Sequence[InferReq]) -> bool:
    return len(result) == len(reqs) and sorted(map(id, result)) == sorted(map(id, reqs))


def test_order_rejects_bad_processed_tokens() -> None:
    strategy = build_prefill_queue_strategy("default")
    with pytest.raises(ValueError, match="processed_prefill_tokens"):
        strategy.order([], -1)
    with pytest.raises(ValueError, match="processed_prefill_tokens"):
        strategy.order([], 2.5)


def test_faulty_strategy_is_caught() -> None:
    class DropsOne(PrefillQueueStrategy):
        name = "drops_one"

        def order_prefill(self, prefill_reqs, processed_prefill_tokens):
            return prefill_reqs[1:]

    with pytest.raises(RuntimeError, match="drops_one"):
        DropsOne().order([make_req(1, 5), make_req(2, 5)], 0)


# --- property-style invariants ----------------------------------------------------------------


def _random_queue(rng: random.Random, processed: int) -> List[InferReq]:
    reqs = []
    for request_id in rng.sample(range(1000), rng.randint(0, 25)):
        prompt_len = rng.randint(1, 300)
        output_len = rng.choice([0, 0, 1, 3])
        total = prompt_len + output_len
        cur_kv_len = rng.choice([0, rng.randint(0, total - 1), total - 1])
        reqs.append(
            InferReq(
                request_id=request_id,
                prompt_ids=[0] * prompt_len,
                output_ids=[1] * output_len,
                cur_kv_len=cur_kv_len,
                arrival_processed_prefill_tokens=rng.randint(0, processed),
                infer_high_priority=rng.choice([0, 0, 0, -1, -2, 1]),
            )
        )
    return reqs


@pytest.mark.parametrize("name", available_strategy_names())
def test_random_queues_classify_in_order_and_order_a_permutation(name: str) -> None:
    rng = random.Random(20240607)
    engine = phase_engine(name)
    for _ in range(300):
        processed = rng.randint(0, 5000)
        engine.counter = ProcessedPrefillTokenCounter(initial=processed)
        reqs = _random_queue(rng, processed)
        engine.classifier = rng.choice(
            [NORMAL_CLASSIFIER, NORMAL_CLASSIFIER, STRICT_PREFILL_CLASSIFIER, NO_DECODE_CLASSIFIER]
        )
        before = list(reqs)
        classified = engine.classify(reqs)
        # The classify phase partitions the ready requests, each side in its input order.
        assert ids(classified.decode) == ids([r for r in reqs if engine.classifier.is_decode(r)])
        assert ids(classified.prefill) == ids([r for r in reqs if not engine.classifier.is_decode(r)])
        prefill = engine.order(classified.prefill)
        assert reqs == before
        assert _is_permutation(prefill, classified.prefill)
        priorities = [r.infer_high_priority < 0 for r in prefill]
        high_count = sum(priorities)
        assert priorities == [True] * high_count + [False] * (len(prefill) - high_count)
