"""Paired log-ratio estimate and its Student-t interval."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lightllm.benchmark.paired_stats import (
    INTERVAL_METHOD,
    log_ratio_to_percent,
    paired_change,
    paired_log_ratios,
    t_mean_interval,
)


def test_log_ratio_to_percent():
    assert log_ratio_to_percent(0.0) == 0.0
    assert log_ratio_to_percent(math.log(2.0)) == pytest.approx(100.0)
    assert log_ratio_to_percent(math.log(0.5)) == pytest.approx(-50.0)


def test_paired_log_ratios_per_repeat():
    ratios, used = paired_log_ratios([2.0, 3.0, 1.0], [1.0, 6.0, 4.0])
    assert ratios.tolist() == pytest.approx([math.log(2.0), math.log(0.5), math.log(0.25)])
    assert used == (0, 1, 2)


def test_missing_cells_drop_only_their_repeat():
    ratios, used = paired_log_ratios([2.0, None, 4.0, 5.0], [1.0, 1.0, None, 5.0])
    assert used == (0, 3)
    assert ratios.tolist() == pytest.approx([math.log(2.0), 0.0])


def test_length_mismatch_is_rejected():
    with pytest.raises(ValueError, match="one value per repeat"):
        paired_log_ratios([1.0, 2.0], [1.0])


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_non_positive_values_are_rejected(bad):
    with pytest.raises(ValueError, match=r"candidate\[1\]"):
        paired_log_ratios([1.0, bad], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"baseline\[0\]"):
        paired_log_ratios([1.0, 1.0], [bad, 1.0])


def test_change_is_the_geometric_mean_ratio():
    change = paired_change([1.1, 1.21], [1.0, 1.0])
    assert change.pairs == 2
    assert change.mean_log_ratio == pytest.approx(1.5 * math.log(1.1))
    assert change.percent == pytest.approx(100.0 * (1.1**1.5 - 1.0))


def test_opposite_changes_cancel():
    # A 2x slowdown in one repeat and a 2x speedup in another average to no change.
    change = paired_change([2.0, 0.5], [1.0, 1.0])
    assert change.percent == pytest.approx(0.0, abs=1e-12)
    # Two pairs: one degree of freedom, t = 12.706; sd of (ln 2, -ln 2) is ln 2 * sqrt(2).
    half_width = 12.706204736 * math.log(2.0) * math.sqrt(2.0) / math.sqrt(2.0)
    assert change.ci_low_percent == pytest.approx(log_ratio_to_percent(-half_width), rel=1e-8)
    assert change.ci_high_percent == pytest.approx(log_ratio_to_percent(half_width), rel=1e-8)


def test_identical_ratios_give_a_degenerate_interval():
    change = paired_change([2.0, 4.0, 8.0], [1.0, 2.0, 4.0])
    assert change.percent == pytest.approx(100.0)
    assert change.ci_low_percent == pytest.approx(100.0)
    assert change.ci_high_percent == pytest.approx(100.0)


def test_interval_is_the_student_t_interval_of_the_mean_log_ratio():
    rng = np.random.default_rng(7)
    baseline = rng.uniform(50, 150, 5)
    candidate = baseline * np.exp(rng.normal(-0.2, 0.1, 5))
    change = paired_change(candidate.tolist(), baseline.tolist())
    ratios = np.log(candidate / baseline)
    # t_{4, 0.975} from tables: 2.776445.
    half_width = 2.776445105 * ratios.std(ddof=1) / math.sqrt(5)
    assert change.ci_low_percent == pytest.approx(log_ratio_to_percent(ratios.mean() - half_width), rel=1e-7)
    assert change.ci_high_percent == pytest.approx(log_ratio_to_percent(ratios.mean() + half_width), rel=1e-7)
    assert change.method == INTERVAL_METHOD


def test_few_repeats_widen_the_interval_past_the_observed_ratios():
    # The former bootstrap could never reach past the most extreme observed ratio; a t interval
    # on three repeats does, since three ratios say little about where the true change lies.
    change = paired_change([1.1, 1.3, 1.2], [1.0, 1.0, 1.0])
    assert change.ci_low_percent < 10.0 and change.ci_high_percent > 30.0


def test_one_pair_has_no_interval():
    change = paired_change([1.5, None], [1.0, 1.0])
    assert change.pairs == 1 and change.percent == pytest.approx(50.0)
    assert change.ci_low_percent is None and change.ci_high_percent is None


def test_narrower_confidence_gives_a_narrower_interval():
    values = [0.3, -0.2, 0.5, 0.1, -0.4, 0.2, 0.05, 0.6]
    wide = t_mean_interval(values, confidence=0.95)
    narrow = t_mean_interval(values, confidence=0.5)
    assert wide[0] < narrow[0] < narrow[1] < wide[1]


@pytest.mark.parametrize("repeats", [3, 5, 10])
def test_the_interval_covers_the_true_change_at_its_confidence(repeats):
    # Synthetic repeats with a known true change and normal noise on the log ratio, as drift that
    # hits both sides of a pair alike leaves it.  Seeded, so the count is the same on every run;
    # on these draws the former bootstrap covered 76% at n=3, 82% at n=5 and 89% at n=10.
    rng = np.random.default_rng(1000 + repeats)
    true_log_ratio, trials, covered = 0.05, 2000, 0
    for _ in range(trials):
        baseline = rng.uniform(50.0, 150.0, repeats)
        candidate = baseline * np.exp(rng.normal(true_log_ratio, 0.1, repeats))
        change = paired_change(candidate.tolist(), baseline.tolist())
        low, high = math.log1p(change.ci_low_percent / 100.0), math.log1p(change.ci_high_percent / 100.0)
        covered += low <= true_log_ratio <= high
    assert 0.92 <= covered / trials <= 0.98


@pytest.mark.parametrize("confidence", [0.0, 1.0, 1.5, True])
def test_confidence_is_validated(confidence):
    with pytest.raises(ValueError, match="confidence"):
        t_mean_interval([0.1, 0.2], confidence=confidence)
    with pytest.raises(ValueError, match="confidence"):
        paired_change([None], [None], confidence=confidence)


def test_interval_rejects_empty_and_non_finite_values():
    with pytest.raises(ValueError, match="non-empty"):
        t_mean_interval([])
    with pytest.raises(ValueError, match="finite"):
        t_mean_interval([0.1, float("nan")])
    assert t_mean_interval([0.3]) is None


def test_no_pairs_gives_an_empty_change():
    change = paired_change([None, 2.0], [1.0, None])
    assert change.pairs == 0
    assert change.percent is None and change.ci_low_percent is None and change.ci_high_percent is None
    assert change.log_ratios == () and change.repeats_used == ()


def test_to_dict_is_json_serialisable():
    data = paired_change([1.5, None, 1.2], [1.0, 1.0, 1.0]).to_dict()
    decoded = json.loads(json.dumps(data))
    assert decoded["pairs"] == 2
    assert decoded["repeats_used"] == [0, 2]
    assert decoded["method"] == INTERVAL_METHOD and decoded["confidence"] == 0.95
    assert len(decoded["log_ratios"]) == 2


def test_an_upper_end_beyond_the_float_range_is_unbounded_not_a_crash() -> None:
    # Two repeats far apart at 99.99%: t is about 6366, the upper end exp(>709) overflows a float.
    change = paired_change([1.0, 1.35], [1.0, 1.0], confidence=0.9999)
    assert change.ci_high_percent is None and change.ci_low_percent is not None
    assert change.percent == pytest.approx(100 * (math.sqrt(1.35) - 1))
    json.dumps(change.to_dict(), allow_nan=False)  # strict JSON, as report.json is written
    from lightllm.benchmark.report_writer import format_change

    assert format_change(change.to_dict()).endswith(", unbounded] n=2")


def test_a_confidence_too_close_to_one_is_refused_before_the_run(tmp_path) -> None:
    from lightllm.benchmark.comparison_options import ComparisonOptions
    from lightllm.benchmark.workloads import WorkloadConfig

    options = ComparisonOptions(model_dir=str(tmp_path), workloads=[WorkloadConfig(name="long_first")],
                                out_dir=str(tmp_path / "out"), confidence=0.9999999999999999)
    with pytest.raises(ValueError, match="too close to 1 for a t interval"):
        options.validate()
