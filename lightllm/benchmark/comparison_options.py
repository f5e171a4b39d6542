"""What one strategy comparison run needs: :class:`ComparisonOptions` and its defaults.

The options are filled in by the CLI (:mod:`lightllm.benchmark.compare_strategies`) or by a
caller directly, and consumed by :func:`lightllm.benchmark.comparison_runner.run_comparison`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from pathlib import Path

from lightllm.benchmark.bench_serving import PROMPT_FLAG_WORKLOADS
from lightllm.benchmark.serving_run import BenchmarkConfig
from lightllm.benchmark.deployment import ServerSpec
from lightllm.benchmark.student_t import student_t_quantile
from lightllm.benchmark.workloads import WorkloadConfig, build_workload
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import available_strategy_names

DEFAULT_STRATEGIES = "default,promote_shortest,hrrn"
DEFAULT_KV_TOKENS = 262144
# The longest pause after each run: it lets a machine's clocks and caches settle between runs,
# which takes seconds; ten minutes per run already multiplies a run's length many times, so more
# is a typo (the pause comes after the servers started, where a bad value crashed the run).
MAX_SETTLE_S = 600.0


def check_server_args(model_dir: str, strategy: str, server_args: list[str]) -> None:
    """Refuse, before any server starts, server flags the launcher owns (it sets them itself).

    A flag the server itself refuses stops its start within a second; the runner reports the
    server's one-line error then (:func:`~lightllm.benchmark.server_process.startup_error_line`).
    """
    try:
        ServerSpec(model_dir, strategy, tuple(server_args))
    except ValueError as exc:
        # ServerSpec calls them extra_args; here they are this run's server_args.
        message = str(exc)
        raise ValueError(message.replace("extra_args", "server_args", 1) if message.startswith("extra_args")
                         else f"server_args: {message}") from None


def check_out_dir(path: str) -> None:
    """Create ``path`` (and its parents) and make sure a file can be written in it.

    Checked before any server starts: a run that can write nothing loses everything it
    measured.  Creating the directory is the only reliable test (permission bits say nothing
    for root, nor for /proc or a read-only mount).

    Raises:
        ValueError: naming ``--out-dir`` and the reason.
    """
    if not path:
        raise ValueError("--out-dir must name a directory, got ''")
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"--out-dir {path!r} cannot be created or written: {exc.strerror or exc}") from None


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
    shared_prefix_len: int = 0
    max_concurrency: int | None = None
    request_timeout_s: float = 3600.0
    confidence: float = 0.95
    settle_s: float = 1.0
    parallel_start: bool = True
    show_progress: bool = False
    command: str = ""

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if not self.model_dir or not os.path.isdir(self.model_dir):
            raise ValueError(f"model_dir must be an existing directory, got {self.model_dir!r}")
        # Refused here, not when the first repeat's prompts are built after every server started.
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
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
        if not (math.isfinite(self.settle_s) and self.settle_s <= MAX_SETTLE_S):
            raise ValueError(f"settle_s must be a finite number of seconds, at most {MAX_SETTLE_S:g}, "
                             f"got {self.settle_s:g}")
        if not math.isfinite(self.request_timeout_s):
            raise ValueError(f"request_timeout_s must be a finite number of seconds, got {self.request_timeout_s}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be within (0, 1), got {self.confidence}")
        try:
            # 0.5 + c/2 rounds to 1 for c within 1e-16 of 1: no quantile, found here and not after the run.
            student_t_quantile(0.5 + self.confidence / 2.0, 1)
        except ValueError:
            raise ValueError(f"confidence {self.confidence!r} is too close to 1 for a t interval") from None
        # Checked here, not by the bench_serving config below: a workload that shares prefixes its
        # own way gets none, so that config may not see the value.
        if self.shared_prefix_len < 0:
            raise ValueError(f"shared_prefix_len must be >= 0, got {self.shared_prefix_len}")
        for workload in self.workloads:
            build_workload(workload)  # raises ValueError naming the bad knob
        self.benchmark_config("http://127.0.0.1", self.workloads[0], "check").validate()
        check_server_args(self.model_dir, self.baseline, self.server_args)

    def effective_server_args(self) -> list[str]:
        """``server_args`` plus a fixed KV capacity when none was given.

        All servers of a run are up at once, so sizing KV from free memory would let the first
        one take most of it (see :mod:`lightllm.benchmark.compare_strategies`).
        """
        args = list(self.server_args)
        if not ServerSpec(self.model_dir, self.baseline, tuple(args)).has_flag("--max_total_token_num"):
            args += ["--max_total_token_num", str(self.kv_tokens)]
        return args

    def server_specs(self) -> list[ServerSpec]:
        """One server spec per strategy, in ``strategies`` order, with :meth:`effective_server_args`."""
        server_args = tuple(self.effective_server_args())
        return [ServerSpec(self.model_dir, strategy, server_args) for strategy in self.strategies]

    def shared_prefix_of(self, workload: WorkloadConfig) -> int:
        """``shared_prefix_len`` for ``workload``: 0 for one that shares prefixes its own way
        (shared_prefix), as every workload flag applies only to the workloads that read it."""
        return self.shared_prefix_len if workload.name in PROMPT_FLAG_WORKLOADS["shared_prefix_len"] else 0

    def benchmark_config(
        self, base_url: str, workload: WorkloadConfig, namespace: str, output_jsonl: str | None = None
    ) -> BenchmarkConfig:
        """One bench_serving run of ``workload`` against ``base_url``."""
        return BenchmarkConfig(
            base_url=base_url,
            tokenizer=self.model_dir,
            workload=workload,
            prompt_format=self.prompt_format,
            shared_prefix_len=self.shared_prefix_of(workload),
            max_concurrency=self.max_concurrency,
            request_timeout_s=self.request_timeout_s,
            prompt_namespace=namespace,
            output_jsonl=output_jsonl,
            show_progress=self.show_progress,
        )
