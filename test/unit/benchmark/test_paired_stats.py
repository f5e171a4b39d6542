"""Paired log-ratio estimate and its seeded percentile bootstrap."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lightllm.benchmark.paired_stats import (
    bootstrap_mean_interval,
    log_ratio_to_percent,
    paired_change,
    paired_log_ratios,
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
    change = paired_change([1.1, 1.21], [1.0, 1.0], resamples=500, seed=3)
    assert change.pairs == 2
    assert change.mean_log_ratio == pytest.approx(1.5 * math.log(1.1))
    assert change.percent == pytest.approx(100.0 * (1.1**1.5 - 1.0))


def test_opposite_changes_cancel():
    # A 2x slowdown in one repeat and a 2x speedup in another average to no change.
    change = paired_change([2.0, 0.5], [1.0, 1.0], resamples=200)
    assert change.percent == pytest.approx(0.0, abs=1e-12)
    assert change.ci_low_percent == pytest.approx(-50.0)
    assert change.ci_high_percent == pytest.approx(100.0)


def test_identical_ratios_give_a_degenerate_interval():
    change = paired_change([2.0, 4.0, 8.0], [1.0, 2.0, 4.0])
    assert change.percent == pytest.approx(100.0)
    assert change.ci_low_percent == pytest.approx(100.0)
    assert change.ci_high_percent == pytest.approx(100.0)


def test_interval_brackets_the_estimate_within_the_observed_range():
    rng = np.random.default_rng(7)
    baseline = rng.uniform(50, 150, 12)
    candidate = baseline * np.exp(rng.normal(-0.2, 0.1, 12))
    change = paired_change(candidate.tolist(), baseline.tolist(), resamples=2000, seed=1)
    ratios = np.log(candidate / baseline)
    assert change.ci_low_percent <= change.percent <= change.ci_high_percent
    assert change.ci_low_percent >= log_ratio_to_percent(ratios.min())
    assert change.ci_high_percent <= log_ratio_to_percent(ratios.max())
    assert change.ci_low_percent < change.ci_high_percent


def test_bootstrap_is_seeded():
    values = [0.1, -0.3, 0.25, 0.0, 0.4, -0.1, 0.2]
    first = bootstrap_mean_interval(values, resamples=1000, seed=11)
    assert bootstrap_mean_interval(values, resamples=1000, seed=11) == first
    assert bootstrap_mean_interval(values, resamples=1000, seed=12) != first


def test_bootstrap_matches_the_normal_interval_for_a_large_sample():
    data = np.random.default_rng(0).normal(5.0, 2.0, 400)
    low, high = bootstrap_mean_interval(data, resamples=4000, seed=0)
    half_width = 1.96 * data.std(ddof=1) / math.sqrt(data.size)
    assert (low + high) / 2 == pytest.approx(data.mean(), abs=0.1 * half_width)
    assert (high - low) / 2 == pytest.approx(half_width, rel=0.1)


def test_narrower_confidence_gives_a_narrower_interval():
    values = [0.3, -0.2, 0.5, 0.1, -0.4, 0.2, 0.05, 0.6]
    wide = bootstrap_mean_interval(values, confidence=0.95, seed=2)
    narrow = bootstrap_mean_interval(values, confidence=0.5, seed=2)
    assert wide[0] < narrow[0] < narrow[1] < wide[1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"resamples": 0}, "resamples"),
        ({"resamples": 2.5}, "resamples"),
        ({"confidence": 1.0}, "confidence"),
        ({"confidence": 0.0}, "confidence"),
    ],
)
def test_bootstrap_settings_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bootstrap_mean_interval([0.1, 0.2], **kwargs)
    with pytest.raises(ValueError, match=match):
        paired_change([None], [None], **kwargs)


def test_bootstrap_rejects_empty_and_non_finite_values():
    with pytest.raises(ValueError, match="non-empty"):
        bootstrap_mean_interval([])
    with pytest.raises(ValueError, match="finite"):
        bootstrap_mean_interval([0.1, float("nan")])


def test_no_pairs_gives_an_empty_change():
    change = paired_change([None, 2.0], [1.0, None])
    assert change.pairs == 0
    assert change.percent is None and change.ci_low_percent is None and change.ci_high_percent is None
    assert change.log_ratios == () and change.repeats_used == ()


def test_to_dict_is_json_serialisable():
    data = paired_change([1.5, None, 1.2], [1.0, 1.0, 1.0], resamples=100).to_dict()
    decoded = json.loads(json.dumps(data))
    assert decoded["pairs"] == 2
    assert decoded["repeats_used"] == [0, 2]
    assert decoded["resamples"] == 100 and decoded["confidence"] == 0.95
    assert len(decoded["log_ratios"]) == 2
