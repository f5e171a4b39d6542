"""Running a strategy comparison: warm-up, rotated measured repeats and the report.

:func:`run_comparison` starts one deployment per strategy, drives every workload through
:class:`ComparisonRunner` and writes the report.  Why the run is laid out this way (all servers
up at once, one measured at a time, rotated visit order, per-repeat prompt namespaces) is
written down in :mod:`lightllm.benchmark.compare_strategies`, whose docstring is also the CLI
help.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from lightllm.benchmark.serving_run import load_tokenizer, run_benchmark
from lightllm.benchmark.comparison_metrics import analyze_runs, rotated_order
from lightllm.benchmark.comparison_options import ComparisonOptions
from lightllm.benchmark.metrics import read_records_jsonl
from lightllm.benchmark.paired_stats import INTERVAL_METHOD
from lightllm.benchmark.prompts import PromptBuilder
from lightllm.benchmark.report_writer import write_json, write_report
from lightllm.benchmark.run_environment import git_info, machine_info
from lightllm.benchmark.deployment import Deployment
from lightllm.benchmark.server_launcher import Topology, launch_all
from lightllm.benchmark.workloads import WorkloadConfig


class ServerLostError(RuntimeError):
    """A compared deployment stopped running or answering during the comparison (one-line message)."""


@dataclasses.dataclass
class Measurement:
    """The measured repeats of one workload that completed for every strategy.

    ``error`` is set when a server died: ``runs`` and ``orders`` then hold only the repeats
    before the one it broke (possibly none).
    """

    runs: dict[str, list[dict[str, Any]]]
    orders: list[list[str]]
    error: ServerLostError | None = None


def _load_average() -> list[float] | None:
    """1, 5 and 15 minute system load averages, ``None`` where the platform has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


# How long a server whose connection failed may take to show its exit before it counts as alive
# but not answering.
_EXIT_GRACE_S = 2.0


class ComparisonRunner:
    """Runs the warm-up passes and rotated measured repeats against already started servers."""

    def __init__(self, options: ComparisonOptions, deployments: dict[str, Deployment], builder: PromptBuilder):
        self.options = options
        self.deployments = deployments
        self.builder = builder
        self.out_dir = Path(options.out_dir)

    def _check_alive(self, strategy: str, what: str) -> None:
        deployment = self.deployments[strategy]
        if not deployment.is_alive():
            logs = ", ".join(str(p) for p in deployment.log_paths)
            raise ServerLostError(f"the {strategy} server stopped running ({what}); see {logs}")

    def _run(
        self, strategy: str, workload: WorkloadConfig, namespace: str, output_jsonl: str | None = None
    ) -> dict[str, Any]:
        self._check_alive(strategy, f"before {namespace}")
        deployment = self.deployments[strategy]
        config = self.options.benchmark_config(deployment.base_url, workload, namespace, output_jsonl)
        try:
            summary = asyncio.run(run_benchmark(config, self.builder))
        except httpx.HTTPError as exc:
            # Requests record their own failures; what raises is the run's set-up (the model
            # name query), which fails when the server is gone.  A server killed a moment ago can
            # close its socket before its exit can be collected, so its death gets a short while to
            # show: "stopped running" names the logs to read, "stopped answering" cannot.
            deadline = time.monotonic() + _EXIT_GRACE_S
            while deployment.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            self._check_alive(strategy, f"during {namespace}")
            raise ServerLostError(f"the {strategy} server at {deployment.base_url} stopped answering "
                                  f"(during {namespace}): {type(exc).__name__}: {exc}") from None
        # A server that died during the run failed its requests: the run measured the death, not
        # the strategy, so it must not count.
        self._check_alive(strategy, f"during {namespace}")
        # Let the server finish bookkeeping (detokenization, cache release) before the next run.
        time.sleep(self.options.settle_s)
        return summary

    def warm_up(self, workload: WorkloadConfig) -> dict[str, list[dict[str, Any]]]:
        """Unmeasured full passes of ``workload`` on every server, with prompts of their own.

        Raises:
            ServerLostError: a server stopped running.
        """
        notes: dict[str, list[dict[str, Any]]] = {s: [] for s in self.options.strategies}
        for k in range(self.options.warmup):
            for strategy in self.options.strategies:
                summary = self._run(strategy, workload, f"{workload.name}-warmup-{k}")
                notes[strategy].append({"duration_s": summary["duration_s"], "failed": summary["overall"]["failed"]})
        return notes

    def measure(self, workload: WorkloadConfig) -> Measurement:
        """Measured repeats in rotated order: run entries per strategy and the visit orders.

        When a server dies the measurement stops there and keeps the repeats completed by every
        strategy (their raw files stay on disk either way).
        """
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in self.options.strategies}
        orders: list[list[str]] = []
        for r in range(self.options.repeats):
            order = rotated_order(self.options.strategies, r)
            repeat_workload = dataclasses.replace(workload, seed=self.options.seed + r)
            entries: dict[str, dict[str, Any]] = {}
            for position, strategy in enumerate(order):
                try:
                    entries[strategy] = self._measure_one(strategy, repeat_workload, r, position)
                except ServerLostError as exc:
                    return Measurement(runs, orders, exc)
            orders.append(order)
            for strategy, entry in entries.items():
                runs[strategy].append(entry)
        return Measurement(runs, orders)

    def _measure_one(self, strategy: str, workload: WorkloadConfig, r: int, position: int) -> dict[str, Any]:
        run_dir = self.out_dir / "runs" / workload.name / strategy
        run_dir.mkdir(parents=True, exist_ok=True)
        jsonl = run_dir / f"repeat{r}.jsonl"
        namespace = f"{workload.name}-repeat-{r}"
        # Load averages around each run show when other work on the machine overlapped it.
        load_before = _load_average()
        summary = self._run(strategy, workload, namespace, str(jsonl))
        load_after = _load_average()
        summary_path = write_json(summary, run_dir / f"repeat{r}.json")
        return {
            "repeat": r,
            "position": position,
            "seed": workload.seed,
            "prompt_namespace": namespace,
            "records_jsonl": str(jsonl.relative_to(self.out_dir)),
            "summary_json": str(summary_path.relative_to(self.out_dir)),
            "load_average_before": load_before,
            "load_average_after": load_after,
            "summary": summary,
        }

    def ttft_samples(self, runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, list[float]]]:
        """TTFTs (ms) per strategy and request class, pooled over the measured repeats."""
        samples: dict[str, dict[str, list[float]]] = {}
        for strategy, entries in runs.items():
            per_class: dict[str, list[float]] = {}
            for entry in entries:
                for record in read_records_jsonl(self.out_dir / entry["records_jsonl"]):
                    if record.ttft is not None:
                        per_class.setdefault(record.request_class, []).append(record.ttft * 1e3)
            samples[strategy] = per_class
        return samples


