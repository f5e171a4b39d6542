"""Every number the seed benchmark report published, as data rows.

Reference data copied from the seed report (H100 80GB, Qwen3.5-0.8B, text only, short prompts 128
tokens, long prompts 4K/8K/16K, 128 output tokens, ``running_max_req_size = 256``).  They are what
a real server measured, printed next to the simulated numbers; the simulator never reads them to
produce its own results (only ``derive_h100_profile`` calibrates on the long-first ``default`` row).

Two shapes:

* :data:`PUBLISHED_SEED_ABSOLUTE`: the absolute normal / 1024 tables of the seed's first run
  (long first, interleaved), medians of three runs;
* :data:`PUBLISHED_COMPARISONS`: one :class:`PublishedComparison` per published percent change of
  one metric, strategy against a baseline strategy in one cell (scenario, mode, budget), with its
  95% interval where the seed gave one.  The prose of the report (the two "cost" cases, the
  short-TTFT medians, the TPOT and E2E ranges) is turned into rows too, so each one can be set
  against the simulator and checked for its sign.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

# Metric keys are those of ``CaseResult.metrics``; latencies in ms, throughput in output tokens/s.
METRIC_LABELS: Dict[str, str] = {
    "short_ttft_p50_ms": "short TTFT p50",
    "short_ttft_p95_ms": "short TTFT P95",
    "long_ttft_p95_ms": "long TTFT P95",
    "long_e2e_p95_ms": "long E2E P95",
    "short_tpot_p50_ms": "short TPOT p50",
    "short_e2e_p95_ms": "short E2E P95",
    "output_tok_s": "output tok/s",
}

# How a row's published number came about (printed in the report's note column).
SOURCE_TABLE = "table"  # a cell of one of the seed's tables
SOURCE_PROSE = "prose"  # a number the seed wrote in a sentence
SOURCE_DERIVED = "derived"  # computed here from the seed's published absolute values
SOURCE_RANGE = "range"  # the seed gave only a range over several cells


class PublishedRow(NamedTuple):
    """One strategy's row of the seed report's absolute table (medians of three runs)."""

    short_ttft_p50_ms: float
    short_ttft_p95_ms: float
    long_ttft_p95_ms: float
    output_tok_s: float


# Published in the seed report: normal mode, batch_max_tokens = chunked_prefill_size = 1024.
PUBLISHED_SEED_ABSOLUTE: Dict[str, Dict[str, PublishedRow]] = {
    "long_first": {
        "default": PublishedRow(1636, 2724, 20083, 477.61),
        "promote_shortest": PublishedRow(335, 407, 20139, 475.01),
        "hrrn": PublishedRow(369, 430, 20239, 473.50),
    },
    "interleaved": {
        "default": PublishedRow(4197, 7713, 19896, 808.22),
        "promote_shortest": PublishedRow(308, 409, 20358, 791.10),
        "hrrn": PublishedRow(375, 505, 20345, 792.14),
    },
}
PUBLISHED_SEED_ABSOLUTE_CONFIG = {"mode": "normal", "budget": 1024}


class PublishedChange(NamedTuple):
    """Percent change versus ``default`` published in the seed report (negative latency = better)."""

    short_ttft_p95_pct: float
    long_e2e_p95_pct: float
    output_tok_s_pct: float


# Published in the seed report: the "sustained" scenario (8K long, 25% long, 60 req/s, 8 s),
# keyed by (mode, budget); paired log-ratio means over GPUs and rounds.
PUBLISHED_SEED_SUSTAINED_CHANGES: Dict[Tuple[str, int], Dict[str, PublishedChange]] = {
    ("normal", 1024): {
        "promote_shortest": PublishedChange(+1.6, +13.1, -10.1),
        "hrrn": PublishedChange(-9.1, +5.7, -4.7),
    },
    ("normal", 4096): {
        "promote_shortest": PublishedChange(+57.0, +26.8, -14.7),
        "hrrn": PublishedChange(+1.7, +3.9, -2.2),
    },
    ("1p1d", 1024): {
        "promote_shortest": PublishedChange(-93.3, +6.1, -4.0),
        "hrrn": PublishedChange(-92.8, -0.9, +0.9),
    },
    ("1p1d", 4096): {
        "promote_shortest": PublishedChange(-22.1, +30.0, -8.3),
        "hrrn": PublishedChange(-3.5, -1.9, +0.6),
    },
}


class PublishedComparison(NamedTuple):
    """One published percent change: ``strategy`` versus ``baseline`` on ``metric`` in one cell.

    Attributes:
        scenario, mode, budget: the cell (a simulator scenario name, ``normal`` or ``1p1d``, and
            ``batch_max_tokens = chunked_prefill_size``).
        strategy, baseline: the strategy measured and the one it is compared with.
        metric: a key of ``CaseResult.metrics`` (see :data:`METRIC_LABELS`).
        published_pct: the seed's percent change; ``None`` when only ``range_pct`` was published.
        ci_pct: the seed's 95% interval of the change, if it gave one.
        range_pct: the range the seed gave over several cells, for rows published only as a range.
        source: one of the ``SOURCE_*`` constants.
    """

    scenario: str
    mode: str
    budget: int
    strategy: str
    baseline: str
    metric: str
    published_pct: Optional[float]
    ci_pct: Optional[Tuple[float, float]] = None
    range_pct: Optional[Tuple[float, float]] = None
    source: str = SOURCE_TABLE

    def published_sign(self) -> Optional[int]:
        """-1, 0 or +1; ``None`` when only a range that straddles zero was published."""
        if self.published_pct is not None:
            return _sign(self.published_pct)
        assert self.range_pct is not None, "a row needs a published value or a range"
        low, high = self.range_pct
        return _sign(low) if _sign(low) == _sign(high) else None

    def ci_spans_zero(self) -> bool:
        """True when the seed's own interval includes no change (its sign is not established)."""
        return self.ci_pct is not None and self.ci_pct[0] <= 0.0 <= self.ci_pct[1]


