"""Compare prefill-queue strategies side by side on the same machine, workload and flags.

Usage::

    python -m lightllm.benchmark.compare_strategies --model_dir DIR --workload long_first \\
        --long-count 16 --long-len 2048 --short-count 16 --short-len 64 --output-len 32 \\
        --strategies default,promote_shortest,hrrn --repeats 3 --warmup 1 \\
        --server-args "--chunked_prefill_size 256 --batch_max_tokens 256" --out-dir bench_results/run1

How a run is laid out (and why):

* One server per strategy is started once (the start-ups overlap; they are never
  measured), with identical flags apart from ``--prefill_queue_strategy``, and all
  stay up for the whole run. Only one is measured
  at a time; the others sit idle (their model ranks poll every few tens of ms), which
  costs far less than restarting every server for every visit and keeps a start-up
  (imports, allocation, first forward) out of every measurement. Running them
  concurrently under load would make them disturb each other, so they never do.
* Because all servers are up at once, their KV capacity must not be sized from free
  memory (the first server would take most of it): unless ``--server-args`` sets
  ``--max_total_token_num``, the runner adds ``--max_total_token_num <--kv-tokens>``.
* Each server gets ``--warmup`` full unmeasured passes of each workload first, with
  prompts from a separate namespace so they never warm the prefix cache for the
  measured prompts.
* Repeat ``r`` visits the strategies in the list rotated left by ``r``; with a number
  of repeats that is a multiple of the number of strategies every strategy holds every
  position equally often, so drift and position effects hit all of them alike.
* Within a repeat every strategy gets exactly the same schedule and prompts (workload
  seed ``--seed + r``, prompt namespace per repeat), and no two repeats share prompts,
  so prefix caching never helps across repeats.
* Each strategy is compared to the baseline of the *same repeat* (paired log ratios,
  see :mod:`lightllm.benchmark.paired_stats`).
* ``--topology 1p1d`` replaces each server by a PD cluster (:mod:`lightllm.benchmark.pd_cluster`):
  a master, a prefill node with the strategy and ``--server-args``, and a decode node with
  ``--server-args``. The workload goes to the master, and everything else is the same. The logs
  are ``logs/server_<strategy>_{master,prefill,decode}.log``.

Outputs in ``--out-dir``: ``report.json``, ``report.md``, ``ttft_cdf_<workload>.png``,
``throughput_<workload>.png``, ``runs/<workload>/<strategy>/repeat<r>.{jsonl,json}``
(raw per-request records and the run summary) and ``logs/server_<strategy>.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import os
import shlex
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Sequence

from lightllm.benchmark.bench_serving import PROMPT_FORMATS, BenchmarkConfig, load_tokenizer, run_benchmark
from lightllm.benchmark.comparison_metrics import analyze_runs, rotated_order
from lightllm.benchmark.metrics import read_records_jsonl
from lightllm.benchmark.prompts import PromptBuilder
from lightllm.benchmark.run_environment import git_info, machine_info
from lightllm.benchmark.report_writer import render_markdown, write_json, write_report
from lightllm.benchmark.server_launcher import (
    TOPOLOGIES,
    Deployment,
    ServerSpec,
    Topology,
    launch_all,
    make_topology,
)
from lightllm.benchmark.workloads import WORKLOADS, WorkloadConfig, build_workload
from lightllm.server.router.model_infer.mode_backend.prefill_queue_strategy import available_strategy_names

DEFAULT_STRATEGIES = "default,promote_shortest,hrrn"
DEFAULT_KV_TOKENS = 262144
# CLI spellings of WorkloadConfig fields where they differ from "--" + field with dashes
# (kept identical to bench_serving's flags).
_FLAG_NAMES = {"duration_s": "--duration"}
_WORKLOAD_FIELDS = [f for f in dataclasses.fields(WorkloadConfig) if f.name not in ("name", "seed")]


@dataclasses.dataclass
class ComparisonOptions:
    """Everything one comparison run needs; :meth:`validate` checks it."""

    model_dir: str
    workloads: list[WorkloadConfig]
    out_dir: str
    strategies: list[str] = dataclasses.field(default_factory=lambda: DEFAULT_STRATEGIES.split(","))
    baseline: str = "default"
    repeats: int = 3
    warmup: int = 1
    server_args: list[str] = dataclasses.field(default_factory=list)
    seed: int = 0
    kv_tokens: int = DEFAULT_KV_TOKENS
    prompt_format: str = "text"
    max_concurrency: int | None = None
    request_timeout_s: float = 3600.0
    bootstrap_resamples: int = 2000
    confidence: float = 0.95
    settle_s: float = 1.0
    parallel_start: bool = True
    show_progress: bool = False
    command: str = ""

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if not self.model_dir or not os.path.isdir(self.model_dir):
            raise ValueError(f"model_dir must be an existing directory, got {self.model_dir!r}")
        if not self.workloads:
            raise ValueError("workloads must name at least one workload")
        names = [w.name for w in self.workloads]
        if len(set(names)) != len(names):
            raise ValueError(f"workloads must not repeat a name, got {names}")
        if not self.strategies or any(not s for s in self.strategies):
            raise ValueError(f"strategies must be a non-empty list of names, got {self.strategies}")
        if len(set(self.strategies)) != len(self.strategies):
            raise ValueError(f"strategies must not repeat a name, got {self.strategies}")
        known = available_strategy_names()
        unknown = [s for s in self.strategies if s not in known]
        if unknown:
            raise ValueError(f"strategies must be among {known}, got unknown {unknown}")
        if self.baseline not in self.strategies:
            raise ValueError(f"baseline must be one of strategies {self.strategies}, got {self.baseline!r}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.kv_tokens < 1:
            raise ValueError(f"kv_tokens must be >= 1, got {self.kv_tokens}")
        if self.settle_s < 0:
            raise ValueError(f"settle_s must be >= 0, got {self.settle_s}")
        if self.bootstrap_resamples < 1:
            raise ValueError(f"bootstrap_resamples must be >= 1, got {self.bootstrap_resamples}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be within (0, 1), got {self.confidence}")
        for workload in self.workloads:
            build_workload(workload)  # raises ValueError naming the bad knob
        self.benchmark_config("http://127.0.0.1", self.workloads[0], "check").validate()

    def effective_server_args(self) -> list[str]:
        """``server_args`` plus a fixed KV capacity when none was given (see module docstring)."""
        args = list(self.server_args)
        if not ServerSpec(self.model_dir, self.baseline, tuple(args)).has_flag("--max_total_token_num"):
            args += ["--max_total_token_num", str(self.kv_tokens)]
        return args

    def benchmark_config(
        self, base_url: str, workload: WorkloadConfig, namespace: str, output_jsonl: str | None = None
    ) -> BenchmarkConfig:
        """One bench_serving run of ``workload`` against ``base_url``."""
        return BenchmarkConfig(
            base_url=base_url,
            tokenizer=self.model_dir,
            workload=workload,
            prompt_format=self.prompt_format,
            max_concurrency=self.max_concurrency,
            request_timeout_s=self.request_timeout_s,
            prompt_namespace=namespace,
            output_jsonl=output_jsonl,
            show_progress=self.show_progress,
        )


def _load_average() -> list[float] | None:
    """1, 5 and 15 minute system load averages, ``None`` where the platform has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