def run_comparison(
    options: ComparisonOptions, topology: Topology, builder: PromptBuilder | None = None
) -> dict[str, Any]:
    """Start one server per strategy, run every workload, write the report; return it.

    ``builder`` reuses a prompt builder (default: one for ``options.model_dir``'s tokenizer).

    Raises:
        ValueError: the options, or flags ``topology``'s launch would override (before any process starts).
        ServerLostError: a server stopped running mid-run.  Every server is stopped first; the
            report is still written when at least one repeat completed for every strategy (it
            covers those repeats and says the run stopped early), and the message says whether.
    """
    options.validate()
    specs = options.server_specs()
    for spec in specs:
        topology.check_spec(spec)
    out = Path(options.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    server_args = options.effective_server_args()
    meta: dict[str, Any] = {
        "command": options.command,
        "model_dir": str(options.model_dir),
        "strategies": list(options.strategies),
        "baseline": options.baseline,
        "repeats": options.repeats,
        "warmup": options.warmup,
        "seed": options.seed,
        "server_args": server_args,
        "kv_tokens_added_by_runner": server_args != list(options.server_args),
        "prompt_format": options.prompt_format,
        "shared_prefix_len": options.shared_prefix_len,
        "max_concurrency": options.max_concurrency,
        "order": (
            "rotated: repeat r visits the strategies rotated left by r; "
            "all servers stay up, one is measured at a time"
        ),
        "interval": {"method": INTERVAL_METHOD, "confidence": options.confidence},
        "topology": topology.describe(),
        "git": git_info(),
        "machine": machine_info(),
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if builder is None:
        builder = PromptBuilder(load_tokenizer(options.model_dir))
    report: dict[str, Any] = {"meta": meta, "workloads": {}}
    samples: dict[str, dict[str, dict[str, list[float]]]] = {}
    stopped: ServerLostError | None = None
    with ExitStack() as stack:
        launched = launch_all(topology, specs, out / "logs", parallel=options.parallel_start)
        deployments: dict[str, Deployment] = {}
        for strategy, deployment in zip(options.strategies, launched):
            deployments[strategy] = stack.enter_context(deployment)
        meta["servers"] = {s: d.describe() for s, d in deployments.items()}
        runner = ComparisonRunner(options, deployments, builder)
        for workload in options.workloads:
            try:
                warmup = runner.warm_up(workload)
            except ServerLostError as exc:
                stopped = exc
                break
            measurement = runner.measure(workload)
            stopped = measurement.error
            if measurement.orders:
                report["workloads"][workload.name] = _workload_section(options, workload, warmup, measurement)
                samples[workload.name] = runner.ttft_samples(measurement.runs)
            if stopped is not None:
                break
    meta["finished_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if stopped is None:
        write_report(report, out, samples)
        return report
    meta["stopped_early"] = str(stopped)
    if not report["workloads"]:
        raise ServerLostError(f"{stopped}; no measured repeat completed, so no report was written "
                              f"(the raw runs are under {out / 'runs'})")
    write_report(report, out, samples)
    complete = ", ".join(f"{name}: {len(section['visit_orders'])} of {options.repeats}"
                         for name, section in report["workloads"].items())
    raise ServerLostError(f"{stopped}; the report in {out} covers the repeats completed before that ({complete})")


def _workload_section(options: ComparisonOptions, workload: WorkloadConfig, warmup: dict[str, list[dict[str, Any]]],
                      measurement: Measurement) -> dict[str, Any]:
    """The report section of one workload from its completed repeats."""
    runs = measurement.runs
    analysis = analyze_runs(
        {s: [e["summary"] for e in entries] for s, entries in runs.items()},
        options.baseline,
        confidence=options.confidence,
    )
    section = {
        "workload": dataclasses.asdict(workload),
        "repeat_seeds": [options.seed + r for r in range(len(measurement.orders))],
        "visit_orders": measurement.orders,
        "warmup": warmup,
        **analysis,
        "runs": runs,
    }
    if measurement.error is not None:
        section["stopped_early"] = str(measurement.error)
    return section
