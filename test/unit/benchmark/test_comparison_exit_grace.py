"""A compared server whose connection failed gets a short while to show its exit.

SIGKILL closes a server's sockets before waitpid can report the process (its threads still tear
down), so the runner, seeing the connection fail, waits briefly for the exit: the message then says
the server stopped running and names its logs, rather than "stopped answering".  The deployment here
is a stand-in whose exit shows a moment after the connection failed; the runner is the real one.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from lightllm.benchmark import comparison_runner
from lightllm.benchmark.comparison_options import ComparisonOptions
from lightllm.benchmark.comparison_runner import ComparisonRunner, ServerLostError
from lightllm.benchmark.deployment import Deployment
from lightllm.benchmark.workloads import WorkloadConfig


class _ExitShowingLate(Deployment):
    """Alive until ``exit_after_s`` after :meth:`fail` (None: never exits)."""

    def __init__(self, exit_after_s: float | None) -> None:
        self.exit_after_s = exit_after_s
        self.failed_at: float | None = None

    @property
    def base_url(self) -> str:
        return "http://127.0.0.1:9"

    @property
    def log_paths(self) -> list[Path]:
        return [Path("/tmp/hrrn.log")]

    def fail(self) -> None:
        self.failed_at = time.monotonic()

    def is_alive(self) -> bool:
        if self.failed_at is None or self.exit_after_s is None:
            return True
        return time.monotonic() - self.failed_at < self.exit_after_s

    def stop(self, timeout_s: float = 60.0) -> None:
        pass


@pytest.mark.parametrize("exit_after_s, says", [
    (0.3, "the hrrn server stopped running (during w-repeat-0); see /tmp/hrrn.log"),
    (None, "the hrrn server at http://127.0.0.1:9 stopped answering (during w-repeat-0): ReadError: reset"),
])
def test_a_failed_connection_waits_briefly_for_the_servers_exit(monkeypatch, tmp_path, exit_after_s, says) -> None:
    deployment = _ExitShowingLate(exit_after_s)

    async def connection_reset(config, builder):
        deployment.fail()
        raise httpx.ReadError("reset")

    monkeypatch.setattr(comparison_runner, "run_benchmark", connection_reset)
    workload = WorkloadConfig(name="w", long_count=1, long_len=32, short_count=1, short_len=8, output_len=2)
    options = ComparisonOptions(model_dir=str(tmp_path), workloads=[workload], out_dir=str(tmp_path / "out"),
                                strategies=["hrrn"], repeats=1, warmup=0, settle_s=0.0)
    runner = ComparisonRunner(options, {"hrrn": deployment}, builder=None)
    with pytest.raises(ServerLostError) as lost:
        runner._run("hrrn", workload, "w-repeat-0")
    assert says in str(lost.value)