class ComparisonRunner:
    """Runs the warm-up passes and rotated measured repeats against already started servers."""

    def __init__(self, options: ComparisonOptions, deployments: dict[str, Deployment], builder: PromptBuilder):
        self.options = options
        self.deployments = deployments
        self.builder = builder
        self.out_dir = Path(options.out_dir)

    def _run(
        self, strategy: str, workload: WorkloadConfig, namespace: str, output_jsonl: str | None = None
    ) -> dict[str, Any]:
        deployment = self.deployments[strategy]
        if not deployment.is_alive():
            logs = ", ".join(str(p) for p in deployment.log_paths)
            raise RuntimeError(f"the {strategy} server is no longer running; see {logs}")
        config = self.options.benchmark_config(deployment.base_url, workload, namespace, output_jsonl)
        summary = asyncio.run(run_benchmark(config, self.builder))
        # Let the server finish bookkeeping (detokenization, cache release) before the next run.
        time.sleep(self.options.settle_s)
        return summary

    def warm_up(self, workload: WorkloadConfig) -> dict[str, list[dict[str, Any]]]:
        """Unmeasured full passes of ``workload`` on every server, with prompts of their own."""
        notes: dict[str, list[dict[str, Any]]] = {s: [] for s in self.options.strategies}
        for k in range(self.options.warmup):
            for strategy in self.options.strategies:
                summary = self._run(strategy, workload, f"{workload.name}-warmup-{k}")
                notes[strategy].append({"duration_s": summary["duration_s"], "failed": summary["overall"]["failed"]})
        return notes

    def measure(self, workload: WorkloadConfig) -> tuple[dict[str, list[dict[str, Any]]], list[list[str]]]:
        """Measured repeats in rotated order; returns run entries per strategy and the visit orders."""
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in self.options.strategies}
        orders = []
        for r in range(self.options.repeats):
            order = rotated_order(self.options.strategies, r)
            orders.append(order)
            repeat_workload = dataclasses.replace(workload, seed=self.options.seed + r)
            for position, strategy in enumerate(order):
                run_dir = self.out_dir / "runs" / workload.name / strategy
                run_dir.mkdir(parents=True, exist_ok=True)
                jsonl = run_dir / f"repeat{r}.jsonl"
                namespace = f"{workload.name}-repeat-{r}"
                # Load averages around each run show when other work on the machine overlapped it.
                load_before = _load_average()
                summary = self._run(strategy, repeat_workload, namespace, str(jsonl))
                load_after = _load_average()
                summary_path = write_json(summary, run_dir / f"repeat{r}.json")
                runs[strategy].append({
                    "repeat": r,
                    "position": position,
                    "seed": repeat_workload.seed,
                    "prompt_namespace": namespace,
                    "records_jsonl": str(jsonl.relative_to(self.out_dir)),
                    "summary_json": str(summary_path.relative_to(self.out_dir)),
                    "load_average_before": load_before,
                    "load_average_after": load_after,
                    "summary": summary,
                })
        return runs, orders

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


