"""Ordering rules of the ``default``, ``promote_shortest`` and ``lpm`` prefill-queue strategies."""

from __future__ import annotations

from prefill_queue_test_support import ids, make_req, order

from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy


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


def test_lpm_runs_under_the_overtaking_bound() -> None:
    # Request 1 shares nothing with the cache; with no allowance it may not be overtaken at all.
    reqs = [_cached(1, 100, 0, arrival=0), _cached(2, 900, 800, arrival=5000)]
    assert order("lpm", reqs, processed=5000) == [2, 1]
    strict = build_prefill_queue_strategy("lpm", OvertakeBoundSpec(0, 0.0))
    assert ids(strict.order([_cached(1, 100, 0), _cached(2, 900, 800)], 5000)) == [1, 2]
