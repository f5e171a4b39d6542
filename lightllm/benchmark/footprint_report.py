"""The markdown form of a :mod:`lightllm.benchmark.process_footprint` result: ready time, processes, imports."""

from __future__ import annotations

import statistics
from typing import Any, Dict, Optional

READY_PATH = "/health/ready"


def _mib(kib: Optional[int]) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f}"


def _sec(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_report(result: Dict[str, Any]) -> str:
    """The JSON result as markdown: server ready time, one table of processes, one of imports."""
    lines = [f"lightllm measured: `{result.get('lightllm_path', '?')}`", ""]
    launches = result.get("launches", [])
    if launches:
        times = [l["time_to_ready_s"] for l in launches]
        lines.append(f"Time to `{READY_PATH}` 200: median {statistics.median(times):.2f} s over "
                     f"{len(times)} launch(es) ({', '.join(f'{t:.2f}' for t in times)}); "
                     f"stop took {', '.join(_sec(l.get('stop_s')) for l in launches)} s.")
        lines += ["", f"Processes (launch {len(launches)}, snapshot at ready):", "",
                  "| label | pid | entry module | RSS MiB | anon MiB | maps libtorch "
                  "| started after launch s | CPU s |",
                  "|---|---|---|---|---|---|---|---|"]
        for p in launches[-1]["processes"]:
            lines.append(f"| {p['label']} | {p['pid']} | {p['entry_module'] or '-'} | {_mib(p['rss_kib'])} | "
                         f"{_mib(p['anon_kib'])} | {'yes' if p['maps_libtorch'] else 'no'} | "
                         f"{_sec(p['started_after_launch_s'])} | {_sec(p['cpu_s'])} |")
        total_rss = sum(p["rss_kib"] for p in launches[-1]["processes"])
        total_anon = sum(p["anon_kib"] for p in launches[-1]["processes"])
        lines.append(f"| **total** | | | {_mib(total_rss)} | {_mib(total_anon)} | | | |")
    imports = result.get("imports", [])
    if imports:
        repeats = result.get("repeats", "?")
        lines += ["", f"Cold import in a fresh interpreter (median of {repeats}):", "",
                  "| label | module | import s | interpreter wall s | loads torch | modules loaded |",
                  "|---|---|---|---|---|---|"]
        for item in imports:
            if "error" in item:
                lines.append(f"| {item['label']} | {item['module']} | error: {' '.join(item['error'])} | | | |")
                continue
            lines.append(f"| {item['label']} | {item['module']} | {item['import_s']:.2f} | {item['wall_s']:.2f} | "
                         f"{'yes' if item['loads_torch'] else 'no'} | {item['modules_loaded']} |")
    return "\n".join(lines) + "\n"
