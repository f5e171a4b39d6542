"""Cell formatting and lookups shared by the simulator's Markdown reports."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

from lightllm.benchmark.simulator.runner import CaseKey, CaseResult

BASELINE = "default"
MODE_LABELS = {"normal": "normal", "1p1d": "1P1D prefill node"}


def change_pct(value: Optional[float], base: Optional[float]) -> Optional[float]:
    """Percent change of ``value`` versus ``base`` (``None`` when either is missing or base is 0)."""
    if value is None or base is None or base == 0:
        return None
    return (value / base - 1.0) * 100.0


def fmt_ms(value: Optional[float]) -> str:
    """Milliseconds without decimals, ``-`` when missing."""
    return "-" if value is None else f"{value:.0f}"


def fmt_pct(value: Optional[float]) -> str:
    """A signed percent with one decimal, ``—`` when missing."""
    return "—" if value is None else f"{value:+.1f}%"


def fmt_num(value: Optional[float], digits: int = 2) -> str:
    """A plain number, ``-`` when missing."""
    return "-" if value is None else f"{value:.{digits}f}"


def index_results(results: Sequence[CaseResult]) -> Dict[CaseKey, CaseResult]:
    """Results keyed by their cell and strategy."""
    return {r.key: r for r in results}
