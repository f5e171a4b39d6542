"""Metric extraction, rotated visit order and the per-strategy analysis of a comparison."""

from __future__ import annotations

import math

import pytest

from lightllm.benchmark.comparison_metrics import (
    COMPARISON_METRICS,
    METRICS_BY_KEY,
    analyze_runs,
    median_or_none,
    rotated_order,
)


def _summary(short_ttft_p95=None, throughput=10.0, failed=0, with_long=True):
    classes = {"short": {"ttft_ms": {"p50": 5.0, "p95": short_ttft_p95}, "e2e_ms": {"p95": 9.0}}}
    if with_long:
        classes["long"] = {"ttft_ms": {"p50": 50.0, "p95": 80.0}, "e2e_ms": {"p95": 120.0}}
    return {"overall": {"output_throughput": throughput, "failed": failed}, "classes": classes}


def test_rotated_order_puts_every_strategy_in_every_position():
    names = ["a", "b", "c"]
    orders = [rotated_order(names, r) for r in range(6)]
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert orders[3:] == orders[:3]
    for position in range(3):
        assert sorted(order[position] for order in orders[:3]) == names


def test_rotated_order_validates():
    with pytest.raises(ValueError, match="strategies"):
        rotated_order([], 0)
    with pytest.raises(ValueError, match="repeat"):
        rotated_order(["a"], -1)


def test_metric_values_come_from_the_right_group():
    summary = _summary(short_ttft_p95=7.0, throughput=12.5)
    values = {m.key: m.value(summary) for m in COMPARISON_METRICS}
    assert values == {
        "short_ttft_p50_ms": 5.0,
        "short_ttft_p95_ms": 7.0,
        "long_ttft_p95_ms": 80.0,
        "long_e2e_p95_ms": 120.0,
        "output_throughput": 12.5,
    }
    assert [m.higher_is_better for m in COMPARISON_METRICS] == [False, False, False, False, True]


def test_missing_or_non_positive_values_are_missing_cells():
    assert METRICS_BY_KEY["long_ttft_p95_ms"].value(_summary(with_long=False)) is None
    assert METRICS_BY_KEY["short_ttft_p95_ms"].value(_summary(short_ttft_p95=None)) is None
    assert METRICS_BY_KEY["output_throughput"].value(_summary(throughput=0.0)) is None
    assert METRICS_BY_KEY["output_throughput"].value(_summary(throughput=None)) is None


def test_median_or_none():
    assert median_or_none([3.0, None, 1.0, 2.0]) == 2.0
    assert median_or_none([None, None]) is None


def test_analyze_runs_pairs_each_repeat_with_the_baseline():
    runs = {
        "default": [_summary(100.0, 10.0), _summary(200.0, 20.0), _summary(400.0, 10.0)],
        "hrrn": [_summary(50.0, 11.0), _summary(100.0, 22.0), _summary(200.0, 11.0, failed=2)],
    }
    result = analyze_runs(runs, "default")
    assert result["values"]["hrrn"]["short_ttft_p95_ms"] == [50.0, 100.0, 200.0]
    assert result["medians"]["default"]["short_ttft_p95_ms"] == 200.0
    assert set(result["changes"]) == {"hrrn"}
    short = result["changes"]["hrrn"]["short_ttft_p95_ms"]
    assert short["pairs"] == 3 and short["percent"] == pytest.approx(-50.0)
    throughput = result["changes"]["hrrn"]["output_throughput"]
    assert throughput["percent"] == pytest.approx(10.0)
    assert throughput["log_ratios"] == pytest.approx([math.log(1.1)] * 3)
    assert result["failed"] == {"default": 0, "hrrn": 2}


def test_analyze_runs_keeps_missing_cells_out_of_the_pairs():
    runs = {"default": [_summary(100.0), _summary(None)], "hrrn": [_summary(50.0), _summary(60.0)]}
    change = analyze_runs(runs, "default")["changes"]["hrrn"]["short_ttft_p95_ms"]
    assert change["pairs"] == 1 and change["repeats_used"] == [0]


def test_analyze_runs_validates():
    with pytest.raises(ValueError, match="baseline"):
        analyze_runs({"hrrn": [_summary(1.0)]}, "default")
    with pytest.raises(ValueError, match="same number of repeats"):
        analyze_runs({"default": [_summary(1.0)], "hrrn": [_summary(1.0), _summary(1.0)]}, "default")
