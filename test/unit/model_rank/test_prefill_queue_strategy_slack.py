"""Ordering rules of the ``shortest_within_slack`` prefill-queue strategy.

The overtaking bound it runs under is proved for every registered strategy in
``test_prefill_overtake_bound.py``; the registry contract in ``test_prefill_queue_strategy.py``.
"""

from __future__ import annotations

from typing import List, Sequence

from prefill_queue_test_support import ids, make_req

from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import (
    ShortestWithinSlackStrategy,
    build_prefill_queue_strategy,
)
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.shortest_within_slack import StepClock

NAME = "shortest_within_slack"


def _strategy(slack_fraction: float = 0.05, min_slack_steps: int = 2) -> ShortestWithinSlackStrategy:
    # Only the strategy's own order: the overtaking bound off.
    return ShortestWithinSlackStrategy(OvertakeBoundSpec.off(), slack_fraction=slack_fraction,
                                       min_slack_steps=min_slack_steps)


def _order(strategy: ShortestWithinSlackStrategy, reqs: Sequence[InferReq], processed: int) -> List[int]:
    return ids(strategy.order(reqs, processed))


def test_the_registry_builds_it_with_the_published_tuning() -> None:
    strategy = build_prefill_queue_strategy(NAME)
    assert isinstance(strategy, ShortestWithinSlackStrategy)
    assert (strategy.slack_fraction, strategy.min_slack_steps, strategy.patience_steps) == (0.05, 2, 4)


def test_step_clock_counts_an_unfilled_step_as_a_full_one() -> None:
    clock = StepClock()
    assert clock.observe(500) == 500
    assert clock.observe(1500) == 1500  # a step of 1000: the budget is now 1000
    assert clock.observe(1500) == 1500  # no prefill ran
    assert clock.observe(1700) == 2500  # 200 tokens, but the step cost a whole budget
    assert clock.budget == 1000
    assert clock.observe(3700) == 4500 and clock.budget == 2000


def test_short_request_overtakes_a_long_one_within_its_slack() -> None:
    assert _order(_strategy(), [make_req(1, 4000), make_req(2, 100)], 0) == [2, 1]


def test_never_overtakes_a_request_that_is_not_longer() -> None:
    strategy = _strategy()
    assert _order(strategy, [make_req(1, 100), make_req(2, 100)], 0) == [1, 2]
    # 3 is shorter than both 1 and 2, so it goes first; 2 may not pass 1 (equal is not shorter).
    reqs = [make_req(1, 300), make_req(2, 300), make_req(3, 20)]
    assert _order(_strategy(), reqs, 0) == [3, 1, 2]


def test_no_overtaking_beyond_the_laxity() -> None:
    # slack = 10% of the 1000-token backlog = 100 tokens: a 150-token prompt may not pass, an
    # 80-token one may.
    strategy = _strategy(slack_fraction=0.1, min_slack_steps=0)
    assert _order(strategy, [make_req(1, 850), make_req(2, 150)], 0) == [1, 2]
    strategy = _strategy(slack_fraction=0.1, min_slack_steps=0)
    assert _order(strategy, [make_req(1, 920), make_req(2, 80)], 0) == [2, 1]


def test_laxity_is_spent_by_the_steps_short_requests_take() -> None:
    # Slack = max(3 steps, 0% of the backlog) = 3000 tokens once the clock has learnt a
    # 1000-token step; each step given to short prompts costs the long request 1000.
    strategy = _strategy(slack_fraction=0.0, min_slack_steps=3)
    long_req = make_req(1, 50_000)
    assert _order(strategy, [long_req], 0) == [1]
    long_req.cur_kv_len = 1000
    processed = 1000
    promoted_steps = 0
    for step in range(10):
        shorts = [make_req(100 + 10 * step + k, 125) for k in range(8)]  # 1000 tokens: one step
        result = _order(strategy, [long_req] + shorts, processed)
        if result[0] == 1:
            break
        promoted_steps += 1
        processed += 1000  # the shorts ran; the long request did not move
    assert promoted_steps == 3


def test_promotion_stops_once_a_step_is_filled() -> None:
    strategy = _strategy()
    long_req = make_req(1, 100_000)
    _order(strategy, [long_req], 0)
    long_req.cur_kv_len = 1000
    _order(strategy, [long_req], 1000)  # the clock now knows a 1000-token step
    reqs = [long_req, make_req(2, 600), make_req(3, 600), make_req(4, 600)]
    assert _order(strategy, reqs, 2000) == [2, 3, 1, 4]


def test_a_partly_filled_step_waits_for_patience() -> None:
    strategy = _strategy()
    long_req = make_req(1, 100_000)
    _order(strategy, [long_req], 0)
    long_req.cur_kv_len = 1000
    _order(strategy, [long_req], 1000)
    short = make_req(2, 100)
    processed = 2000
    waited_steps = 0
    while _order(strategy, [long_req, short], processed)[0] == 1:
        waited_steps += 1
        long_req.cur_kv_len += 1000
        processed += 1000
        assert waited_steps <= 10
    assert waited_steps == strategy.patience_steps


def test_high_priority_first_and_positive_priority_after_normal() -> None:
    reqs = [
        make_req(1, 5000),
        make_req(2, 10, infer_high_priority=1),
        make_req(3, 400, infer_high_priority=-1),
        make_req(4, 50),
    ]
    # 3 (high) leads; the rest start in default's order (1, 4, 2) and the two short ones pass 1.
    assert _order(_strategy(), reqs, 0) == [3, 2, 4, 1]


def test_same_inputs_give_the_same_order_on_every_rank() -> None:
    def run() -> List[List[int]]:
        strategy = _strategy()
        reqs = [make_req(i, 100 + (i * 7919) % 3000) for i in range(30)]
        orders = []
        processed = 0
        for _ in range(12):
            result = strategy.order(reqs, processed)
            orders.append(ids(result))
            head = result[0]
            take = min(1000, head.pending_token_num)
            head.cur_kv_len += take
            processed += take
            reqs = [r for r in reqs if r.pending_token_num > 0]
        return orders

    assert run() == run()
