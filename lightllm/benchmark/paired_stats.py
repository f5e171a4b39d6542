"""Paired comparison of a candidate against a baseline measured in the same repeats.

Each repeat measures every strategy on the same workload (same schedule, same prompts),
so repeat-to-repeat drift (machine load, thermal state, cache state) affects the
candidate and the baseline of one repeat alike. Comparing them repeat by repeat
cancels that shared part:

* per repeat ``r``: ``d_r = ln(candidate_r / baseline_r)``;
* estimate: ``mean(d)``, reported as a percent change ``exp(mean(d)) - 1``;
* interval at ``confidence`` (95% by default): the paired Student-t interval of ``mean(d)``,
  ``mean(d) +- t_{n-1, (1 + confidence) / 2} * sd(d) / sqrt(n)`` over the ``n`` paired repeats
  (``sd`` with ``n - 1`` in the denominator), converted to percent the same way.

Log ratios make +x% and -x% symmetric in the average (a 2x slowdown and a 2x speedup
cancel) and the exponent of their mean is the geometric mean of the ratios.  The t interval
covers the true change at its nominal rate when the per-repeat log ratios are roughly normal,
whatever the number of repeats; it widens as the repeats get fewer (t is 12.7 at 95% with two
repeats, 4.3 with three, 2.8 with five).  One repeat has no spread to estimate, so it gets no
interval (``None``).  Until this interval, the report used a percentile bootstrap over repeats,
which cannot be wider than the spread of the observed ratios and covered the true change far less
often than it claimed with few repeats (about 75% for a "95%" interval at three repeats).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from lightllm.benchmark.student_t import student_t_quantile

# What report.json records as the interval's method (the bootstrap before it left no such field).
INTERVAL_METHOD = "paired Student-t interval of the mean log ratio"


@dataclasses.dataclass(frozen=True)
class PairedChange:
    """Change of a candidate relative to a baseline, from paired repeats.

    ``percent`` is ``None`` when no repeat had both values (``pairs == 0``);
    ``ci_low_percent`` and ``ci_high_percent`` also with one pair, which has no spread to
    estimate; ``ci_high_percent`` alone is ``None`` for an upper end beyond the float range
    (unbounded). ``log_ratios`` holds ``ln(candidate / baseline)`` per usable repeat, in repeat
    order; ``repeats_used`` their repeat indexes; ``method`` names how the interval was computed.
    """

    pairs: int
    mean_log_ratio: float | None
    percent: float | None
    ci_low_percent: float | None
    ci_high_percent: float | None
    confidence: float
    log_ratios: tuple[float, ...]
    repeats_used: tuple[int, ...]
    method: str = INTERVAL_METHOD

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        data = dataclasses.asdict(self)
        data["log_ratios"] = list(self.log_ratios)
        data["repeats_used"] = list(self.repeats_used)
        return data


# Beyond this log ratio exp() leaves the float range: an interval end there is unbounded.
_LARGEST_LOG_RATIO = math.log(float(np.finfo(np.float64).max) / 100.0)


def log_ratio_to_percent(value: float) -> float:
    """Convert a (mean) natural-log ratio into a percent change: ``100 * (exp(v) - 1)``."""
    return 100.0 * math.expm1(value)


def _interval_end_percent(value: float) -> float | None:
    """An interval end as a percent; ``None`` for an upper end too large for a float.

    Two repeats far apart at a high ``--confidence`` (t is 636 at 99.9% with two repeats) give
    an upper end beyond any float: it is reported as unbounded, not as a crash after the run.
    """
    return None if value > _LARGEST_LOG_RATIO else log_ratio_to_percent(value)


def _check_positive(name: str, index: int, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}[{index}] must be a finite number > 0 for a log ratio, got {value!r}")


def _check_confidence(confidence: float) -> None:
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be within (0, 1), got {confidence!r}")


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


def t_mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """Student-t interval of the mean of ``values``: ``mean +- t_{n-1} * sd / sqrt(n)``.

    ``None`` for a single value, whose spread cannot be estimated.

    Raises:
        ValueError: ``values`` is empty or not all finite, or ``confidence`` is outside (0, 1).
    """
    _check_confidence(confidence)
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        raise ValueError("values must be non-empty")
    if not np.all(np.isfinite(data)):
        raise ValueError("values must all be finite")
    if data.size == 1:
        return None
    mean = float(data.mean())
    half_width = student_t_quantile(0.5 + confidence / 2.0, data.size - 1) * float(data.std(ddof=1)) / math.sqrt(
        data.size)
    return mean - half_width, mean + half_width


def paired_change(
    candidate: Sequence[float | None],
    baseline: Sequence[float | None],
    *,
    confidence: float = 0.95,
) -> PairedChange:
    """Mean paired log ratio of ``candidate`` vs ``baseline`` as a percent, with its t interval.

    Both sequences hold one value per repeat (``None`` for a missing cell). See the
    module docstring for the method.

    Raises:
        ValueError: see :func:`paired_log_ratios`; or ``confidence`` is outside (0, 1).
    """
    _check_confidence(confidence)
    ratios, used = paired_log_ratios(candidate, baseline)
    if ratios.size == 0:
        return PairedChange(0, None, None, None, None, confidence, (), ())
    mean = float(ratios.mean())
    interval = t_mean_interval(ratios, confidence)
    low, high = (None, None) if interval is None else (log_ratio_to_percent(interval[0]),
                                                        _interval_end_percent(interval[1]))
    return PairedChange(
        pairs=int(ratios.size),
        mean_log_ratio=mean,
        percent=log_ratio_to_percent(mean),
        ci_low_percent=low,
        ci_high_percent=high,
        confidence=confidence,
        log_ratios=tuple(float(x) for x in ratios),
        repeats_used=used,
    )
