"""The overtaking-bound sweep tool: one row per bound and strategy, every cell filled."""

from __future__ import annotations


import pytest
from simulator_test_support import assert_refused_in_one_line

from lightllm.benchmark.simulator.bound_sweep import main, sweep, sweep_markdown
from lightllm.benchmark.simulator.cost_model import load_profile
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec


def test_sweep_reports_every_bound_strategy_and_cell() -> None:
    bounds = [OvertakeBoundSpec.off(), OvertakeBoundSpec()]
    rows = sweep(load_profile("h100_qwen_0p8b"), bounds, [("low_load", "normal", 4096)], ["hrrn", "promote_shortest"])
    assert [(r["bound"], r["strategy"]) for r in rows] == [
        ("off", "hrrn"), ("off", "promote_shortest"),
        ("2048 + 0.15 x FCFS wait", "hrrn"), ("2048 + 0.15 x FCFS wait", "promote_shortest"),
    ]
    assert all(isinstance(r["short_ttft_p95_ms"], float) for r in rows)
    table = sweep_markdown(rows).splitlines()
    assert len(table) == 2 + 4 and "low_load normal/4096" in table[0]
    assert table[4].startswith("| 2048 + 0.15 x FCFS wait | hrrn | ")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cells", "nope/normal/1024"], "cell scenario must be one of"),
        (["--cells", "sustained/1p1d"], "a cell is scenario/mode/budget"),
        (["--cells", "sustained/2p2d/1024"], "cell mode must be one of"),
        (["--bases", "-1"], "--bases takes integers >= 0"),
        (["--fractions", "nan"], "--fractions takes finite numbers >= 0"),
    ],
)
def test_cli_refuses_bad_arguments_in_one_line(argv, message, capsys) -> None:
    assert_refused_in_one_line(main, argv, message, capsys)