def _sign(value: float) -> int:
    return (value > 0) - (value < 0)


def _absolute_rows() -> List[PublishedComparison]:
    """The first run's normal / 1024 tables (long first, interleaved) as changes versus default."""
    mode, budget = PUBLISHED_SEED_ABSOLUTE_CONFIG["mode"], PUBLISHED_SEED_ABSOLUTE_CONFIG["budget"]
    # Written in the seed's table ("吞吐相对默认") and prose ("短请求 TTFT 中位数分别降低 ...");
    # these are its own roundings, so they are kept rather than recomputed.
    written = {
        ("long_first", "promote_shortest"): {"output_tok_s": -0.5, "short_ttft_p50_ms": -79.5},
        ("long_first", "hrrn"): {"output_tok_s": -0.9, "short_ttft_p50_ms": -77.5},
        ("interleaved", "promote_shortest"): {"output_tok_s": -2.1, "short_ttft_p50_ms": -92.7},
        ("interleaved", "hrrn"): {"output_tok_s": -2.0, "short_ttft_p50_ms": -91.1},
    }
    rows: List[PublishedComparison] = []
    for scenario, by_strategy in PUBLISHED_SEED_ABSOLUTE.items():
        base = by_strategy["default"]
        for strategy, row in by_strategy.items():
            if strategy == "default":
                continue
            for metric in ("short_ttft_p50_ms", "short_ttft_p95_ms", "long_ttft_p95_ms", "output_tok_s"):
                cell = written[(scenario, strategy)]
                if metric in cell:
                    pct, source = cell[metric], SOURCE_TABLE if metric == "output_tok_s" else SOURCE_PROSE
                else:
                    pct = round((getattr(row, metric) / getattr(base, metric) - 1.0) * 100.0, 1)
                    source = SOURCE_DERIVED
                rows.append(
                    PublishedComparison(scenario, mode, budget, strategy, "default", metric, pct, source=source)
                )
            # The seed gave these two only as ranges over the four cells of this table.
            rows.append(
                PublishedComparison(
                    scenario, mode, budget, strategy, "default", "short_tpot_p50_ms", None,
                    range_pct=(6.0, 21.0), source=SOURCE_RANGE,
                )
            )
            rows.append(
                PublishedComparison(
                    scenario, mode, budget, strategy, "default", "short_e2e_p95_ms", None,
                    range_pct=(0.4, 2.3), source=SOURCE_RANGE,
                )
            )
    return rows


