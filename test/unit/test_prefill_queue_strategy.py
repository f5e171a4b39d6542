"""Tests of the prefill-queue strategies and their registry."""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Dict, List, Sequence

import pytest

from lightllm.server.router.model_infer.infer_req import InferReq
from lightllm.server.router.model_infer.mode_backend.prefill_queue_strategy import (
    PREFILL_QUEUE_STRATEGIES,
    DefaultStrategy,
    HrrnStrategy,
    PrefillQueueStrategy,
    PromoteShortestStrategy,
    available_strategy_names,
    build_prefill_queue_strategy,
)
from lightllm.server.router.model_infer.mode_backend.prefill_queue_strategy.hrrn import HRRN_COST_KEY
from lightllm.server.router.model_infer.mode_backend.processed_token_counter import ProcessedPrefillTokenCounter
from lightllm.server.router.model_infer.mode_backend.request_classifier import is_decode_request

ALL_NAMES = ["default", "promote_shortest", "hrrn", "lpm"]


def make_req(
    request_id: int,
    prompt_len: int,
    *,
    output_len: int = 0,
    cur_kv_len: int = 0,
    arrival: int = 0,
    infer_high_priority: int = 0,
    high_priority_request: bool = False,
) -> InferReq:
    """Build a request; ``arrival`` is its processed-prefill-token snapshot."""
    return InferReq(
        request_id=request_id,
        prompt_ids=list(range(prompt_len)),
        output_ids=[1] * output_len,
        cur_kv_len=cur_kv_len,
        arrival_processed_prefill_tokens=arrival,
        infer_high_priority=infer_high_priority,
        high_priority_request=high_priority_request,
    )


def decode_req(request_id: int, arrival: int = 0) -> InferReq:
    """A request with one generated token pending."""
    return make_req(request_id, 8, output_len=1, cur_kv_len=8, arrival=arrival)


def ids(reqs: Sequence[InferReq]) -> List[int]:
    return [r.request_id for r in reqs]


def order(name: str, reqs: Sequence[InferReq], processed: int = 0, **kwargs) -> List[int]:
    return ids(build_prefill_queue_strategy(name).reorder(reqs, processed, **kwargs))


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
    assert order(name, [decode_req(4)]) == [4]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_decodes_stay_first_in_stable_order(name: str) -> None:
    reqs = [
        make_req(10, 500, arrival=0),
        decode_req(7),
        make_req(11, 20, arrival=0),
        decode_req(3),
        make_req(12, 60, arrival=0, infer_high_priority=-1),
        decode_req(5),
    ]
    result = order(name, reqs, processed=1000)
    assert result[:3] == [7, 3, 5]
    assert sorted(result[3:]) == [10, 11, 12]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_no_decode_lets_strategy_order_every_request(name: str) -> None:
    # A single-pending-token request is prefill work on a no-decode node, so it is not pinned
    # to the front; promote_shortest and hrrn both put it before the longer request.
    reqs = [make_req(1, 400, arrival=0), decode_req(2, arrival=0)]
    assert order(name, reqs, processed=100)[:1] == [2]
    result = order(name, reqs, processed=100, no_decode=True)
    assert result == {"default": [1, 2], "promote_shortest": [2, 1], "hrrn": [2, 1], "lpm": [1, 2]}[name]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_strict_prefill_keeps_prefix_hit_prompt_in_prefill_group(name: str) -> None:
    long_prompt = make_req(1, 400)
    one_left = make_req(2, 50, cur_kv_len=49)  # prefix cache left one prompt token
    high = make_req(3, 90, infer_high_priority=-1)
    loose = order(name, [long_prompt, one_left, high], processed=0)
    strict = order(name, [long_prompt, one_left, high], processed=0, strict_prefill=True)
    assert loose[0] == 2  # counted as decode
    assert strict[0] == 3  # prefill: the high-priority request goes ahead of it
    assert 2 in strict[1:]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_router_priority_does_not_reorder_but_infer_priority_does(name: str) -> None:
    # Request 2 is the longest and arrived last, so no strategy has another reason to move it.
    router_flag = [
        make_req(1, 100, arrival=0),
        make_req(2, 900, arrival=50, high_priority_request=True, infer_high_priority=0),
    ]
    assert order(name, router_flag, processed=100) == [1, 2]
    infer_flag = [
        make_req(1, 100, arrival=0),
        make_req(2, 900, arrival=50, infer_high_priority=-1),
    ]
    assert order(name, infer_flag, processed=100) == [2, 1]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_reorder_does_not_mutate_input_or_request_fields(name: str) -> None:
    reqs = [
        make_req(4, 300, arrival=10),
        decode_req(9),
        make_req(2, 40, arrival=30, cur_kv_len=8),
        make_req(6, 120, arrival=0, infer_high_priority=-2),
        make_req(1, 40, arrival=30, high_priority_request=True),
    ]
    before_list = list(reqs)
    before_fields = [_fields_without_strategy_state(r) for r in copy.deepcopy(reqs)]
    result = build_prefill_queue_strategy(name).reorder(reqs, 500)
    assert reqs == before_list and all(a is b for a, b in zip(reqs, before_list))
    assert [_fields_without_strategy_state(r) for r in reqs] == before_fields
    assert _is_permutation(result, reqs)


