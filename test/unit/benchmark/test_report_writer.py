"""Markdown tables, JSON and PNG plots of a strategy comparison, from hand-made summaries."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from lightllm.benchmark.comparison_metrics import analyze_runs
from lightllm.benchmark.paired_stats import INTERVAL_METHOD
from lightllm.benchmark.report_plots import change_whiskers, plot_throughput
from lightllm.benchmark.report_writer import (
    describe_workload,
    format_change,
    format_ms,
    format_percent,
    plot_ttft_cdf,
    render_markdown,
    write_report,
)
from lightllm.benchmark.workloads import WorkloadConfig

STRATEGIES = ["default", "promote_shortest", "hrrn"]


def _summary(short_p50, short_p95, long_p95, long_e2e_p95, throughput, failed=0):
    return {
        "overall": {"output_throughput": throughput, "failed": failed},
        "classes": {
            "short": {"ttft_ms": {"p50": short_p50, "p95": short_p95}, "e2e_ms": {"p95": 1.0}},
            "long": {"ttft_ms": {"p50": 1.0, "p95": long_p95}, "e2e_ms": {"p95": long_e2e_p95}},
        },
    }


def _report(failed_hrrn=0, confidence=0.95, repeats=2):
    summaries = {
        "default": [_summary(1600, 2700, 20000, 30000, 480.0), _summary(1700, 2800, 20100, 30100, 470.0),
                    _summary(1650, 2750, 20050, 30050, 475.0)][:repeats],
        "promote_shortest": [_summary(320, 400, 20100, 30300, 476.0), _summary(340, 420, 20200, 30500, 466.0),
                             _summary(330, 410, 20150, 30400, 471.0)][:repeats],
        "hrrn": [_summary(400, 440, 20000, 30000, 480.0), _summary(425, 466.7, 20100, 30100, 470.0, failed_hrrn),
                 _summary(412.5, 453.3, 20050, 30050, 475.0)][:repeats],
    }
    section = {
        "workload": dataclasses.asdict(WorkloadConfig(name="long_first")),
        **analyze_runs(summaries, "default", confidence=confidence),
    }
    meta = {
        "model_dir": "/models/demo",
        "strategies": STRATEGIES,
        "baseline": "default",
        "repeats": repeats,
        "warmup": 1,
        "seed": 0,
        "server_args": ["--chunked_prefill_size", "256", "--batch_max_tokens", "256"],
        "command": "python -m lightllm.benchmark.compare_strategies --model_dir /models/demo",
        "git": {"commit": "abc123", "dirty": True},
        "machine": {"cpu_count": 2, "torch": "2.x", "platform": "Linux"},
        "interval": {"method": INTERVAL_METHOD, "confidence": confidence},
        "topology": {"name": "normal"},
    }
    return {"meta": meta, "workloads": {"long_first": section}}


def test_number_formats():
    assert format_ms(None) == "-"
    assert format_ms(1636.4) == "1636"
    assert format_ms(47.46) == "47.5"
    assert format_percent(None) == "-"
    assert format_percent(-0.549) == "-0.5%"
    assert format_percent(2.04) == "+2.0%"
    change = {"percent": -9.12, "ci_low_percent": -13.94, "ci_high_percent": -6.3}
    assert format_change(change) == "-9.1% [-13.9, -6.3]"
    assert format_change({**change, "pairs": 3}) == "-9.1% [-13.9, -6.3] n=3"
    assert format_change({"percent": None}) == "-"
    assert format_change(None) == "-"


def test_markdown_has_the_absolute_table_laid_out_like_the_seed():
    text = render_markdown(_report())
    assert "## long_first" in text
    assert (
        "| Strategy | Short TTFT median / P95 (ms) | Long TTFT P95 (ms) | Output tokens/s | Throughput vs default |"
        in text
    )
    # Medians over the two repeats.
    assert "| default | 1650 / 2750 | 20050 | 475.00 | \u2014 |" in text
    ratio = math.sqrt((476 / 480) * (466 / 470))
    assert f"| promote_shortest | 330 / 410 | 20150 | 471.00 | {100 * (ratio - 1):+.1f}% |" in text


def test_markdown_has_the_change_table_with_intervals():
    text = render_markdown(_report())
    assert "Change vs default [95% CI]" in text
    assert "| Strategy | Short TTFT median | Short TTFT P95 | Long TTFT P95 | Long E2E P95 | Output tokens/s |" in text
    hrrn_row = next(line for line in text.splitlines() if line.startswith("| hrrn |") and "[" in line)
    cells = [c.strip() for c in hrrn_row.strip("|").split("|")]
    # hrrn's short TTFT median is exactly 0.25x default in repeat 0 and 0.25x in repeat 1.
    assert cells[1] == "-75.0% [-75.0, -75.0] n=2"
    # Identical long and throughput numbers: no change, degenerate interval.
    assert cells[3] == "+0.0% [+0.0, +0.0] n=2"
    assert cells[5] == "+0.0% [+0.0, +0.0] n=2"
    change_table = text.split("Change vs default [95% CI]", 1)[1]
    rows = [line.split("|")[1].strip() for line in change_table.splitlines()
            if line.startswith("| ") and not set(line) <= set("|- ")]  # not the header's separator
    assert rows == ["Strategy", "promote_shortest", "hrrn"]


def test_the_interval_label_follows_the_configured_confidence_and_names_its_pairs():
    text = render_markdown(_report(confidence=0.5, repeats=3))
    assert "Change vs default [50% CI] (n: paired repeats the interval rests on)" in text
    assert "[95% CI]" not in text and "the 50% paired Student-t interval of that mean" in text
    hrrn_row = next(line for line in text.splitlines() if line.startswith("| hrrn |") and "[" in line)
    assert all(cell.strip().endswith("n=3") for cell in hrrn_row.strip("|").split("|")[1:])
    # Three pairs: an interval on two degrees of freedom, no warning.
    assert "Measure more repeats" not in text


def test_one_or_two_pairs_are_flagged():
    two = render_markdown(_report(repeats=2))
    assert "with n=2 the interval rests on one degree of freedom (t = 12.7 at 95%), so it is very wide" in two
    one = render_markdown(_report(repeats=1))
    assert "With n=1 there is no interval (one ratio has no spread to estimate)" in one
    hrrn_row = next(line for line in one.splitlines() if line.startswith("| hrrn |") and "[" in line)
    assert all(cell.strip().endswith("[no interval] n=1") for cell in hrrn_row.strip("|").split("|")[1:])


def test_a_run_that_stopped_early_says_so():
    report = _report(repeats=1)
    report["meta"]["repeats"] = 3
    report["meta"]["stopped_early"] = "the hrrn server stopped running (during long_first-repeat-1)"
    section = report["workloads"]["long_first"]
    section.update(visit_orders=[STRATEGIES], stopped_early=report["meta"]["stopped_early"])
    text = render_markdown(report)
    assert "- **Stopped early**: the hrrn server stopped running (during long_first-repeat-1)." in text
    assert "**Stopped early** after 1 complete repeat(s): the hrrn server stopped running" in text


def test_markdown_records_the_run_facts():
    text = render_markdown(_report())
    assert "`--chunked_prefill_size 256 --batch_max_tokens 256`" in text
    assert "abc123 (uncommitted changes)" in text
    assert "2 measured repeat(s) in rotated order after 1 warm-up pass(es)" in text
    assert "48 long x 16384 tokens" in text


def test_failures_are_reported_only_when_present():
    assert "Failed measured requests" not in render_markdown(_report())
    text = render_markdown(_report(failed_hrrn=3))
    assert "Failed measured requests: default: 0, promote_shortest: 0, hrrn: 3" in text


def test_a_lone_baseline_has_no_change_table():
    report = _report()
    report["meta"]["strategies"] = ["default"]
    text = render_markdown(report)
    assert "| default |" in text
    assert "Change vs default [95% CI]" not in text


@pytest.mark.parametrize(
    "cfg, expected",
    [
        (WorkloadConfig(name="long_first", long_count=16, long_len=2048, short_count=16, short_len=64, output_len=32),
         "16 long x 2048 tokens sent at 0-47 ms, then 16 short x 64 tokens at 60-107 ms; output 32"),
        (WorkloadConfig(name="interleaved", num_requests=48, request_rate=2.0, long_every=4, long_len=2048,
                        short_len=64, output_len=32, short_output_len=8),
         "48 requests at 2 req/s, one long in 4 (long 2048 / short 64 tokens); output long 32 / short 8"),
        (WorkloadConfig(name="sustained", request_rate=60, duration_s=8, long_fraction=0.25, initial_long_count=16),
         "60 req/s for 8 s (gamma gaps, burstiness 1), 25% long (long 16384 / short 128 tokens), "
         "after 16 initial long requests; output 128"),
        (WorkloadConfig(name="shared_prefix", request_rate=4, duration_s=15, long_fraction=0.2, long_len=1024,
                        short_len=32, prefix_tokens=512, output_len=16),
         "4 req/s for 15 s (Poisson), 20% cold 1024-token prompts, the rest few-shot (4 templates of 512 tokens "
         "+ 32) or chat turns (+32 tokens a turn, 4 turns); output 16"),
    ],
)
def test_describe_workload(cfg, expected):
    assert describe_workload(dataclasses.asdict(cfg)) == expected


def test_describe_workload_rejects_unknown_names():
    with pytest.raises(ValueError, match="workload name"):
        describe_workload({"name": "bogus", "output_len": 1})


def test_write_report_writes_json_markdown_and_plots(tmp_path):
    report = _report()
    samples = {
        "long_first": {
            s: {"short": [10.0 * (i + 1) for i in range(6)], "long": [500.0 + i for i in range(6)]} for s in STRATEGIES
        }
    }
    paths = write_report(report, tmp_path, samples)
    assert set(paths) == {"json", "markdown", "ttft_cdf_long_first", "throughput_long_first"}
    for key in ("ttft_cdf_long_first", "throughput_long_first"):
        data = open(paths[key], "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    saved = json.loads(open(paths["json"], encoding="utf-8").read())
    assert saved["files"]["markdown"] == "report.md"
    assert saved["workloads"]["long_first"]["medians"]["default"]["short_ttft_p50_ms"] == 1650
    assert open(paths["markdown"], encoding="utf-8").read() == render_markdown(saved)


def test_cdf_plot_accepts_a_missing_class_and_rejects_no_data(tmp_path):
    path = plot_ttft_cdf({"default": {"short": [1.0, 2.0]}, "hrrn": {"short": [0.0, 3.0]}}, tmp_path / "a.png", "t")
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="at least one TTFT"):
        plot_ttft_cdf({"default": {"short": []}}, tmp_path / "b.png", "t")


def test_write_report_without_any_ttft_skips_only_the_cdf(tmp_path):
    # Every request failed: no TTFT to plot, but the report (and its failure counts) is written.
    report = _report(failed_hrrn=6)
    paths = write_report(report, tmp_path, {"long_first": {s: {"short": [], "long": []} for s in STRATEGIES}})
    assert set(paths) == {"json", "markdown", "throughput_long_first"}
    assert not (tmp_path / "ttft_cdf_long_first.png").exists()
    assert json.loads(open(paths["json"], encoding="utf-8").read())["files"] == {
        "json": "report.json", "markdown": "report.md", "throughput_long_first": "throughput_long_first.png"
    }


def test_the_markdown_says_when_every_prompt_shared_a_prefix():
    report = _report()
    assert "--shared-prefix-len" not in render_markdown(report)
    report["meta"]["shared_prefix_len"] = 32
    assert "- Every prompt of a pass starts with the same 32 tokens (--shared-prefix-len" in render_markdown(report)


def test_throughput_whiskers_cut_at_the_cap_say_where_the_interval_ends(tmp_path):
    def change(low, high):
        return {"percent": 0.0, "ci_low_percent": low, "ci_high_percent": high, "pairs": 2}

    changes = [change(-5.0, 4.0), change(-900.0, 1200.0), change(-20.0, None), change(None, None)]
    points = [1.0, 10.0, 3.0, 0.0]
    low, high, labels = change_whiskers(points, changes)
    assert low == [6.0, 500.0, 23.0, 0.0] and high == [3.0, 500.0, 500.0, 0.0]
    # Only the cut whiskers are labelled, with the interval's real end; an unbounded end says so.
    assert labels == [[], [(-1, "to -900%"), (1, "to +1200%")], [(1, "unbounded")], []]
    section = {
        "values": {s: {"output_throughput": [10.0, 12.0]} for s in ("default", "a", "b", "c", "d")},
        "medians": {s: {"output_throughput": 11.0} for s in ("default", "a", "b", "c", "d")},
        "changes": {s: {"output_throughput": dict(c, percent=p)} for s, c, p in zip("abcd", changes, points)},
    }
    path = plot_throughput(section, ["default", "a", "b", "c", "d"], "default", tmp_path / "t.png", "t")
    assert path.read_bytes()[:4] == b"\x89PNG"