def run_comparison(options: ComparisonOptions, topology: Topology) -> dict[str, Any]:
    """Start one server per strategy, run every workload, write the report; return it."""
    options.validate()
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
        "max_concurrency": options.max_concurrency,
        "order": (
            "rotated: repeat r visits the strategies rotated left by r; "
            "all servers stay up, one is measured at a time"
        ),
        "bootstrap": {"resamples": options.bootstrap_resamples, "confidence": options.confidence, "seed": options.seed},
        "topology": topology.describe(),
        "git": git_info(),
        "machine": machine_info(),
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    builder = PromptBuilder(load_tokenizer(options.model_dir))
    report: dict[str, Any] = {"meta": meta, "workloads": {}}
    samples: dict[str, dict[str, dict[str, list[float]]]] = {}
    with ExitStack() as stack:
        specs = [ServerSpec(options.model_dir, s, tuple(server_args)) for s in options.strategies]
        launched = launch_all(topology, specs, out / "logs", parallel=options.parallel_start)
        deployments: dict[str, Deployment] = {}
        for strategy, deployment in zip(options.strategies, launched):
            deployments[strategy] = stack.enter_context(deployment)
        meta["servers"] = {s: d.describe() for s, d in deployments.items()}
        runner = ComparisonRunner(options, deployments, builder)
        for workload in options.workloads:
            warmup = runner.warm_up(workload)
            runs, orders = runner.measure(workload)
            analysis = analyze_runs(
                {s: [e["summary"] for e in entries] for s, entries in runs.items()},
                options.baseline,
                resamples=options.bootstrap_resamples,
                confidence=options.confidence,
                seed=options.seed,
            )
            report["workloads"][workload.name] = {
                "workload": dataclasses.asdict(workload),
                "repeat_seeds": [options.seed + r for r in range(options.repeats)],
                "visit_orders": orders,
                "warmup": warmup,
                **analysis,
                "runs": runs,
            }
            samples[workload.name] = runner.ttft_samples(runs)
    meta["finished_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    write_report(report, out, samples)
    return report


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface of ``python -m lightllm.benchmark.compare_strategies``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", required=True, help="local checkpoint directory (also the tokenizer)")
    p.add_argument(
        "--workload", required=True,
        help=f"workload name(s), comma-separated, from {sorted(WORKLOADS)}; the flags below apply to all",
    )
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="comma-separated strategy names")
    p.add_argument("--baseline", default="default", help="strategy the others are compared with")
    p.add_argument("--repeats", type=int, default=3, help="measured repeats (rotated order)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured full passes per strategy and workload")
    p.add_argument(
        "--server-args", default="",
        help="flags given to every server, as one shell-quoted string (use --server-args=--flag for a lone flag)",
    )
    p.add_argument("--kv-tokens", type=int, default=DEFAULT_KV_TOKENS,
                   help="--max_total_token_num added to every server unless --server-args sets it")
    p.add_argument(
        "--topology", choices=sorted(TOPOLOGIES), default="normal",
        help="normal: one server per strategy; 1p1d: one PD cluster per strategy (master + prefill node with "
        "the strategy and --server-args + decode node with --server-args), measured through the master",
    )
    p.add_argument("--master-args", default="",
                   help="1p1d: flags of the PD master, as one shell-quoted string "
                   "(e.g. '--pd_prefill_timeout_seconds 60')")
    p.add_argument("--prefill-devices", default=None, help="1p1d on GPUs: CUDA_VISIBLE_DEVICES of the prefill nodes")
    p.add_argument("--decode-devices", default=None, help="1p1d on GPUs: CUDA_VISIBLE_DEVICES of the decode nodes")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to become healthy")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--seed", type=int, default=0, help="repeat r uses workload seed SEED + r; also seeds the bootstrap")
    p.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="text")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--bootstrap-resamples", type=int, default=2000)
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--sequential-start", action="store_true",
                   help="start the servers one after another instead of together (start-up is never measured)")
    p.add_argument("--settle", type=float, default=1.0, help="seconds to pause after each run")
    p.add_argument("--progress", action="store_true", help="show a progress bar per run")
    load = p.add_argument_group("workload (same flags as bench_serving)")
    for field in _WORKLOAD_FIELDS:
        flag = _FLAG_NAMES.get(field.name, "--" + field.name.replace("_", "-"))
        kind = type(field.default) if field.default is not None else int
        load.add_argument(flag, dest=field.name, type=kind, default=field.default)
    return p