def _fields_without_strategy_state(req: InferReq) -> Dict[str, object]:
    fields = dataclasses.asdict(req)
    fields.pop("strategy_state")
    return fields


def _is_permutation(result: Sequence[InferReq], reqs: Sequence[InferReq]) -> bool:
    return len(result) == len(reqs) and sorted(map(id, result)) == sorted(map(id, reqs))


def test_reorder_rejects_bad_processed_tokens() -> None:
    strategy = build_prefill_queue_strategy("default")
    with pytest.raises(ValueError, match="processed_prefill_tokens"):
        strategy.reorder([], -1)
    with pytest.raises(ValueError, match="processed_prefill_tokens"):
        strategy.reorder([], 2.5)


def test_faulty_strategy_is_caught() -> None:
    class DropsOne(PrefillQueueStrategy):
        name = "drops_one"

        def order_prefill(self, prefill_reqs, processed_prefill_tokens):
            return prefill_reqs[1:]

    with pytest.raises(RuntimeError, match="drops_one"):
        DropsOne().reorder([make_req(1, 5), make_req(2, 5)], 0)


# --- default ----------------------------------------------------------------------------------


def test_default_sorts_by_infer_priority_and_keeps_fcfs() -> None:
    reqs = [
        make_req(1, 50),
        make_req(2, 10, infer_high_priority=-1),
        make_req(3, 30),
        make_req(4, 20, infer_high_priority=-2),
        make_req(5, 5, infer_high_priority=-1),
        make_req(6, 1000, infer_high_priority=1),
    ]
    assert order("default", reqs) == [4, 2, 5, 1, 3, 6]


# --- promote_shortest -------------------------------------------------------------------------


def test_promote_shortest_moves_only_one_request() -> None:
    reqs = [
        make_req(1, 800),
        make_req(2, 300),
        make_req(3, 40),
        make_req(4, 90),
        make_req(5, 20),
    ]
    assert order("promote_shortest", reqs) == [5, 1, 2, 3, 4]


def test_promote_shortest_uses_uncached_tokens_and_first_on_ties() -> None:
    reqs = [
        make_req(1, 800, cur_kv_len=790),  # 10 pending thanks to the prefix cache / chunks
        make_req(2, 10),
        make_req(3, 12),
    ]
    assert order("promote_shortest", reqs) == [1, 2, 3]
    ties = [make_req(1, 50), make_req(2, 20), make_req(3, 20)]
    assert order("promote_shortest", ties) == [2, 1, 3]


