"""The just-in-time yardstick of the simulator (``deadline_frontier.py``): its order and its sweep."""

from __future__ import annotations

import pytest
from prefill_queue_test_support import ids, make_req
from simulator_test_support import assert_refused_in_one_line, make_profile

from lightllm.benchmark.metrics import percentile
from lightllm.benchmark.simulator.deadline_frontier import (
    DeadlinePoint,
    ShortsByDeadline,
    deadline_frontier,
    deadline_markdown,
    main,
    prefill_node_records,
)
from lightllm.benchmark.simulator.scenarios import ScenarioSpec
from lightllm.benchmark.workloads import SHORT, WorkloadConfig

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


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_order(due_s: float, spared: int = 0, batch_size: int = 2) -> tuple[ShortsByDeadline, FakeClock]:
    # Request 1 is long (arrived at 0); 3, 4, 5 are short, arriving at 0.1, 0.2, 0.3 s.
    order = ShortsByDeadline({1: 0.0, 3: 0.1, 4: 0.2, 5: 0.3}, [5, 3, 4], due_s, spared, batch_size)
    clock = FakeClock()
    order.bind_clock(clock)
    return order, clock


def test_a_due_short_prompt_leads_with_the_next_ones_up_to_a_full_step() -> None:
    order, clock = make_order(due_s=1.0)
    reqs = [make_req(1, 4000), make_req(3, 50), make_req(4, 50), make_req(5, 50)]
    clock.now = 1.09  # nothing is due yet: default's order
    assert ids(order.order(reqs, 0)) == [1, 3, 4, 5]
    clock.now = 1.1  # 3 is due: it and the next short prompt in arrival order lead
    assert ids(order.order(reqs, 0)) == [3, 4, 1, 5]


def test_spared_short_prompts_keep_their_first_come_place() -> None:
    order, clock = make_order(due_s=0.0, spared=1)
    clock.now = 5.0
    reqs = [make_req(1, 4000), make_req(3, 50), make_req(4, 50), make_req(5, 50)]
    assert ids(order.order(reqs, 0)) == [4, 5, 1, 3]


def test_needs_a_clock_and_refuses_meaningless_settings() -> None:
    order = ShortsByDeadline({3: 0.0}, [3], 1.0, 0, 1)
    with pytest.raises(RuntimeError, match="bind_clock"):
        order.order([make_req(3, 50)], 0)
    with pytest.raises(ValueError, match="due_s"):
        ShortsByDeadline({3: 0.0}, [3], -1.0, 0, 1)
    with pytest.raises(ValueError, match="spared"):
        ShortsByDeadline({3: 0.0}, [3], 1.0, -1, 1)
    with pytest.raises(ValueError, match="batch_size"):
        ShortsByDeadline({3: 0.0}, [3], 1.0, 0, 0)
    with pytest.raises(ValueError, match="no arrival time"):
        ShortsByDeadline({3: 0.0}, [3, 4], 1.0, 0, 1)


def test_sweep_rows_match_direct_simulations() -> None:
    points = deadline_frontier(PROFILE, SMALL_LONG_THEN_STREAM, "normal", 256, [60_000.0, 100.0], [0, 5])
    default, hrrn, never_due, _, prompt, spared = points
    assert [default.label, hrrn.label] == ["default", "hrrn"]
    assert (default.short_ttft_p95_pct, default.long_ttft_p95_pct, default.slower_than_default) == (0.0, 0.0, 0)
    # A target no short prompt ever reaches leaves default's order, so nothing changes.
    assert never_due.label == "due 60000 ms, spared 0"
    assert (never_due.short_ttft_p95_pct, never_due.long_ttft_p95_pct, never_due.slower_than_default) == (0, 0, 0)
    # Serving short prompts by a 100 ms target cuts their TTFT and delays the long prompts.
    assert prompt.label == "due 100 ms, spared 0"
    assert prompt.short_ttft_p95_pct < 0 < prompt.long_ttft_p95_pct
    workload = SMALL_LONG_THEN_STREAM.build(0)
    records = prefill_node_records(PROFILE, workload, "default", "normal", 256)
    shorts = [1000 * (r.first_token_time - r.send_time) for r in records if r.request_class == SHORT]
    assert default.short_ttft_p99_ms == pytest.approx(percentile(shorts, 99))
    # The spared short prompts wait for every long prompt, so they end up slower than under default.
    assert spared.label == "due 100 ms, spared 5" and spared.slower_than_default >= 1
    assert spared.most_slower_ms > 0


def test_markdown_lists_every_row() -> None:
    table = deadline_markdown(
        [DeadlinePoint("default", 0.0, 0.0, 4448.0, 0), DeadlinePoint("x", -50.1, 9.3, 4900.4, 47, 464.2)]
    )
    assert "| default | +0.0% | +0.0% | 4448 | 0 | 0 |" in table
    assert table.endswith("| x | -50.1% | +9.3% | 4900 | 47 | 464 |")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--due-ms", "soon"], "comma list of numbers"),
        (["--due-ms", "-5"], "number >= 0"),
        (["--spared", "1.5"], "expected integers"),
        (["--scenario", "nope"], "scenario must be one of"),
        (["--mode", "2p2d"], "mode must be one of"),
        (["--budget", "0"], "budget must be >= 1"),
        (["--prefill-overtake-fraction", "inf"], "--prefill-overtake-fraction"),
    ],
)
def test_cli_refuses_bad_arguments_in_one_line(argv, message, capsys) -> None:
    assert_refused_in_one_line(main, argv, message, capsys)
