"""Write a strategy-comparison report as JSON, Markdown and PNG plots (drawn by
:mod:`lightllm.benchmark.report_plots`).

The report is a plain dict (what ``compare_strategies`` builds)::

    {"meta": {"model_dir", "strategies", "baseline", "repeats", "warmup", "seed",
              "server_args", "command", "git", "machine", "interval", ...},
     "workloads": {NAME: {"workload": WorkloadConfig fields,
                          "values":  {strategy: {metric_key: [per repeat]}},
                          "medians": {strategy: {metric_key: median}},
                          "changes": {strategy: {metric_key: PairedChange dict}},
                          "failed":  {strategy: failed request count}, ...}}}

Metric keys are those of :data:`lightllm.benchmark.comparison_metrics.COMPARISON_METRICS`.
Without matplotlib :func:`write_report` writes the JSON and Markdown without the PNGs
(:func:`~lightllm.benchmark.report_plots.plots_unavailable` says why).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any, Mapping, Sequence

from lightllm.benchmark.comparison_metrics import COMPARISON_METRICS
from lightllm.benchmark.markdown_table import md_table
from lightllm.benchmark.report_plots import plot_throughput, plot_ttft_cdf, plots_unavailable
from lightllm.benchmark.student_t import student_t_quantile

_DASH = "\u2014"


def write_json(report: Mapping[str, Any], path: str | Path) -> Path:
    """Write ``report`` as indented UTF-8 JSON and return the path."""
    path = Path(path)
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def format_ms(value: float | None) -> str:
    """Milliseconds: whole numbers from 100 ms up, one decimal below, a dash when missing."""
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}"


def format_percent(value: float | None) -> str:
    """Signed percent with one decimal (``+1.6%``, ``-93.3%``); a dash when missing."""
    return "-" if value is None else f"{value:+.1f}%"


def format_change(change: Mapping[str, Any] | None) -> str:
    """``-9.1% [-13.9, -6.3] n=3`` from a PairedChange dict (n: the pairs it rests on); a dash without pairs.

    One pair has no interval: ``+5.0% [no interval] n=1``.
    """
    if not change or change.get("percent") is None:
        return "-"
    if change.get("ci_low_percent") is None:
        interval = "no interval"
    elif change.get("ci_high_percent") is None:
        interval = f"{change['ci_low_percent']:+.1f}, unbounded"
    else:
        interval = f"{change['ci_low_percent']:+.1f}, {change['ci_high_percent']:+.1f}"
    text = f"{change['percent']:+.1f}% [{interval}]"
    return text + (f" n={change['pairs']}" if change.get("pairs") is not None else "")


def change_confidence(changes: Mapping[str, Mapping[str, Any]], default: float = 0.95) -> float:
    """The confidence the intervals of ``changes`` (strategy -> metric -> PairedChange dict) were computed at."""
    for per_metric in changes.values():
        for change in per_metric.values():
            if change and change.get("confidence") is not None:
                return float(change["confidence"])
    return default


def _few_pairs_note(changes: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """A warning when a change rests on one or two pairs: no interval, or one too wide to tell much."""
    pairs = [c.get("pairs") for per in changes.values() for c in per.values() if c and c.get("percent") is not None]
    if not pairs or min(pairs) > 2:
        return []
    confidence = change_confidence(changes)
    t = student_t_quantile(0.5 + confidence / 2.0, 1)
    return ["", "With n=1 there is no interval (one ratio has no spread to estimate), and with n=2 the interval "
            f"rests on one degree of freedom (t = {t:.3g} at {100 * confidence:g}%), so it is very wide. Measure "
            "more repeats before relying on a change."]


def _output_lens(cfg: Mapping[str, Any]) -> str:
    long_out = cfg.get("long_output_len") or cfg["output_len"]
    short_out = cfg.get("short_output_len") or cfg["output_len"]
    return f"output {long_out}" if long_out == short_out else f"output long {long_out} / short {short_out}"


def describe_workload(cfg: Mapping[str, Any]) -> str:
    """One-line description of a workload from its WorkloadConfig fields."""
    name = cfg.get("name")
    if name == "long_first":
        short_end = cfg["short_start_ms"] + cfg["short_spread_ms"]
        text = (
            f"{cfg['long_count']} long x {cfg['long_len']} tokens sent at 0-{cfg['long_spread_ms']:g} ms, then "
            f"{cfg['short_count']} short x {cfg['short_len']} tokens at {cfg['short_start_ms']:g}-{short_end:g} ms"
        )
    elif name == "interleaved":
        text = (
            f"{cfg['num_requests']} requests at {cfg['request_rate']:g} req/s, one long in {cfg['long_every']} "
            f"(long {cfg['long_len']} / short {cfg['short_len']} tokens)"
        )
    elif name == "sustained":
        text = (
            f"{cfg['request_rate']:g} req/s for {cfg['duration_s']:g} s (gamma gaps, burstiness "
            f"{cfg['burstiness']:g}), {100 * cfg['long_fraction']:g}% long (long {cfg['long_len']} / short "
            f"{cfg['short_len']} tokens)"
        )
        if cfg.get("initial_long_count"):
            text += f", after {cfg['initial_long_count']} initial long requests"
    elif name == "shared_prefix":
        text = (
            f"{cfg['request_rate']:g} req/s for {cfg['duration_s']:g} s (Poisson), {100 * cfg['long_fraction']:g}% "
            f"cold {cfg['long_len']}-token prompts, the rest few-shot ({cfg['prefix_groups']} templates of "
            f"{cfg['prefix_tokens']} tokens + {cfg['short_len']}) or chat turns (+{cfg['short_len']} tokens a turn, "
            f"{cfg['chat_turns']} turns)"
        )
    else:
        raise ValueError(
            f"workload name must be long_first, interleaved, sustained or shared_prefix, got {name!r}"
        )
    return f"{text}; {_output_lens(cfg)}"


def _meta_lines(meta: Mapping[str, Any]) -> list[str]:
    git = meta.get("git") or {}
    commit = git.get("commit") or "unknown"
    if git.get("dirty"):
        commit += " (uncommitted changes)"
    machine = meta.get("machine") or {}
    interval = meta.get("interval") or {}
    stopped = (
        [f"- **Stopped early**: {meta['stopped_early']}. Only repeats every strategy completed are reported; "
         "workloads after that were not run."]
        if meta.get("stopped_early") else []
    )
    topology = meta.get("topology") or {}
    pd = "prefill_args" in topology or "decode_args" in topology
    role_flags = [
        f"- PD flags (identical for every strategy): master `{shlex.join(topology.get('master_args', []))}`; "
        f"prefill nodes add `{shlex.join(topology.get('prefill_args', []))}`; decode nodes add "
        f"`{shlex.join(topology.get('decode_args', []))}`"
    ] if pd else []
    plots = [f"- Plots not written: {meta['plots_not_written']}"] if meta.get("plots_not_written") else []
    # A shared prefix changes what every prompt costs, so a reader of the report must see it.
    prefix = ([f"- Every prompt of a pass starts with the same {meta['shared_prefix_len']} tokens "
               "(--shared-prefix-len; each warm-up and repeat has its own; not the shared_prefix workload's, "
               "which shares prefixes its own way)"]
              if meta.get("shared_prefix_len") else [])
    return stopped + [
        f"- Model: `{meta.get('model_dir')}`; topology: {topology.get('name', 'normal')}",
        f"- Strategies: {', '.join(meta['strategies'])} (baseline {meta['baseline']})",
        f"- Server args (identical for every strategy{'; every prefill and decode node' if pd else ''}): "
        f"`{shlex.join(meta.get('server_args', []))}`",
        *role_flags,
        *prefix,
        *plots,
        f"- {meta['repeats']} measured repeat(s) in rotated order after {meta['warmup']} warm-up pass(es) "
        f"per strategy; seed {meta.get('seed')}",
        f"- Commit: {commit}; CPUs: {machine.get('cpu_count')}; torch {machine.get('torch')}; "
        f"{machine.get('platform')}",
        f"- Command: `{meta.get('command', '')}`",
        "",
        f"Absolute values are medians over repeats (a P95 is the median of the per-repeat P95s). "
        f"\"Change vs {meta['baseline']}\" is the mean of per-repeat paired log ratios converted to percent; "
        f"the interval is the {100 * interval.get('confidence', 0.95):g}% paired Student-t interval of that mean "
        "(mean +- t(n-1) * sd / sqrt(n) over the n paired repeats, converted to percent the same way); the "
        f"\"Throughput vs {meta['baseline']}\" column is that estimate for output tokens/s. "
        "For latencies negative is better, for throughput positive is better.",
    ]


def render_workload_markdown(name: str, section: Mapping[str, Any], strategies: Sequence[str], baseline: str) -> str:
    """Markdown for one workload: absolute table, change table and failure note."""
    medians, changes = section["medians"], section.get("changes", {})
    lines = [f"## {name}", "", f"Workload: {describe_workload(section['workload'])}.", ""]
    if section.get("stopped_early"):
        lines += [f"**Stopped early** after {len(section.get('visit_orders', []))} complete repeat(s): "
                  f"{section['stopped_early']}. Only the complete repeats are reported.", ""]
    header = [
        "Strategy",
        "Short TTFT median / P95 (ms)",
        "Long TTFT P95 (ms)",
        "Output tokens/s",
        f"Throughput vs {baseline}",
    ]
    rows = []
    for strategy in strategies:
        m = medians[strategy]
        throughput = m.get("output_throughput")
        vs = _DASH if strategy == baseline else format_percent(
            (changes.get(strategy, {}).get("output_throughput") or {}).get("percent")
        )
        rows.append([
            strategy,
            f"{format_ms(m.get('short_ttft_p50_ms'))} / {format_ms(m.get('short_ttft_p95_ms'))}",
            format_ms(m.get("long_ttft_p95_ms")),
            "-" if throughput is None else f"{throughput:.2f}",
            vs,
        ])
    lines += md_table(header, rows)
    others = [s for s in strategies if s != baseline]
    if others:
        confidence = change_confidence(changes)
        lines += ["", f"Change vs {baseline} [{100 * confidence:g}% CI] (n: paired repeats the interval rests on)", ""]
        change_rows = [
            [strategy] + [format_change(changes.get(strategy, {}).get(m.key)) for m in COMPARISON_METRICS]
            for strategy in others
        ]
        lines += md_table(["Strategy"] + [m.label for m in COMPARISON_METRICS], change_rows)
        lines += _few_pairs_note({s: changes.get(s, {}) for s in others})
    failed = section.get("failed", {})
    if any(failed.get(s) for s in strategies):
        note = ", ".join(f"{s}: {failed.get(s, 0)}" for s in strategies)
        lines += ["", f"Failed measured requests: {note} (failed requests are excluded from latencies)."]
    return "\n".join(lines)


def render_markdown(report: Mapping[str, Any]) -> str:
    """The whole report as Markdown: run facts, then one section per workload."""
    meta = report["meta"]
    parts = ["# Prefill-queue strategy comparison", "", *_meta_lines(meta)]
    for name, section in report["workloads"].items():
        parts += ["", render_workload_markdown(name, section, meta["strategies"], meta["baseline"])]
    return "\n".join(parts) + "\n"


def _file_label(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _write_plots(
    report: Mapping[str, Any], out: Path, ttft_samples: Mapping[str, Mapping[str, Mapping[str, Sequence[float]]]]
) -> dict[str, str]:
    """Draw every workload's TTFT CDF and throughput bars into ``out``; returns ``report["files"]`` entries."""
    meta = report["meta"]
    files: dict[str, str] = {}
    for name, section in report["workloads"].items():
        label = _file_label(name)
        # When every request failed there is no TTFT to plot; the report is still written.
        if any(len(values) for per in ttft_samples[name].values() for values in per.values()):
            cdf = plot_ttft_cdf(ttft_samples[name], out / f"ttft_cdf_{label}.png", f"TTFT CDF - {name}")
            files[f"ttft_cdf_{name}"] = cdf.name
        others = {s: section["changes"][s] for s in meta["strategies"] if s != meta["baseline"]}
        bars = plot_throughput(
            section,
            meta["strategies"],
            meta["baseline"],
            out / f"throughput_{label}.png",
            f"Output throughput - {name}",
            change_confidence(others),
        )
        files[f"throughput_{name}"] = bars.name
    return files