def test_promote_shortest_keeps_high_priority_first_in_arrival_order() -> None:
    reqs = [
        make_req(1, 500),
        make_req(2, 300, infer_high_priority=-1),
        make_req(3, 10),
        make_req(4, 200, infer_high_priority=-3),
        make_req(5, 400),
    ]
    assert order("promote_shortest", reqs) == [2, 4, 3, 1, 5]
    only_high = [make_req(1, 50, infer_high_priority=-1), make_req(2, 5, infer_high_priority=-1)]
    assert order("promote_shortest", only_high) == [1, 2]


# --- hrrn -------------------------------------------------------------------------------------


def test_hrrn_prefers_short_jobs_at_equal_wait() -> None:
    reqs = [make_req(1, 1000, arrival=0), make_req(2, 100, arrival=0), make_req(3, 400, arrival=0)]
    assert order("hrrn", reqs, processed=50) == [2, 3, 1]


def test_hrrn_equal_scores_break_ties_by_request_id() -> None:
    # 10/100 == 20/200 == 5/50; nothing waited at all also ties.
    reqs = [make_req(9, 100, arrival=40), make_req(4, 200, arrival=30), make_req(6, 50, arrival=45)]
    assert order("hrrn", reqs, processed=50) == [4, 6, 9]
    fresh = [make_req(8, 10, arrival=50), make_req(2, 900, arrival=50)]
    assert order("hrrn", fresh, processed=50) == [2, 8]


def test_hrrn_token_aging_lets_long_waiting_request_overtake_new_short_ones() -> None:
    counter = ProcessedPrefillTokenCounter()
    long_req = make_req(1, 8000, arrival=counter.snapshot())
    counter.advance(4000)
    early_short = make_req(2, 100, arrival=counter.snapshot())
    strategy = build_prefill_queue_strategy("hrrn")
    # Right after the short one arrives it has waited nothing; the long one has 4000/8000.
    assert ids(strategy.reorder([long_req, early_short], counter.value)) == [1, 2]
    counter.advance(100)
    # 100/100 beats 4100/8000: short work wins once it has waited a little.
    assert ids(strategy.reorder([long_req, early_short], counter.value)) == [2, 1]
    counter.advance(20000)
    late_shorts = [make_req(10 + i, 100, arrival=counter.snapshot()) for i in range(3)]
    counter.advance(200)
    # 24300/8000 > 200/100: the long request has aged past freshly arrived short ones.
    assert ids(strategy.reorder([*late_shorts, long_req], counter.value)) == [1, 10, 11, 12]


def test_hrrn_binds_cost_lazily_and_keeps_it_across_chunks() -> None:
    long_req = make_req(1, 4000, arrival=0)
    assert HRRN_COST_KEY not in long_req.strategy_state
    strategy = build_prefill_queue_strategy("hrrn")
    strategy.reorder([long_req], 1000)
    assert long_req.strategy_state[HRRN_COST_KEY] == 4000
    long_req.cur_kv_len = 3000  # three chunks later only 1000 tokens are left
    newcomer = make_req(2, 2000, arrival=0, cur_kv_len=0)
    # Fixed cost: 1000/4000 < 1000/2000, so the newcomer goes first.  A shrinking cost
    # (1000/1000) would have put the long request first.
    assert ids(strategy.reorder([long_req, newcomer], 1000)) == [2, 1]
    assert long_req.strategy_state[HRRN_COST_KEY] == 4000
    assert newcomer.strategy_state[HRRN_COST_KEY] == 2000


def test_hrrn_cost_uses_uncached_prompt_and_is_at_least_one() -> None:
    cached = make_req(1, 1000, cur_kv_len=900)
    fully = make_req(2, 10, output_len=3, cur_kv_len=12)
    build_prefill_queue_strategy("hrrn").reorder([cached, fully], 0, no_decode=True)
    assert cached.strategy_state[HRRN_COST_KEY] == 100
    assert fully.strategy_state[HRRN_COST_KEY] == 1


