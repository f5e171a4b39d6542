"""A soak run's results and their Markdown report (see :mod:`lightllm.benchmark.soak_server`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List


@dataclass
class PhaseResult:
    """Outcome of one phase: requests that completed, failed, and how long it took."""

    sent: int = 0
    ok: int = 0
    errors: int = 0
    seconds: float = 0.0
    error_samples: List[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        """Count an error, keeping the first few messages for the report."""
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(message[:300])


def _mib(kib: int) -> str:
    return f"{kib / 1024:.0f}"


def render_markdown(report: Dict[str, Any]) -> str:
    """Per-round RSS of every process, phase outcomes, /dev/shm use and the leak verdict."""
    rounds: List[Dict[str, Any]] = report.get("rounds", [])
    lines = ["# Soak run", ""]
    if report.get("command"):
        lines += ["```bash", report["command"], "```", ""]
    machine = report.get("machine", {})
    if machine:
        lines.append(
            f"Machine: {machine.get('cpu_count')} CPUs, {machine.get('MemTotal', '?')} RAM, "
            f"{machine.get('platform', '?')}, torch {machine.get('torch', '?')}; "
            f"load average at the end {' '.join(machine.get('loadavg_at_end', []))}."
        )
        lines.append("")
    labels = list(report.get("start", {}).get("memory", {}))
    for entry in rounds:
        labels += [label for label in entry["memory"] if label not in labels]
    header = ["process", "start"] + [f"after round {r['round']}" for r in rounds] + ["last vs round 1"]
    lines += ["RSS in MiB (`VmRSS` of `/proc/<pid>/status`):", "",
              "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    verdicts = {v["label"]: v for v in report.get("verdicts", [])}
    for label in labels:
        start = report.get("start", {}).get("memory", {}).get(label)
        cells = [label, _mib(start["rss_kib"]) if start else "—"]
        for entry in rounds:
            sample = entry["memory"].get(label)
            cells.append(_mib(sample["rss_kib"]) if sample else "gone")
        verdict = verdicts.get(label)
        if verdict is None:
            cells.append("—")
        else:
            growth = verdict["growth"]
            text = "n/a" if growth == float("inf") else f"{growth * 100:+.1f}%"
            cells.append(f"{text} {'ok' if verdict['holds'] else 'GREW'}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| round | " + " | ".join(f"{k} ok/sent (errors, s)" for k in ("streams", "aborts", "requests"))
              + " | went idle | server's /dev/shm MiB (files) |", "|" + " --- |" * 6]
    for entry in rounds:
        cells = [str(entry["round"])]
        for kind in ("streams", "aborts", "requests"):
            phase = entry["phases"].get(kind)
            cells.append(f"{phase['ok']}/{phase['sent']} ({phase['errors']}, {phase['seconds']:.1f})" if phase else "—")
        shm = entry["shm"]
        cells += ["yes" if entry["went_idle"] else "NO", f"{shm['bytes'] / 2**20:.1f} ({shm['files']})"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    holds = report.get("criterion_holds")
    tolerance = report.get("args", {}).get("tolerance", 0.05)
    lines.append(
        f"Leak criterion (every process's RSS after the last round within {tolerance * 100:.0f}% of after round 1): "
        f"**{'holds' if holds else 'fails'}**; request errors: {report.get('errors', 0)}."
    )
    left = report.get("shm_left_after_stop")
    if left is not None:
        owner = " Its owner lock file was left too." if report.get("shm_owner_lock_left_after_stop") else ""
        lines.append(f"Shared-memory segments of the server left after it stopped: {left['files']}.{owner}")
    if report.get("stopped_early"):
        lines.append(f"Stopped early: {report['stopped_early']}.")
    for entry in rounds:
        for kind, phase in entry["phases"].items():
            for sample in phase.get("error_samples", []):
                lines.append(f"- round {entry['round']} {kind} error: `{sample}`")
    return "\n".join(lines) + "\n"


def round_line(entry: Dict[str, Any]) -> str:
    """The line printed after each round: phase outcomes and RSS per process."""
    phases = ", ".join(f"{k} {p['ok']}/{p['sent']} ok in {p['seconds']:.1f}s" for k, p in entry["phases"].items())
    rss = ", ".join(f"{label} {m['rss_kib'] / 1024:.0f}" for label, m in entry["memory"].items())
    return f"round {entry['round']}: {phases}; RSS MiB: {rss}"


def memory_info() -> Dict[str, Any]:
    """Total and available memory and the load average at the end, for the report's machine line."""
    info: Dict[str, Any] = {}
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                name, _, value = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    info[name] = value.strip()
        with open("/proc/loadavg") as handle:
            info["loadavg_at_end"] = handle.read().split()[:3]
    except OSError:
        pass
    return info
