"""Server specs, topology registry, and the launcher's start-up failure path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lightllm.benchmark.launch_guard import LaunchGuard
from lightllm.benchmark.deployment import Deployment, ServerSpec
from lightllm.benchmark.server_launcher import NormalTopology, Topology, launch_all
from lightllm.benchmark.server_process import ServerProcess, ServerStartError, startup_error_line
from lightllm.benchmark.topologies import make_topology


def test_spec_builds_identical_flags_apart_from_the_strategy():
    extra = ("--chunked_prefill_size", "256", "--max_total_token_num=4096")
    a = ServerSpec("/m", "default", extra).server_args()
    b = ServerSpec("/m", "hrrn", list(extra)).server_args()
    assert a == ["--model_dir", "/m", "--prefill_queue_strategy", "default", *extra]
    assert [x for x in a if x != "default"] == [x for x in b if x != "hrrn"]


def test_spec_has_flag_understands_both_spellings():
    spec = ServerSpec("/m", "default", ("--max_total_token_num=4096", "--batch_max_tokens", "32"))
    assert spec.has_flag("--max_total_token_num")
    assert spec.has_flag("--batch_max_tokens")
    assert not spec.has_flag("--batch_max")


@pytest.mark.parametrize("flag", ["--port", "--prefill_queue_strategy", "--model_dir", "--host=0.0.0.0"])
def test_spec_rejects_flags_the_launcher_owns(flag):
    with pytest.raises(ValueError, match="extra_args must not set"):
        ServerSpec("/m", "default", (flag, "1"))


def test_spec_rejects_empty_fields():
    with pytest.raises(ValueError, match="model_dir"):
        ServerSpec("", "default")
    with pytest.raises(ValueError, match="strategy"):
        ServerSpec("/m", "")


def test_topology_registry():
    topology = make_topology("normal", start_timeout_s=5)
    assert isinstance(topology, NormalTopology)
    assert topology.describe() == {"name": "normal", "host": "127.0.0.1", "start_timeout_s": 5}
    with pytest.raises(ValueError, match="topology must be one of"):
        make_topology("3p3d")
    with pytest.raises(ValueError, match="start_timeout_s"):
        NormalTopology(start_timeout_s=0)


def test_a_server_that_cannot_start_raises_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    with pytest.raises(ServerStartError, match="server refused to start") as info:
        ServerProcess.start(["--model_dir", str(tmp_path / "missing")], log, start_timeout_s=60)
    # The server's own one-line refusal, not its whole log.
    assert str(log) in str(info.value) and "error: --model_dir " in str(info.value) and "no such directory" in str(info.value)
    assert "\n" not in str(info.value)
    assert log.stat().st_size > 0
    assert startup_error_line("INFO starting\nusage: x\nprog: error: unrecognized arguments: --x\n") == (
        "prog: error: unrecognized arguments: --x")
    assert startup_error_line("INFO starting\nTraceback (most recent call last):\n") is None


class _FakeDeployment(Deployment):
    """Stands in for a server so launch_all's all-or-none behaviour can be checked without processes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stopped = False

    @property
    def base_url(self) -> str:
        return f"http://{self.name}"

    @property
    def log_paths(self) -> list[Path]:
        return []

    def is_alive(self) -> bool:
        return not self.stopped

    def stop(self, timeout_s: float = 60.0) -> None:
        self.stopped = True


class _FakeTopology(Topology):
    name = "fake"

    def __init__(self, failing: set[str]) -> None:
        self.failing = failing
        self.launched: list[_FakeDeployment] = []
        self.lock = threading.Lock()

    def launch(self, spec: ServerSpec, log_dir: Path, guard: LaunchGuard | None = None) -> Deployment:
        if spec.strategy in self.failing:
            raise RuntimeError(f"{spec.strategy} failed")
        deployment = _FakeDeployment(spec.strategy)
        with self.lock:
            self.launched.append(deployment)
        return deployment


@pytest.mark.parametrize("parallel", [True, False])
def test_launch_all_returns_deployments_in_spec_order(parallel, tmp_path):
    specs = [ServerSpec("/m", s) for s in ("default", "promote_shortest", "hrrn")]
    deployments = launch_all(_FakeTopology(set()), specs, tmp_path, parallel=parallel)
    assert [d.base_url for d in deployments] == ["http://default", "http://promote_shortest", "http://hrrn"]
    assert all(d.is_alive() for d in deployments)


@pytest.mark.parametrize("parallel", [True, False])
def test_launch_all_stops_the_started_ones_when_one_fails(parallel, tmp_path):
    topology = _FakeTopology({"promote_shortest"})
    specs = [ServerSpec("/m", s) for s in ("default", "promote_shortest", "hrrn")]
    with pytest.raises(RuntimeError, match="promote_shortest failed"):
        launch_all(topology, specs, tmp_path, parallel=parallel)
    assert topology.launched and all(d.stopped for d in topology.launched)
    if not parallel:
        assert [d.name for d in topology.launched] == ["default"]  # nothing starts after a failure


def test_launch_all_needs_specs(tmp_path):
    with pytest.raises(ValueError, match="specs"):
        launch_all(_FakeTopology(set()), [], tmp_path)


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_terminated_comparison_stops_the_servers_it_started(tiny_llama_dir, tmp_path):
    # timeout, a CI cancel or kill send SIGTERM: the servers must not outlive the benchmark.
    command = [sys.executable, "-m", "lightllm.benchmark.compare_strategies", "--model_dir", str(tiny_llama_dir),
               "--workload", "sustained", "--duration", "600", "--request-rate", "1", "--long-len", "64",
               "--short-len", "16", "--output-len", "2", "--strategies", "default", "--repeats", "1", "--warmup", "0",
               "--kv-tokens", "4096", "--out-dir", str(tmp_path / "out")]
    bench = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        servers: list[int] = []
        while not servers:
            assert bench.poll() is None and time.monotonic() < deadline, "no server started"
            servers = _children(bench.pid)
            time.sleep(0.2)
        time.sleep(2)  # inside the measured run (or still starting: either way inside the with block)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(120) == 128 + signal.SIGTERM
        assert not any(_alive(pid) for pid in servers), "a server outlived the terminated benchmark"
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait(10)
