"""Markdown and JSON rendering of simulator results, shaped like the seed report's tables."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

from lightllm.benchmark.simulator.cost_model import PROFILE_DIR, CostProfile, load_profile
from lightllm.benchmark.simulator.published_report import (
    compared_json,
    published_changes_markdown,
    published_comparison_markdown,
    published_json,
)
from lightllm.benchmark.markdown_table import md_table
from lightllm.benchmark.simulator.report_format import (
    BASELINE,
    MODE_LABELS,
    change_pct,
    fmt_ms,
    fmt_num,
    fmt_pct,
    index_results,
)
from lightllm.benchmark.simulator.runner import CaseKey, CaseResult
from lightllm.benchmark.simulator.scenarios import SCENARIOS
from lightllm.benchmark.simulator.soak import SoakConfig, SoakResult


def _baseline(index: Dict[CaseKey, CaseResult], key: CaseKey) -> Optional[CaseResult]:
    return index.get(CaseKey(key.scenario, key.mode, key.budget, BASELINE))


def results_markdown(results: Sequence[CaseResult]) -> str:
    """One table per scenario: every mode x budget x strategy, with changes versus ``default``."""
    index = index_results(results)
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
                    f"{fmt_ms(m['short_ttft_p50_ms'])} / {fmt_ms(m['short_ttft_p95_ms'])}",
                    fmt_ms(m["long_ttft_p95_ms"]),
                    fmt_ms(m["long_e2e_p95_ms"]),
                    fmt_num(m["output_tok_s"]),
                    fmt_pct(change_pct(m["short_ttft_p95_ms"], bm["short_ttft_p95_ms"])) if bm else "—",
                    fmt_pct(change_pct(m["long_e2e_p95_ms"], bm["long_e2e_p95_ms"])) if bm else "—",
                    fmt_pct(change_pct(m["output_tok_s"], bm["output_tok_s"])) if bm else "—",
                )
            )
        lines += md_table(header, rows)
    return "\n".join(lines).strip() + "\n"


# The bundled profile that models the seed report's machine (one H100 serving Qwen3.5-0.8B).
SEED_HARDWARE_PROFILE = "h100_qwen_0p8b"


def models_seed_hardware(profile: CostProfile) -> bool:
    """Whether ``profile`` costs steps as the bundled seed-hardware profile does.

    Judged by its coefficients and KV capacity, not its name: a copy of the bundled file with
    other numbers keeps the bundled name inside it, and its virtual times are not the H100's.
    """
    try:
        # The bundled file itself (never a file of that name in the working directory); a report
        # must not fail at the end of a run because a trimmed install lacks it.
        seed = load_profile(PROFILE_DIR / f"{SEED_HARDWARE_PROFILE}.json")
    except ValueError:
        return False
    return (profile.coefficients() == seed.coefficients()
            and profile.max_total_token_num == seed.max_total_token_num)


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
    # The seed's absolute milliseconds were measured on an H100: next to another profile's virtual
    # times they compare nothing (the changes' signs still do).
    seed_hardware = models_seed_hardware(profile)
    published = published_comparison_markdown(results) if seed_hardware else ""
    changes = published_changes_markdown(results)
    if published or changes:
        parts += ["## Published in the seed report versus simulated", ""]
        if not seed_hardware:
            parts += [f"The seed's absolute latencies (H100) are compared only under `--profile "
                      f"{SEED_HARDWARE_PROFILE}`; below, the signs of its published changes.", ""]
        parts += [text for text in (published, changes) if text]
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
            fmt_num(s.max_wait_s, 3),
            fmt_num(s.p99_wait_s, 3),
            fmt_num(s.p50_wait_s, 3),
            fmt_num(s.max_long_wait_s, 3),
            fmt_num(s.max_short_wait_s, 3),
            fmt_num(s.wall_s, 1),
        )
        for s in soaks
    ]
    note = "Wait = arrival to first token. The stream stops after the soak duration and the backlog drains."
    return "\n".join([title, "", note, ""] + md_table(header, rows)) + "\n"


def results_json(profile: CostProfile, results: Sequence[CaseResult], seed: int) -> Dict[str, Any]:
    """JSON document of a scenario run (no per-request records)."""
    return {
        "profile": profile.to_dict(),
        "seed": seed,
        "results": [r.to_dict() for r in results],
        "published_in_seed_report": published_json(),
        "published_vs_simulated": compared_json(results),
    }


def soak_json(profile: CostProfile, cfg: SoakConfig, soaks: Sequence[SoakResult]) -> Dict[str, Any]:
    """JSON document of a soak run."""
    return {"profile": profile.to_dict(), "soak": dataclasses.asdict(cfg), "results": [s.to_dict() for s in soaks]}
