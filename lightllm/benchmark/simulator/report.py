"""Markdown and JSON rendering of simulator results, shaped like the seed report's tables."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

from lightllm.benchmark.simulator.cost_model import CostProfile
from lightllm.benchmark.simulator.runner import CaseKey, CaseResult
from lightllm.benchmark.simulator.scenarios import (
    PUBLISHED_SEED_ABSOLUTE,
    PUBLISHED_SEED_ABSOLUTE_CONFIG,
    PUBLISHED_SEED_LONG_THEN_STREAM_NOTE,
    PUBLISHED_SEED_OVERLOAD_NOTE,
    PUBLISHED_SEED_SUSTAINED_CHANGES,
    SCENARIOS,
)
from lightllm.benchmark.simulator.soak import SoakConfig, SoakResult

BASELINE = "default"
MODE_LABELS = {"normal": "normal", "1p1d": "1P1D prefill node"}


def change_pct(value: Optional[float], base: Optional[float]) -> Optional[float]:
    """Percent change of ``value`` versus ``base`` (``None`` when either is missing or base is 0)."""
    if value is None or base is None or base == 0:
        return None
    return (value / base - 1.0) * 100.0


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.0f}"


def _pct(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:+.1f}%"


def _num(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _index(results: Sequence[CaseResult]) -> Dict[CaseKey, CaseResult]:
    return {r.key: r for r in results}


def _baseline(index: Dict[CaseKey, CaseResult], key: CaseKey) -> Optional[CaseResult]:
    return index.get(CaseKey(key.scenario, key.mode, key.budget, BASELINE))


def results_markdown(results: Sequence[CaseResult]) -> str:
    """One table per scenario: every mode x budget x strategy, with changes versus ``default``."""
    index = _index(results)
    lines: List[str] = []
    scenario_names = list(dict.fromkeys(r.key.scenario for r in results))
    header = (
        "mode / budget",
        "strategy",
        "short TTFT p50 / P95 (ms)",
        "long TTFT P95 (ms)",
        "long E2E P95 (ms)",
        "output tok/s",
        "Δ short TTFT P95",
        "Δ long E2E P95",
        "Δ output tok/s",
    )
    for name in scenario_names:
        lines += ["", f"### {SCENARIOS[name].title}" if name in SCENARIOS else f"### {name}", ""]
        rows = []
        for result in (r for r in results if r.key.scenario == name):
            m = result.metrics
            base = _baseline(index, result.key)
            bm = base.metrics if base is not None and result.key.strategy != BASELINE else None
            rows.append(
                (
                    f"{MODE_LABELS[result.key.mode]} / {result.key.budget}",
                    result.key.strategy,
                    f"{_ms(m['short_ttft_p50_ms'])} / {_ms(m['short_ttft_p95_ms'])}",
                    _ms(m["long_ttft_p95_ms"]),
                    _ms(m["long_e2e_p95_ms"]),
                    _num(m["output_tok_s"]),
                    _pct(change_pct(m["short_ttft_p95_ms"], bm["short_ttft_p95_ms"])) if bm else "—",
                    _pct(change_pct(m["long_e2e_p95_ms"], bm["long_e2e_p95_ms"])) if bm else "—",
                    _pct(change_pct(m["output_tok_s"], bm["output_tok_s"])) if bm else "—",
                )
            )
        lines += _table(header, rows)
    return "\n".join(lines).strip() + "\n"


def published_comparison_markdown(results: Sequence[CaseResult]) -> str:
    """Simulated rows next to the absolute numbers published in the seed report (if simulated)."""
    index = _index(results)
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
                    f"{_ms(pub.short_ttft_p50_ms)} / {_ms(pub.short_ttft_p95_ms)}",
                    f"{_ms(m['short_ttft_p50_ms'])} / {_ms(m['short_ttft_p95_ms'])}",
                    _ms(pub.long_ttft_p95_ms),
                    _ms(m["long_ttft_p95_ms"]),
                    _num(pub.output_tok_s),
                    _num(m["output_tok_s"]),
                )
            )
    if not rows:
        return ""
    title = (
        f"Published in the seed report (H100 80GB, Qwen3.5-0.8B, {mode}, batch_max_tokens = "
        f"chunked_prefill_size = {budget}) next to the simulator"
    )
    return "\n".join([title, ""] + _table(header, rows)) + "\n"


def sustained_comparison_markdown(results: Sequence[CaseResult]) -> str:
    """Changes versus ``default`` published for the sustained scenario next to simulated ones."""
    index = _index(results)
    header = (
        "mode / budget",
        "strategy",
        "Δ short TTFT P95: published",
        "simulated",
        "Δ long E2E P95: published",
        "simulated",
        "Δ output tok/s: published",
        "simulated",
    )
    rows = []
    for (mode, budget), by_strategy in PUBLISHED_SEED_SUSTAINED_CHANGES.items():
        for strategy, pub in by_strategy.items():
            sim = index.get(CaseKey("sustained", mode, budget, strategy))
            base = index.get(CaseKey("sustained", mode, budget, BASELINE))
            if sim is None or base is None:
                continue
            m, b = sim.metrics, base.metrics
            rows.append(
                (
                    f"{MODE_LABELS[mode]} / {budget}",
                    strategy,
                    _pct(pub.short_ttft_p95_pct),
                    _pct(change_pct(m["short_ttft_p95_ms"], b["short_ttft_p95_ms"])),
                    _pct(pub.long_e2e_p95_pct),
                    _pct(change_pct(m["long_e2e_p95_ms"], b["long_e2e_p95_ms"])),
                    _pct(pub.output_tok_s_pct),
                    _pct(change_pct(m["output_tok_s"], b["output_tok_s"])),
                )
            )
    if not rows:
        return ""
    title = "Published in the seed report (sustained: 8K long, 25% long, 60 req/s, 8 s) next to the simulator"
    return "\n".join([title, ""] + _table(header, rows)) + "\n"


def full_report_markdown(profile: CostProfile, results: Sequence[CaseResult], seed: int) -> str:
    """Heading, per-scenario tables and the published-versus-simulated comparisons."""
    parts = [
        f"## Scheduling simulator: profile `{profile.name}`, workload seed {seed}",
        "",
        f"{profile.description}. Latencies in virtual milliseconds; Δ columns are changes versus `default` "
        "in the same mode and budget.",
        "",
        results_markdown(results),
    ]
    published = published_comparison_markdown(results)
    sustained = sustained_comparison_markdown(results)
    if published or sustained:
        parts += ["## Published in the seed report versus simulated", ""]
        parts += [text for text in (published, sustained) if text]
        scenarios = {r.key.scenario for r in results}
        if "long_then_stream" in scenarios:
            parts += [f"Published in the seed report: {PUBLISHED_SEED_LONG_THEN_STREAM_NOTE}.", ""]
        if "sustained_overload" in scenarios:
            parts += [f"Published in the seed report: {PUBLISHED_SEED_OVERLOAD_NOTE}.", ""]
    return "\n".join(parts).rstrip() + "\n"


def soak_markdown(profile: CostProfile, cfg: SoakConfig, soaks: Sequence[SoakResult]) -> str:
    """Per-strategy wait statistics of soak runs."""
    rate = soaks[0].request_rate if soaks else float("nan")
    title = (
        f"## Soak: {cfg.hours:g} simulated hours, profile `{profile.name}`, {MODE_LABELS[cfg.mode]} / "
        f"{cfg.budget}, {rate:.2f} req/s ({cfg.long_fraction:.0%} long of {cfg.long_len} tokens, "
        f"short {cfg.short_len}, output {cfg.output_len}), seed {cfg.seed}"
    )
    header = (
        "strategy",
        "requests",
        "longest wait (s)",
        "p99 wait (s)",
        "p50 wait (s)",
        "longest long wait (s)",
        "longest short wait (s)",
        "wall time (s)",
    )
    rows: List[Tuple[str, ...]] = [
        (
            s.strategy,
            str(s.requests),
            _num(s.max_wait_s, 3),
            _num(s.p99_wait_s, 3),
            _num(s.p50_wait_s, 3),
            _num(s.max_long_wait_s, 3),
            _num(s.max_short_wait_s, 3),
            _num(s.wall_s, 1),
        )
        for s in soaks
    ]
    note = "Wait = arrival to first token. The stream stops after the soak duration and the backlog drains."
    return "\n".join([title, "", note, ""] + _table(header, rows)) + "\n"


def results_json(profile: CostProfile, results: Sequence[CaseResult], seed: int) -> Dict[str, Any]:
    """JSON document of a scenario run (no per-request records)."""
    return {
        "profile": profile.to_dict(),
        "seed": seed,
        "results": [r.to_dict() for r in results],
        "published_in_seed_report": {
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
        },
    }


def soak_json(profile: CostProfile, cfg: SoakConfig, soaks: Sequence[SoakResult]) -> Dict[str, Any]:
    """JSON document of a soak run."""
    return {"profile": profile.to_dict(), "soak": dataclasses.asdict(cfg), "results": [s.to_dict() for s in soaks]}
