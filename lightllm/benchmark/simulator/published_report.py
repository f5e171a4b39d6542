"""The seed report's published numbers next to the simulated ones, in Markdown and JSON."""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence

from lightllm.benchmark.simulator.published import (
    METRIC_LABELS,
    PUBLISHED_COMPARISONS,
    PUBLISHED_SEED_ABSOLUTE,
    PUBLISHED_SEED_ABSOLUTE_CONFIG,
    PUBLISHED_SEED_SUSTAINED_CHANGES,
    SOURCE_DERIVED,
    SOURCE_PROSE,
    SOURCE_RANGE,
    PublishedComparison,
)
from lightllm.benchmark.markdown_table import md_table
from lightllm.benchmark.simulator.report_format import (
    MODE_LABELS,
    change_pct,
    fmt_ms,
    fmt_num,
    fmt_pct,
    index_results,
)
from lightllm.benchmark.simulator.runner import CaseKey, CaseResult

_SOURCE_NOTES = {
    SOURCE_PROSE: "from the report's text",
    SOURCE_DERIVED: "computed from the published absolute values",
    SOURCE_RANGE: "published as a range over the 4 cells of its table",
}


class ComparedRow(NamedTuple):
    """A published change with the simulator's value for the same cell.

    ``same_sign`` is ``None`` only when the published sign is not determined (a range across 0).
    """

    published: PublishedComparison
    simulated_pct: Optional[float]
    same_sign: Optional[bool]


def _sign(value: float) -> int:
    return (value > 0) - (value < 0)


def compare_published(
    results: Sequence[CaseResult], rows: Sequence[PublishedComparison] = PUBLISHED_COMPARISONS
) -> List[ComparedRow]:
    """Each published row whose cell was simulated (strategy and baseline both), with its sign check."""
    index = index_results(results)
    compared: List[ComparedRow] = []
    for row in rows:
        sim = index.get(CaseKey(row.scenario, row.mode, row.budget, row.strategy))
        base = index.get(CaseKey(row.scenario, row.mode, row.budget, row.baseline))
        if sim is None or base is None:
            continue
        simulated = change_pct(sim.metrics.get(row.metric), base.metrics.get(row.metric))
        published_sign = row.published_sign()
        same = None if simulated is None or published_sign is None else _sign(simulated) == published_sign
        compared.append(ComparedRow(row, simulated, same))
    return compared


def _published_cell(row: PublishedComparison) -> str:
    if row.published_pct is None:
        assert row.range_pct is not None
        return f"{fmt_pct(row.range_pct[0])} to {fmt_pct(row.range_pct[1])}"
    text = fmt_pct(row.published_pct)
    if row.ci_pct is not None:
        text += f" [{row.ci_pct[0]:+.1f}, {row.ci_pct[1]:+.1f}]"
    return text


def _note(row: PublishedComparison) -> str:
    notes = [_SOURCE_NOTES[row.source]] if row.source in _SOURCE_NOTES else []
    if row.ci_spans_zero():
        # The seed itself: an interval across zero does not establish the sign (跨零).
        notes.append("published CI spans 0")
    return "; ".join(notes)


def published_changes_markdown(results: Sequence[CaseResult]) -> str:
    """Every published change whose cell was simulated: published, simulated, and whether the signs agree."""
    compared = compare_published(results)
    if not compared:
        return ""
    header = (
        "scenario",
        "mode / budget",
        "strategy",
        "versus",
        "metric",
        "published",
        "simulated",
        "same sign",
        "note",
    )
    rows = [
        (
            c.published.scenario,
            f"{MODE_LABELS[c.published.mode]} / {c.published.budget}",
            c.published.strategy,
            c.published.baseline,
            METRIC_LABELS.get(c.published.metric, c.published.metric),
            _published_cell(c.published),
            fmt_pct(c.simulated_pct),
            {True: "yes", False: "no", None: "—"}[c.same_sign],
            _note(c.published),
        )
        for c in compared
    ]
    agree = sum(1 for c in compared if c.same_sign)
    title = (
        "Every change the seed report published (latency: negative is better; throughput: positive is better), "
        "next to the simulated change in the same cell"
    )
    summary = f"Same sign in {agree} of {len(compared)} rows"
    if len(compared) < len(PUBLISHED_COMPARISONS):
        summary += (
            f"; {len(PUBLISHED_COMPARISONS) - len(compared)} published rows are left out because their cells "
            "were not simulated in this run (`--scenario seed_all` with the default modes, budgets and strategies "
            "covers them all)"
        )
    return "\n".join([title, ""] + md_table(header, rows) + ["", summary + "."]) + "\n"


def published_comparison_markdown(results: Sequence[CaseResult]) -> str:
    """Simulated rows next to the absolute numbers published in the seed report (if simulated)."""
    index = index_results(results)
    mode, budget = PUBLISHED_SEED_ABSOLUTE_CONFIG["mode"], PUBLISHED_SEED_ABSOLUTE_CONFIG["budget"]
    header = (
        "scenario",
        "strategy",
        "short TTFT p50 / P95 (ms): published",
        "simulated",
        "long TTFT P95 (ms): published",
        "simulated",
        "output tok/s: published",
        "simulated",
    )
    rows = []
    for scenario, by_strategy in PUBLISHED_SEED_ABSOLUTE.items():
        for strategy, pub in by_strategy.items():
            sim = index.get(CaseKey(scenario, mode, budget, strategy))
            if sim is None:
                continue
            m = sim.metrics
            rows.append(
                (
                    scenario,
                    strategy,
                    f"{fmt_ms(pub.short_ttft_p50_ms)} / {fmt_ms(pub.short_ttft_p95_ms)}",
                    f"{fmt_ms(m['short_ttft_p50_ms'])} / {fmt_ms(m['short_ttft_p95_ms'])}",
                    fmt_ms(pub.long_ttft_p95_ms),
                    fmt_ms(m["long_ttft_p95_ms"]),
                    fmt_num(pub.output_tok_s),
                    fmt_num(m["output_tok_s"]),
                )
            )
    if not rows:
        return ""
    title = (
        f"Published in the seed report (H100 80GB, Qwen3.5-0.8B, {mode}, batch_max_tokens = "
        f"chunked_prefill_size = {budget}) next to the simulator"
    )
    return "\n".join([title, ""] + md_table(header, rows)) + "\n"


def published_json() -> Dict[str, Any]:
    """The published reference data, as the JSON document's ``published_in_seed_report``."""
    return {
        "absolute": {
            scenario: {strategy: row._asdict() for strategy, row in rows.items()}
            for scenario, rows in PUBLISHED_SEED_ABSOLUTE.items()
        },
        "absolute_config": PUBLISHED_SEED_ABSOLUTE_CONFIG,
        "sustained_changes_pct": [
            {"mode": mode, "budget": budget, "strategy": strategy, **change._asdict()}
            for (mode, budget), rows in PUBLISHED_SEED_SUSTAINED_CHANGES.items()
            for strategy, change in rows.items()
        ],
        "comparisons": [_row_json(row) for row in PUBLISHED_COMPARISONS],
    }


def compared_json(results: Sequence[CaseResult]) -> List[Dict[str, Any]]:
    """Each published row of a simulated cell with ``simulated_pct`` and ``same_sign``."""
    return [
        {**_row_json(c.published), "simulated_pct": c.simulated_pct, "same_sign": c.same_sign}
        for c in compare_published(results)
    ]


def _row_json(row: PublishedComparison) -> Dict[str, Any]:
    doc = row._asdict()
    for key in ("ci_pct", "range_pct"):
        if doc[key] is not None:
            doc[key] = list(doc[key])
    return doc