def options_from_args(args: argparse.Namespace, argv: Sequence[str]) -> ComparisonOptions:
    """Translate parsed CLI arguments into :class:`ComparisonOptions`."""
    knobs = {f.name: getattr(args, f.name) for f in _WORKLOAD_FIELDS}
    names = [n.strip() for n in args.workload.split(",") if n.strip()]
    for name in names:
        if name not in WORKLOADS:
            raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {name!r}")
    try:
        server_args = shlex.split(args.server_args)
    except ValueError as exc:
        raise ValueError(f"server_args is not a valid shell-quoted string: {exc}") from None
    return ComparisonOptions(
        model_dir=args.model_dir,
        workloads=[WorkloadConfig(name=n, seed=args.seed, **knobs) for n in names],
        out_dir=args.out_dir,
        strategies=[s.strip() for s in args.strategies.split(",") if s.strip()],
        baseline=args.baseline,
        repeats=args.repeats,
        warmup=args.warmup,
        server_args=server_args,
        seed=args.seed,
        kv_tokens=args.kv_tokens,
        prompt_format=args.prompt_format,
        max_concurrency=args.max_concurrency,
        request_timeout_s=args.request_timeout,
        bootstrap_resamples=args.bootstrap_resamples,
        confidence=args.confidence,
        settle_s=args.settle,
        parallel_start=not args.sequential_start,
        show_progress=args.progress,
        command=shlex.join([sys.executable, "-m", "lightllm.benchmark.compare_strategies", *argv]),
    )


_PD_ONLY_FLAGS = {"master_args": "--master-args", "prefill_devices": "--prefill-devices",
                  "decode_devices": "--decode-devices"}


def topology_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Constructor arguments of ``args.topology``; the 1p1d flags are refused for another topology."""
    kwargs: dict[str, Any] = {"host": args.host, "start_timeout_s": args.start_timeout}
    # An empty device list is a choice (hide every GPU); an empty --master-args is the default.
    given = [flag for name, flag in _PD_ONLY_FLAGS.items()
             if getattr(args, name) is not None and (name != "master_args" or getattr(args, name))]
    if args.topology != "1p1d":
        if given:
            raise ValueError(f"{', '.join(given)} only apply with --topology 1p1d, got --topology {args.topology}")
        return kwargs
    try:
        master_args = shlex.split(args.master_args)
    except ValueError as exc:
        raise ValueError(f"master_args is not a valid shell-quoted string: {exc}") from None
    return {**kwargs, "master_args": master_args, "prefill_devices": args.prefill_devices,
            "decode_devices": args.decode_devices}


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 1 if any measured request failed, else 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = options_from_args(args, argv)
        options.validate()
        topology = make_topology(args.topology, **topology_kwargs(args))
    except ValueError as exc:
        parser.error(str(exc))
    report = run_comparison(options, topology)
    print(render_markdown(report))
    print(f"report written to {Path(options.out_dir).resolve()}")
    failed = sum(n for section in report["workloads"].values() for n in section["failed"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
