"""The metrics a strategy comparison reports, and their per-repeat analysis.

Every measured run produces one summary (see :func:`lightllm.benchmark.metrics.summarize`).
A :class:`ComparisonMetric` picks one number out of a summary (e.g. the short class's
P95 TTFT); :func:`analyze_runs` collects it per strategy and repeat, takes the median
over repeats for the absolute table, and computes each non-baseline strategy's paired
change against the baseline with :func:`lightllm.benchmark.paired_stats.paired_change`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from lightllm.benchmark.paired_stats import paired_change


@dataclasses.dataclass(frozen=True)
class ComparisonMetric:
    """One number of a run summary.

    ``group`` is a request class (``"short"``, ``"long"``) or ``"overall"``; ``field`` a
    key of that group's metrics; ``stat`` the key inside a distribution (``"p95"``) or
    ``None`` for scalar fields such as ``output_throughput``.
    """

    key: str
    label: str
    group: str
    field: str
    stat: str | None
    unit: str
    higher_is_better: bool

    def value(self, summary: Mapping[str, Any]) -> float | None:
        """The metric in ``summary``, or ``None`` when absent or not positive.

        Zero or negative values (e.g. no output token at all) cannot enter a log ratio,
        so they count as missing cells rather than numbers.
        """
        group = summary.get("overall") if self.group == "overall" else summary.get("classes", {}).get(self.group)
        if not group:
            return None
        value = group.get(self.field)
        if self.stat is not None:
            value = value.get(self.stat) if isinstance(value, Mapping) else None
        if value is None:
            return None
        value = float(value)
        return value if math.isfinite(value) and value > 0 else None


COMPARISON_METRICS: tuple[ComparisonMetric, ...] = (
    ComparisonMetric("short_ttft_p50_ms", "Short TTFT median", "short", "ttft_ms", "p50", "ms", False),
    ComparisonMetric("short_ttft_p95_ms", "Short TTFT P95", "short", "ttft_ms", "p95", "ms", False),
    ComparisonMetric("long_ttft_p95_ms", "Long TTFT P95", "long", "ttft_ms", "p95", "ms", False),
    ComparisonMetric("long_e2e_p95_ms", "Long E2E P95", "long", "e2e_ms", "p95", "ms", False),
    ComparisonMetric("output_throughput", "Output tokens/s", "overall", "output_throughput", None, "tok/s", True),
)
METRICS_BY_KEY: dict[str, ComparisonMetric] = {m.key: m for m in COMPARISON_METRICS}


def rotated_order(strategies: Sequence[str], repeat: int) -> list[str]:
    """Strategies in the order repeat ``repeat`` visits them: the list rotated left by ``repeat``.

    Over a number of repeats that is a multiple of ``len(strategies)`` every strategy
    runs in every position equally often, so slow drift and position effects (e.g. the
    first run after a pause) hit all strategies alike.
    """
    if not strategies:
        raise ValueError("strategies must be non-empty")
    if repeat < 0:
        raise ValueError(f"repeat must be >= 0, got {repeat}")
    shift = repeat % len(strategies)
    return list(strategies[shift:]) + list(strategies[:shift])


def median_or_none(values: Sequence[float | None]) -> float | None:
    """Median of the present values, ``None`` when there are none."""
    present = [v for v in values if v is not None]
    return float(np.median(present)) if present else None


def analyze_runs(
    summaries: Mapping[str, Sequence[Mapping[str, Any]]],
    baseline: str,
    *,
    metrics: Sequence[ComparisonMetric] = COMPARISON_METRICS,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Per-repeat values, medians over repeats and paired changes vs ``baseline``.

    ``summaries[strategy][r]`` is the summary of repeat ``r``; every strategy must have
    the same number of repeats. Returns ``{"values", "medians", "changes", "failed"}``
    keyed by strategy (``changes`` omits the baseline) and then by metric key.

    Raises:
        ValueError: ``baseline`` missing or repeat counts differ between strategies.
    """
    if baseline not in summaries:
        raise ValueError(f"baseline must be one of the measured strategies {sorted(summaries)}, got {baseline!r}")
    counts = {name: len(runs) for name, runs in summaries.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"every strategy must have the same number of repeats, got {counts}")
    values = {name: {m.key: [m.value(s) for s in runs] for m in metrics} for name, runs in summaries.items()}
    medians = {name: {key: median_or_none(v) for key, v in per.items()} for name, per in values.items()}
    changes = {
        name: {
            m.key: paired_change(values[name][m.key], values[baseline][m.key], confidence=confidence).to_dict()
            for m in metrics
        }
        for name in summaries
        if name != baseline
    }
    failed = {name: sum(int(s.get("overall", {}).get("failed", 0)) for s in runs) for name, runs in summaries.items()}
    return {"values": values, "medians": medians, "changes": changes, "failed": failed}