def test_hrrn_does_not_bind_cost_for_decode_or_high_priority() -> None:
    decoding = decode_req(1)
    high = make_req(2, 30, infer_high_priority=-1)
    build_prefill_queue_strategy("hrrn").reorder([decoding, high], 0)
    assert decoding.strategy_state == {} and high.strategy_state == {}


def test_hrrn_is_deterministic_for_shuffled_inputs() -> None:
    rng = random.Random(1234)
    base = [make_req(i, rng.choice([50, 100, 200]), arrival=rng.choice([0, 100, 200])) for i in range(30)]
    expected = order("hrrn", copy.deepcopy(base), processed=400)
    for _ in range(20):
        shuffled = copy.deepcopy(base)
        rng.shuffle(shuffled)
        assert order("hrrn", shuffled, processed=400) == expected


def test_hrrn_rejects_counter_behind_arrival() -> None:
    with pytest.raises(ValueError, match="processed_prefill_tokens"):
        build_prefill_queue_strategy("hrrn").reorder([make_req(1, 10, arrival=50)], 40)


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
                high_priority_request=rng.random() < 0.2,
            )
        )
    return reqs


@pytest.mark.parametrize("name", available_strategy_names())
def test_random_queues_keep_permutation_and_decode_first(name: str) -> None:
    rng = random.Random(20240607)
    strategy = build_prefill_queue_strategy(name)
    for _ in range(300):
        processed = rng.randint(0, 5000)
        reqs = _random_queue(rng, processed)
        no_decode = rng.random() < 0.2
        strict_prefill = rng.random() < 0.3
        flags = dict(no_decode=no_decode, strict_prefill=strict_prefill)
        before = list(reqs)
        result = strategy.reorder(reqs, processed, **flags)
        assert reqs == before
        assert _is_permutation(result, reqs)
        decode_flags = [is_decode_request(r, **flags) for r in result]
        decode_count = sum(decode_flags)
        assert decode_flags == [True] * decode_count + [False] * (len(result) - decode_count)
        assert ids(result[:decode_count]) == ids([r for r in reqs if is_decode_request(r, **flags)])
        prefill = result[decode_count:]
        priorities = [r.infer_high_priority < 0 for r in prefill]
        high_count = sum(priorities)
        assert priorities == [True] * high_count + [False] * (len(prefill) - high_count)


# --- lpm ----------------------------------------------------------------------------------------


def _cached(request_id: int, prompt_len: int, cached: int, **kwargs) -> InferReq:
    req = make_req(request_id, prompt_len, cur_kv_len=cached, **kwargs)
    req.prompt_cache_len = cached
    return req


def test_lpm_prefers_most_cached_tokens_and_keeps_arrival_order_on_ties() -> None:
    reqs = [_cached(1, 100, 0), _cached(2, 900, 600), _cached(3, 50, 10), _cached(4, 700, 600), _cached(5, 30, 0)]
    assert order("lpm", reqs, processed=10) == [2, 4, 3, 1, 5]


def test_lpm_keeps_high_priority_first_in_arrival_order() -> None:
    reqs = [_cached(1, 100, 90), _cached(2, 100, 0, infer_high_priority=-1), _cached(3, 100, 0, infer_high_priority=-2)]
    assert order("lpm", reqs, processed=10) == [2, 3, 1]


def test_lpm_runs_under_the_waiting_bound() -> None:
    # Request 1 shares nothing with the cache and has waited past the bound.
    reqs = [_cached(1, 100, 0, arrival=0), _cached(2, 900, 800, arrival=5000)]
    assert order("lpm", reqs, processed=5000) == [2, 1]
    assert ids(build_prefill_queue_strategy("lpm", 4096).reorder(reqs, 5000)) == [1, 2]