def write_report(
    report: dict[str, Any],
    out_dir: str | Path,
    ttft_samples: Mapping[str, Mapping[str, Mapping[str, Sequence[float]]]],
) -> dict[str, str]:
    """Write ``report.json``, ``report.md`` and per-workload PNGs into ``out_dir``.

    ``ttft_samples[workload][strategy][request_class]`` feeds the CDF plots. The paths
    written are returned and also stored in ``report["files"]`` (relative to ``out_dir``).
    Without matplotlib no PNG is written and ``report["meta"]["plots_not_written"]`` says why
    (the report's Markdown too); the JSON and Markdown hold every number the plots show.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = report["meta"]
    files: dict[str, str] = {"json": "report.json", "markdown": "report.md"}
    no_plots = plots_unavailable()
    if not no_plots:
        try:
            files.update(_write_plots(report, out, ttft_samples))
        except ImportError as exc:
            # The measured run is worth more than its pictures: write the report without them.
            no_plots = f"matplotlib failed while drawing ({exc}); the report holds every number the plots show"
    if no_plots:
        meta["plots_not_written"] = no_plots
    report["files"] = files
    (out / files["markdown"]).write_text(render_markdown(report), encoding="utf-8")
    write_json(report, out / files["json"])
    return {key: str(out / rel) for key, rel in files.items()}
