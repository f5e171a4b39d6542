"""Paired comparison of a candidate against a baseline measured in the same repeats.

Each repeat measures every strategy on the same workload (same schedule, same prompts),
so repeat-to-repeat drift (machine load, thermal state, cache state) affects the
candidate and the baseline of one repeat alike. Comparing them repeat by repeat
cancels that shared part:

* per repeat ``r``: ``d_r = ln(candidate_r / baseline_r)``;
* estimate: ``mean(d)``, reported as a percent change ``exp(mean(d)) - 1``;
* interval at ``confidence`` (95% by default): percentile bootstrap of ``mean(d)`` over
  repeats (repeats are drawn with replacement, the mean recomputed, and the 2.5th / 97.5th
  percentiles at 95% of those means converted to percent the same way).

Log ratios make +x% and -x% symmetric in the average (a 2x slowdown and a 2x speedup
cancel) and the exponent of their mean is the geometric mean of the ratios. With very
few repeats the bootstrap interval is optimistic (it cannot be wider than the spread
of the observed ratios); with one repeat it collapses to the point estimate, and with two it
is at most the range of the two ratios, so neither is a confidence interval (the report says so).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class PairedChange:
    """Change of a candidate relative to a baseline, from paired repeats.

    ``percent``, ``ci_low_percent`` and ``ci_high_percent`` are ``None`` when no repeat
    had both values (``pairs == 0``). ``log_ratios`` holds ``ln(candidate / baseline)``
    per usable repeat, in repeat order; ``repeats_used`` their repeat indexes.
    """

    pairs: int
    mean_log_ratio: float | None
    percent: float | None
    ci_low_percent: float | None
    ci_high_percent: float | None
    confidence: float
    resamples: int
    log_ratios: tuple[float, ...]
    repeats_used: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        data = dataclasses.asdict(self)
        data["log_ratios"] = list(self.log_ratios)
        data["repeats_used"] = list(self.repeats_used)
        return data


def log_ratio_to_percent(value: float) -> float:
    """Convert a (mean) natural-log ratio into a percent change: ``100 * (exp(v) - 1)``."""
    return 100.0 * math.expm1(value)


def _check_positive(name: str, index: int, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}[{index}] must be a finite number > 0 for a log ratio, got {value!r}")


def paired_log_ratios(
    candidate: Sequence[float | None], baseline: Sequence[float | None]
) -> tuple[np.ndarray, tuple[int, ...]]:
    """Return ``ln(candidate_r / baseline_r)`` for every repeat where both values exist.

    A ``None`` on either side drops that repeat (a missing cell, e.g. a class with no
    completed request); the indexes of the kept repeats come back with the ratios.

    Raises:
        ValueError: the sequences differ in length, or a present value is not > 0.
    """
    if len(candidate) != len(baseline):
        raise ValueError(
            f"candidate and baseline must have one value per repeat, got {len(candidate)} and {len(baseline)}"
        )
    ratios: list[float] = []
    used: list[int] = []
    for index, (c, b) in enumerate(zip(candidate, baseline)):
        if c is None or b is None:
            continue
        _check_positive("candidate", index, float(c))
        _check_positive("baseline", index, float(b))
        ratios.append(math.log(float(c) / float(b)))
        used.append(index)
    return np.asarray(ratios, dtype=np.float64), tuple(used)


def bootstrap_mean_interval(
    values: Sequence[float], *, resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean of ``values`` (seeded, reproducible).

    Raises:
        ValueError: ``values`` is empty, ``resamples`` < 1 or ``confidence`` outside (0, 1).
    """
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        raise ValueError("values must be non-empty")
    if not np.all(np.isfinite(data)):
        raise ValueError("values must all be finite")
    if not isinstance(resamples, (int, np.integer)) or isinstance(resamples, bool) or resamples < 1:
        raise ValueError(f"resamples must be an integer >= 1, got {resamples!r}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be within (0, 1), got {confidence!r}")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, data.size, size=(int(resamples), data.size))
    means = data[picks].mean(axis=1)
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(means, [tail, 100.0 - tail])
    return float(low), float(high)


def paired_change(
    candidate: Sequence[float | None],
    baseline: Sequence[float | None],
    *,
    resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> PairedChange:
    """Mean paired log ratio of ``candidate`` vs ``baseline`` as a percent, with a bootstrap interval.

    Both sequences hold one value per repeat (``None`` for a missing cell). See the
    module docstring for the method.
    """
    ratios, used = paired_log_ratios(candidate, baseline)
    if ratios.size == 0:
        # Validate the bootstrap settings even when there is nothing to resample.
        bootstrap_mean_interval([0.0], resamples=resamples, confidence=confidence, seed=seed)
        return PairedChange(0, None, None, None, None, confidence, resamples, (), ())
    mean = float(ratios.mean())
    low, high = bootstrap_mean_interval(ratios, resamples=resamples, confidence=confidence, seed=seed)
    return PairedChange(
        pairs=int(ratios.size),
        mean_log_ratio=mean,
        percent=log_ratio_to_percent(mean),
        ci_low_percent=log_ratio_to_percent(low),
        ci_high_percent=log_ratio_to_percent(high),
        confidence=confidence,
        resamples=int(resamples),
        log_ratios=tuple(float(x) for x in ratios),
        repeats_used=used,
    )