# Published in the seed report: HRRN versus promote_shortest in the sustained scenario, paired
# changes with 95% intervals (short TTFT P95, long E2E P95, output throughput), keyed by cell.
_SUSTAINED_HRRN_VS_PROMOTE: Dict[Tuple[str, int], Tuple[Tuple[float, float, float], ...]] = {
    ("normal", 1024): ((-10.5, -13.9, -6.3), (-6.5, -8.5, -4.8), (+5.9, +4.3, +8.0)),
    ("normal", 4096): ((-35.2, -44.1, -27.2), (-18.0, -21.6, -13.9), (+14.7, +10.6, +18.5)),
    ("1p1d", 1024): ((+6.9, -1.4, +15.8), (-6.6, -8.2, -5.4), (+5.1, +4.1, +6.6)),
    ("1p1d", 4096): ((+23.9, -9.6, +80.9), (-24.6, -27.5, -21.6), (+9.8, +8.7, +10.7)),
}
_CHANGE_METRICS = ("short_ttft_p95_ms", "long_e2e_p95_ms", "output_tok_s")


def _sustained_rows() -> List[PublishedComparison]:
    rows = [
        PublishedComparison("sustained", mode, budget, strategy, "default", metric, pct)
        for (mode, budget), by_strategy in PUBLISHED_SEED_SUSTAINED_CHANGES.items()
        for strategy, change in by_strategy.items()
        for metric, pct in zip(_CHANGE_METRICS, change)
    ]
    rows += [
        PublishedComparison("sustained", mode, budget, "hrrn", "promote_shortest", metric, pct, (low, high))
        for (mode, budget), cells in _SUSTAINED_HRRN_VS_PROMOTE.items()
        for metric, (pct, low, high) in zip(_CHANGE_METRICS, cells)
    ]
    return rows


def _cost_case_rows() -> List[PublishedComparison]:
    """The seed's two "costs" (两处代价), written as prose."""
    return [
        # 1P1D / 1024, 16 long 16K then 8 s of short requests at 120 req/s, versus default.
        PublishedComparison(
            "long_then_stream", "1p1d", 1024, "hrrn", "default", "short_ttft_p95_ms", -63.6, source=SOURCE_PROSE
        ),
        PublishedComparison(
            "long_then_stream", "1p1d", 1024, "hrrn", "default", "long_e2e_p95_ms", +65.5, (60.7, 70.4),
            source=SOURCE_PROSE,
        ),
        PublishedComparison(
            "long_then_stream", "1p1d", 1024, "promote_shortest", "default", "long_e2e_p95_ms", +73.8,
            source=SOURCE_PROSE,
        ),
        # 1P1D / 4096, 16K long, 90% short, 120 req/s: HRRN versus promote_shortest.  The seed wrote
        # "吞吐下降 5.6% [4.1, 7.3]", a drop, so the change and its interval are negative.
        PublishedComparison(
            "sustained_overload", "1p1d", 4096, "hrrn", "promote_shortest", "long_e2e_p95_ms", +10.3, (3.2, 18.3),
            source=SOURCE_PROSE,
        ),
        PublishedComparison(
            "sustained_overload", "1p1d", 4096, "hrrn", "promote_shortest", "output_tok_s", -5.6, (-7.3, -4.1),
            source=SOURCE_PROSE,
        ),
    ]


PUBLISHED_COMPARISONS: Tuple[PublishedComparison, ...] = tuple(
    _absolute_rows() + _sustained_rows() + _cost_case_rows()
)
