"""The clairvoyant yardstick of the simulator (``frontier.py``): its order and its sweep."""

from __future__ import annotations

import dataclasses

import pytest
from prefill_queue_test_support import ids, make_req
from simulator_test_support import assert_refused_in_one_line, make_profile

from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec
from lightllm.benchmark.simulator.frontier import (
    EarliestShortsFirst,
    FrontierPoint,
    best_within_loss_limit,
    earliest_short_ids,
    frontier,
    frontier_markdown,
    main,
)
from lightllm.benchmark.simulator.runner import case_metrics, simulate_workload
from lightllm.benchmark.simulator.scenarios import ScenarioSpec
from lightllm.benchmark.workloads import LONG, SHORT, ScheduledRequest, WorkloadConfig

PROFILE = make_profile()

# Four 4K prompts, then a stream of 64-token prompts: the long-then-stream shape, small.
SMALL_LONG_THEN_STREAM = ScenarioSpec(
    "small_long_then_stream",
    "4 long 4K prompts, then 64-token prompts at 100 req/s for 0.5 s",
    WorkloadConfig(
        name="sustained", long_len=4096, short_len=64, output_len=16, long_fraction=0.0, request_rate=100.0,
        duration_s=0.5, initial_long_count=4, long_spread_ms=3.0, stream_start_ms=5.0,
    ),
)


def test_listed_requests_lead_a_full_batch_at_a_time_from_the_start_tokens_on() -> None:
    order = EarliestShortsFirst([3, 4, 5], batch_size=2, start_tokens=100, overtake_bound=OvertakeBoundSpec.off())
    reqs = [make_req(1, 4000), make_req(3, 50), make_req(4, 50)]
    assert ids(order.order(reqs, 99)) == [1, 3, 4]  # before the start nothing moves
    assert ids(order.order(reqs[:2], 100)) == [1, 3]  # one listed request waits: not a batch yet
    assert ids(order.order(reqs, 100)) == [3, 4, 1]
    # 5 is the last listed request not yet released: it goes without waiting for company.
    assert ids(order.order([make_req(1, 4000), make_req(5, 50)], 200)) == [5, 1]


def test_the_overtaking_bound_still_puts_a_protected_request_first() -> None:
    order = EarliestShortsFirst([3, 4], batch_size=2, overtake_bound=OvertakeBoundSpec(0, 0.0))
    reqs = [make_req(1, 4000, arrival=0), make_req(3, 50, arrival=1500), make_req(4, 50, arrival=1500)]
    assert ids(order.order(reqs, 1500)) == [1, 3, 4]


def test_refuses_meaningless_settings() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        EarliestShortsFirst([1], batch_size=0)
    with pytest.raises(ValueError, match="start_tokens"):
        EarliestShortsFirst([1], batch_size=1, start_tokens=-1)


def test_earliest_short_ids_follow_arrival_time_not_position() -> None:
    workload = [
        ScheduledRequest(0.0, LONG, 4096, 8),
        ScheduledRequest(0.3, SHORT, 64, 8),
        ScheduledRequest(0.1, SHORT, 64, 8),
        ScheduledRequest(0.2, SHORT, 64, 8),
    ]
    assert earliest_short_ids(workload, 2) == [2, 3]
    assert earliest_short_ids(workload, 10) == [2, 3, 1]


def test_sweep_measures_each_member_as_a_direct_simulation_does() -> None:
    points = frontier(PROFILE, SMALL_LONG_THEN_STREAM, "normal", 256, [0, 8], [0])
    nothing, eight = points
    # Nothing listed: the member is default's order, so every change is exactly zero.
    assert (nothing.short_cut_ms, nothing.short_ttft_pct, nothing.long_ttft_pct, nothing.long_e2e_pct,
            nothing.output_pct) == (0, 0, 0, 0, 0)
    workload = SMALL_LONG_THEN_STREAM.build(0)

    def metrics(strategy):
        return case_metrics(simulate_workload(PROFILE, workload, strategy, "normal", 256)[0])[0]

    base, got = metrics("default"), metrics(EarliestShortsFirst(earliest_short_ids(workload, 8), 4))
    assert eight.short_cut_ms == pytest.approx(base["short_ttft_p95_ms"] - got["short_ttft_p95_ms"])
    assert eight.long_ttft_pct == pytest.approx(100 * (got["long_ttft_p95_ms"] / base["long_ttft_p95_ms"] - 1))
    # Serving short prompts ahead of the long ones delays the long ones.
    assert eight.long_ttft_pct > 0


def test_sweep_runs_on_a_1p1d_pair() -> None:
    (point,) = frontier(PROFILE, SMALL_LONG_THEN_STREAM, "1p1d", 256, [8], [0])
    assert point.count == 8


def test_best_member_and_verdicts() -> None:
    def point(count: int, cut: float, share, long_pct: float) -> FrontierPoint:
        return FrontierPoint(0, count, cut, share, long_pct, 0.0, 0.0)

    small, large, too_costly = point(10, 100, 50.0, 2.0), point(20, 300, 85.0, 4.9), point(30, 400, 95.0, 5.1)
    assert best_within_loss_limit([small, large, too_costly]) is large
    assert [p.meets_rule for p in (small, large, too_costly)] == [False, True, False]
    assert point(5, 0.0, None, 1.0).meets_rule  # hrrn cuts nothing: only the losses count
    assert not dataclasses.replace(point(5, -50.0, None, 1.0), short_ttft_pct=5.5).meets_rule
    assert best_within_loss_limit([too_costly]) is None
    table = frontier_markdown([small, large])
    assert "| 0 | 20 | 300 | 85% | +4.9% |" in table and table.endswith("start 0, count 20.")
    assert dataclasses.replace(large, long_e2e_pct=6.0).meets_rule is False


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--counts", "ten"], "expected integers"),
        (["--counts", "-3"], "expected integers"),
        (["--scenario", "nope"], "scenario must be one of"),
        (["--mode", "2p2d"], "mode must be one of"),
        (["--budget", "0"], "budget must be >= 1"),
        (["--prefill-max-overtake-tokens", "-1"], "--prefill-max-overtake-tokens"),
        (["--prefill-overtake-fraction", "inf"], "--prefill-overtake-fraction"),
    ],
)
def test_cli_refuses_bad_arguments_in_one_line(argv, message, capsys) -> None:
    assert_refused_in_one_line(main, argv, message, capsys)


def test_cli_prints_the_sweep(capsys) -> None:
    assert main(["--scenario", "long_first", "--budget", "4096", "--counts", "0", "--starts", "0"]) == 0
    out = capsys.readouterr().out
    assert "| 0 | 0 | 0 | 0% | +0.0% | +0.0% | +0.0% | no |" in out
