"""Ordering rules of the ``hrrn`` prefill-queue strategy: response ratio, token aging, bound cost."""

from __future__ import annotations

import copy
import random

import pytest
from prefill_queue_test_support import classify_and_order, decode_req, ids, make_req, order

from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.hrrn import HRRN_COST_KEY
from lightllm.server.model_rank.scheduling.processed_token_counter import ProcessedPrefillTokenCounter


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
    assert ids(strategy.order([long_req, early_short], counter.value)) == [1, 2]
    counter.advance(100)
    # 100/100 beats 4100/8000: short work wins once it has waited a little.
    assert ids(strategy.order([long_req, early_short], counter.value)) == [2, 1]
    counter.advance(20000)
    late_shorts = [make_req(10 + i, 100, arrival=counter.snapshot()) for i in range(3)]
    counter.advance(200)
    # 24300/8000 > 200/100: the long request has aged past freshly arrived short ones.
    assert ids(strategy.order([*late_shorts, long_req], counter.value)) == [1, 10, 11, 12]


def test_hrrn_binds_cost_lazily_and_keeps_it_across_chunks() -> None:
    long_req = make_req(1, 4000, arrival=0)
    assert HRRN_COST_KEY not in long_req.strategy_state
    strategy = build_prefill_queue_strategy("hrrn")
    strategy.order([long_req], 1000)
    assert long_req.strategy_state[HRRN_COST_KEY] == 4000
    long_req.cur_kv_len = 3000  # three chunks later only 1000 tokens are left
    newcomer = make_req(2, 2000, arrival=0, cur_kv_len=0)
    # Fixed cost: 1000/4000 < 1000/2000, so the newcomer goes first.  A shrinking cost
    # (1000/1000) would have put the long request first.
    assert ids(strategy.order([long_req, newcomer], 1000)) == [2, 1]
    assert long_req.strategy_state[HRRN_COST_KEY] == 4000
    assert newcomer.strategy_state[HRRN_COST_KEY] == 2000


def test_hrrn_cost_uses_uncached_prompt_and_is_at_least_one() -> None:
    cached = make_req(1, 1000, cur_kv_len=900)
    fully = make_req(2, 10, output_len=3, cur_kv_len=12)  # prefill work only on a no-decode node
    build_prefill_queue_strategy("hrrn").order([cached, fully], 0)
    assert cached.strategy_state[HRRN_COST_KEY] == 100
    assert fully.strategy_state[HRRN_COST_KEY] == 1


def test_hrrn_does_not_bind_cost_for_decode_or_high_priority() -> None:
    decoding = decode_req(1)
    high = make_req(2, 30, infer_high_priority=-1)
    assert classify_and_order("hrrn", [decoding, high]) == ([1], [2])
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
        build_prefill_queue_strategy("hrrn").order([make_req(1, 10, arrival=50)], 40)
