"""The seed report's six scenarios and every number it published, as the simulator reports them."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Dict, List

import pytest
from simulator_test_support import make_profile

from lightllm.benchmark.simulator.__main__ import main as cli_main
from lightllm.benchmark.simulator.cost_model import load_profile
from lightllm.benchmark.simulator.published import (
    METRIC_LABELS,
    PUBLISHED_COMPARISONS,
    PUBLISHED_SEED_SUSTAINED_CHANGES,
    SOURCE_RANGE,
    PublishedComparison,
)
from lightllm.benchmark.simulator.published_report import (
    compare_published,
    compared_json,
    published_changes_markdown,
)
from lightllm.benchmark.simulator.report import full_report_markdown, results_json
from lightllm.benchmark.simulator.report_format import MODE_LABELS
from lightllm.benchmark.simulator.runner import CaseKey, CaseResult, simulate_case
from lightllm.benchmark.simulator.scenarios import (
    MODES,
    SCENARIOS,
    SEED_BUDGETS,
    SEED_SCENARIOS,
    ScenarioSpec,
    resolve_scenarios,
)
from lightllm.benchmark.workloads import LONG, SHORT

# Synthetic metric levels per strategy: every change between two of them is non-zero.
LEVELS = {"default": 100.0, "promote_shortest": 80.0, "hrrn": 90.0}


# --- the scenarios -------------------------------------------------------------------------------
def test_seed_all_runs_the_six_seed_scenarios_and_the_cost_case() -> None:
    assert SEED_SCENARIOS == (
        "long_first", "interleaved", "sustained", "low_load", "sustained_overload", "short_majority",
    )
    assert [s.name for s in resolve_scenarios(["seed_six"])] == list(SEED_SCENARIOS)
    assert [s.name for s in resolve_scenarios(["seed_all"])] == list(SEED_SCENARIOS) + ["long_then_stream"]
    # As the seed ran them: six scenarios x two modes x two budgets = 24 groups.
    assert len(SEED_SCENARIOS) * len(MODES) * len(SEED_BUDGETS) == 24
    for name in SEED_SCENARIOS:
        assert "seed scenario" in SCENARIOS[name].title


@pytest.mark.parametrize(
    "name, long_len, long_fraction, rate",
    [
        ("sustained", 8192, 0.25, 60.0),
        ("low_load", 4096, 0.25, 20.0),
        ("sustained_overload", 16384, 0.10, 120.0),
        ("short_majority", 8192, 0.10, 60.0),
    ],
)
def test_poisson_seed_scenarios_have_the_seed_parameters(
    name: str, long_len: int, long_fraction: float, rate: float
) -> None:
    workload = SCENARIOS[name].build(seed=0)
    longs = [r for r in workload if r.request_class == LONG]
    shorts = [r for r in workload if r.request_class == SHORT]
    assert {r.prompt_len for r in longs} == {long_len} and {r.prompt_len for r in shorts} == {128}
    assert {r.output_len for r in workload} == {128}
    assert len(workload) == pytest.approx(rate * 8.0, rel=0.15)
    assert len(longs) / len(workload) == pytest.approx(long_fraction, abs=0.05)
    assert max(r.scheduled_time_s for r in workload) < 8.0


def _short(spec: ScenarioSpec, duration_s: float) -> ScenarioSpec:
    return dataclasses.replace(spec, workload=dataclasses.replace(spec.workload, duration_s=duration_s))


@pytest.mark.parametrize("name", ["low_load", "short_majority"])
@pytest.mark.parametrize("mode", MODES)
def test_new_seed_scenarios_run_in_both_modes(name: str, mode: str) -> None:
    # One simulated second keeps the test quick; the shape (lengths, rate, long share) is the seed's.
    spec = _short(SCENARIOS[name], 1.0)
    for strategy in ("default", "hrrn"):
        result = simulate_case(make_profile(), spec, mode, 1024, strategy)
        assert result.summary["overall"]["failed"] == 0
        assert result.metrics["short_ttft_p95_ms"] is not None and result.metrics["output_tok_s"] > 0
        assert result.metrics["short_tpot_p50_ms"] is not None and result.metrics["short_e2e_p95_ms"] is not None


# --- the published rows --------------------------------------------------------------------------
def test_published_rows_cover_every_cell_the_seed_published() -> None:
    rows = PUBLISHED_COMPARISONS
    cells = {(r.scenario, r.mode, r.budget, r.strategy, r.baseline, r.metric) for r in rows}
    assert len(cells) == len(rows), "one row per published number"
    # The absolute normal / 1024 tables: both new strategies against default, in both scenarios.
    for scenario in ("long_first", "interleaved"):
        for strategy in ("promote_shortest", "hrrn"):
            for metric in METRIC_LABELS:
                if metric != "long_e2e_p95_ms":
                    assert (scenario, "normal", 1024, strategy, "default", metric) in cells
    # The sustained changes versus default: four cells, two strategies, three metrics.
    for (mode, budget), by_strategy in PUBLISHED_SEED_SUSTAINED_CHANGES.items():
        for strategy, change in by_strategy.items():
            for metric, pct in zip(("short_ttft_p95_ms", "long_e2e_p95_ms", "output_tok_s"), change):
                assert ("sustained", mode, budget, strategy, "default", metric) in cells
                assert any(r.published_pct == pct for r in rows if r.scenario == "sustained" and r.mode == mode)
    paired = [r for r in rows if r.scenario == "sustained" and r.baseline == "promote_shortest"]
    assert len(paired) == 12 and all(r.ci_pct is not None for r in paired)
    by_cell = {(r.scenario, r.mode, r.budget, r.strategy, r.baseline, r.metric): r for r in rows}
    assert by_cell[("long_then_stream", "1p1d", 1024, "hrrn", "default", "short_ttft_p95_ms")].published_pct == -63.6
    assert by_cell[("long_then_stream", "1p1d", 1024, "hrrn", "default", "long_e2e_p95_ms")].ci_pct == (60.7, 70.4)
    promote_tail = by_cell[("long_then_stream", "1p1d", 1024, "promote_shortest", "default", "long_e2e_p95_ms")]
    assert promote_tail.published_pct == 73.8
    overload_tput = by_cell[("sustained_overload", "1p1d", 4096, "hrrn", "promote_shortest", "output_tok_s")]
    # "吞吐下降 5.6% [4.1, 7.3]" is a drop: the change and its interval are negative.
    assert overload_tput.published_pct == -5.6 and overload_tput.ci_pct == (-7.3, -4.1)
    assert by_cell[("sustained_overload", "1p1d", 4096, "hrrn", "promote_shortest", "long_e2e_p95_ms")].ci_pct == (
        3.2, 18.3,
    )
    for row in rows:
        assert row.scenario in SCENARIOS and row.mode in MODES and row.budget in SEED_BUDGETS
        assert row.metric in METRIC_LABELS
        assert row.published_sign() in (-1, 1)
        if row.ci_pct is not None and row.published_pct is not None:
            assert row.ci_pct[0] <= row.published_pct <= row.ci_pct[1]


def _synthetic_results(levels: Dict[str, float]) -> List[CaseResult]:
    keys = {
        CaseKey(r.scenario, r.mode, r.budget, strategy)
        for r in PUBLISHED_COMPARISONS
        for strategy in (r.strategy, r.baseline)
    }
    return [
        CaseResult(key=key, metrics={m: levels[key.strategy] for m in METRIC_LABELS}, summary={}, steps=0)
        for key in sorted(keys, key=lambda k: dataclasses.astuple(k))
    ]


def test_every_published_row_is_printed_with_a_simulated_value_and_a_sign_check() -> None:
    results = _synthetic_results(LEVELS)
    markdown = full_report_markdown(make_profile(), results, seed=0)
    assert "| same sign |" in markdown
    for row in PUBLISHED_COMPARISONS:
        expected = (LEVELS[row.strategy] / LEVELS[row.baseline] - 1.0) * 100.0
        sign = "yes" if (expected > 0) == (row.published_sign() > 0) else "no"
        prefix = (
            f"| {row.scenario} | {MODE_LABELS[row.mode]} / {row.budget} | {row.strategy} | {row.baseline} "
            f"| {METRIC_LABELS[row.metric]} | "
        )
        lines = [line for line in markdown.splitlines() if line.startswith(prefix)]
        assert len(lines) == 1, prefix
        cells = [cell.strip() for cell in lines[0].strip("|").split("|")]
        assert cells[6] == f"{expected:+.1f}%" and cells[7] == sign, lines[0]
        if row.ci_pct is not None:
            assert f"[{row.ci_pct[0]:+.1f}, {row.ci_pct[1]:+.1f}]" in cells[5]
        if row.source == SOURCE_RANGE:
            assert " to " in cells[5]
    assert f"of {len(PUBLISHED_COMPARISONS)} rows." in markdown and "left out" not in markdown
    document = results_json(make_profile(), results, seed=0)
    json.dumps(document)  # serialisable
    assert len(document["published_in_seed_report"]["comparisons"]) == len(PUBLISHED_COMPARISONS)
    compared = document["published_vs_simulated"]
    assert len(compared) == len(PUBLISHED_COMPARISONS)
    assert all(c["simulated_pct"] is not None and c["same_sign"] in (True, False) for c in compared)
    assert document["published_in_seed_report"]["sustained_changes_pct"]  # the old key still there


def test_sign_check_compares_the_signs_and_leaves_out_cells_not_simulated() -> None:
    row = PublishedComparison("sustained", "1p1d", 1024, "hrrn", "default", "short_ttft_p95_ms", -92.8)
    better = _synthetic_results({"default": 100.0, "promote_shortest": 100.0, "hrrn": 10.0})
    worse = _synthetic_results({"default": 100.0, "promote_shortest": 100.0, "hrrn": 101.8})
    assert compare_published(better, [row])[0].same_sign is True
    assert compare_published(worse, [row])[0].same_sign is False
    assert compare_published(better, [row])[0].simulated_pct == pytest.approx(-90.0)
    only_one = [r for r in better if r.key.scenario == "long_first"]
    assert compare_published(only_one, [row]) == []
    assert all(c["scenario"] == "long_first" for c in compared_json(only_one))
    partial = published_changes_markdown(only_one)
    assert "left out because their cells were not simulated" in partial
    range_row = PublishedComparison(
        "long_first", "normal", 1024, "hrrn", "default", "short_tpot_p50_ms", None, range_pct=(6.0, 21.0),
        source=SOURCE_RANGE,
    )
    assert range_row.published_sign() == 1
    assert compare_published(better, [range_row])[0].same_sign is False


def test_cli_prints_the_sign_table_for_a_seed_cell(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out_json = tmp_path / "r.json"
    code = cli_main(["--profile", "h100_qwen_0p8b", "--scenario", "interleaved", "--budget", "1024",
                     "--modes", "normal", "--strategies", "default,promote_shortest,hrrn", "--json", str(out_json)])
    assert code == 0
    printed = capsys.readouterr().out
    assert re.search(r"\| interleaved \| normal / 1024 \| hrrn \| default \| short TTFT P95 \| -93\.5% \| "
                     r"[+-]\d+\.\d% \| (yes|no) \|", printed)
    compared = json.loads(out_json.read_text())["published_vs_simulated"]
    assert len(compared) == 12 and all(c["scenario"] == "interleaved" for c in compared)


def test_absolute_comparison_follows_the_seed_profiles_numbers_not_its_name() -> None:
    """A copy of the bundled H100 profile with other costs keeps the name but is not the H100."""
    results = _synthetic_results(LEVELS)
    heading = "compared only under `--profile h100_qwen_0p8b`"
    bundled = load_profile("h100_qwen_0p8b")
    assert heading not in full_report_markdown(bundled, results, seed=0)
    renamed = dataclasses.replace(bundled, name="my_copy")
    assert heading not in full_report_markdown(renamed, results, seed=0)
    edited = dataclasses.replace(bundled, prefill_per_token_s=bundled.prefill_per_token_s * 2)
    assert heading in full_report_markdown(edited, results, seed=0)
    smaller = dataclasses.replace(bundled, max_total_token_num=bundled.max_total_token_num // 2)
    assert heading in full_report_markdown(smaller, results, seed=0)


def test_a_report_without_the_bundled_seed_profile_still_prints(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A trimmed install lacking the H100 file: the report skips the absolute comparison, never fails."""
    from lightllm.benchmark.simulator import report

    monkeypatch.setattr(report, "PROFILE_DIR", tmp_path)
    (tmp_path.parent / "h100_qwen_0p8b").mkdir(exist_ok=True)  # a same-named path elsewhere is not read
    monkeypatch.chdir(tmp_path.parent)
    markdown = full_report_markdown(make_profile(), _synthetic_results(LEVELS), seed=0)
    assert "compared only under `--profile h100_qwen_0p8b`" in markdown
