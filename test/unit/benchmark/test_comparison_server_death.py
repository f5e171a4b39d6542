"""A server that dies mid-comparison: a clear error, every server stopped, the completed repeats reported.

Two real servers run a tiny workload.  The hrrn server is killed at a fixed point of the run (the
moment the prompts of its second measured repeat are built, which is after the first repeat
completed for both strategies), so nothing depends on timing.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from lightllm.benchmark.serving_run import load_tokenizer
from lightllm.benchmark.comparison_options import ComparisonOptions
from lightllm.benchmark.comparison_runner import ServerLostError, run_comparison
from lightllm.benchmark.prompts import Prompt, PromptBuilder
from lightllm.benchmark.server_launcher import NormalTopology
from lightllm.benchmark.server_session import session_alive
from lightllm.benchmark.workloads import WorkloadConfig

_KILL_WAIT_S = 60.0  # bound on a SIGKILLed process becoming a zombie; never reached when all is well


def _server_pid(strategy: str) -> int:
    """The pid of this process's API-server child started with ``strategy``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) == os.getpid() and b"lightllm.server.api_server" in cmdline and strategy.encode() in cmdline:
            return int(entry.name)
    raise AssertionError(f"no {strategy} server among this process's children")


class KillingPromptBuilder(PromptBuilder):
    """A prompt builder that SIGKILLs one server when the prompts of a given run are first built."""

    def __init__(self, tokenizer: Any, namespace: str, strategy: str) -> None:
        super().__init__(tokenizer)
        self.namespace = namespace
        self.strategy = strategy
        self.killed: int | None = None

    def build(self, index: int, length: int, **kwargs: Any) -> Prompt:
        if kwargs.get("namespace") == self.namespace and self.killed is None:
            self.killed = _server_pid(self.strategy)
            os.kill(self.killed, signal.SIGKILL)
            deadline = time.monotonic() + _KILL_WAIT_S
            # Dead for the runner once waitpid reports it.  Its /proc state reads "Z" earlier, as soon
            # as the main thread exited while other threads still tear down, and waitpid (the runner's
            # Popen.poll) reports nothing until the last one did; WNOWAIT leaves it for that poll.
            while os.waitid(os.P_PID, self.killed, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                assert time.monotonic() < deadline, "the killed server did not exit"
                time.sleep(0.05)
        return super().build(index, length, **kwargs)


def test_a_server_dying_mid_run_reports_the_completed_repeats(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    options = ComparisonOptions(
        model_dir=str(tiny_llama_dir),
        workloads=[WorkloadConfig(name="long_first", long_count=1, long_len=32, short_count=1, short_len=8,
                                  output_len=2)],
        out_dir=str(out),
        strategies=["default", "hrrn"],
        repeats=2,
        warmup=0,
        kv_tokens=4096,
        settle_s=0.0,
    )
    # Repeat 0 visits default then hrrn; repeat 1 starts with hrrn, whose server dies there.
    builder = KillingPromptBuilder(load_tokenizer(str(tiny_llama_dir)), "long_first-repeat-1", "hrrn")
    with pytest.raises(ServerLostError) as info:
        run_comparison(options, NormalTopology(start_timeout_s=300), builder)
    message = str(info.value)
    assert builder.killed is not None
    assert "the hrrn server stopped running (during long_first-repeat-1)" in message
    assert f"the report in {out} covers the repeats completed before that (long_first: 1 of 2)" in message
    assert "\n" not in message

    report = json.loads((out / "report.json").read_text())
    section = report["workloads"]["long_first"]
    assert section["visit_orders"] == [["default", "hrrn"]]
    assert [len(section["runs"][s]) for s in ("default", "hrrn")] == [1, 1]
    assert section["changes"]["hrrn"]["output_throughput"]["pairs"] == 1
    assert "hrrn server stopped running" in report["meta"]["stopped_early"]
    assert "**Stopped early** after 1 complete repeat(s)" in (out / "report.md").read_text()
    assert (out / "runs" / "long_first" / "hrrn" / "repeat0.jsonl").exists()
    for strategy, server in report["meta"]["servers"].items():
        assert session_alive(server["pid"]) == [], f"processes of the {strategy} server survived"
