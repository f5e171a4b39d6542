"""scripts/start_1p1d.sh starts a real 1P1D cluster on the tiny model, reports a killed node and stops all of it on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx

from lightllm.utils.free_ports import free_port
from script_process_support import stop_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "start_1p1d.sh"
READY_TIMEOUT_S = 240


def _gone(pid: int) -> bool:
    proc = Path(f"/proc/{pid}")
    try:
        return not proc.exists() or "zombie" in (proc / "status").read_text()
    except OSError:
        return True


def test_script_starts_serves_and_stops_the_cluster(tiny_llama_dir, tmp_path):
    master, prefill, decode = free_port(), free_port(), free_port()
    log_dir = tmp_path / "logs"
    out_path = tmp_path / "script.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            ["bash", str(SCRIPT), "--model_dir", str(tiny_llama_dir), "--log_dir", str(log_dir),
             "--master_port", str(master), "--prefill_port", str(prefill), "--decode_port", str(decode),
             "--start_timeout", str(READY_TIMEOUT_S), "--stop_timeout", "30",
             "--node_args", "--max_total_token_num 4096", "--", "--prefill_queue_strategy", "hrrn"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S + 30
        while "cluster ready" not in out_path.read_text():
            assert proc.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.5)
        text = out_path.read_text()
        pids += [int(p) for p in re.search(
            r"master \(pid (\d+)\), prefill node \(pid (\d+)\), decode node \(pid (\d+)\)", text).groups()]
        assert f"http://127.0.0.1:{master}" in text
        with httpx.Client(trust_env=False, timeout=10) as client:
            assert client.get(f"http://127.0.0.1:{master}/health").status_code == 200
            nodes = client.get(f"http://127.0.0.1:{master}/pd/nodes").text
            assert f"127.0.0.1:{prefill}" in nodes and f"127.0.0.1:{decode}" in nodes
        assert "prefill_queue_strategy=hrrn" in (log_dir / "prefill.log").read_text()

        # A node killed under the script is reported by the script's own warning only: bash's job
        # notice ("line N: PID Killed ...") used to be printed beside it.
        os.killpg(pids[2], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while "the decode node exited" not in out_path.read_text():
            assert time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.2)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, out_path.read_text()
        text = out_path.read_text()
        assert "stopped; logs in" in text
        assert "Killed" not in text, text
        assert all(_gone(pid) for pid in pids), text
    finally:
        stop_script(proc, 90)
        # Each server runs in a session of its own (its pid is the group id).
        for pid in pids:
            if not _gone(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_the_start_timeout_waits_at_least_the_seconds_given(tmp_path):
    """--start_timeout 2 waits 2 s or more, wherever in the clock's second the script starts.

    Its deadline used bash's $SECONDS, which counts the clock's whole seconds: started late in a
    second, the script gave up after as little as 1 s (a tester saw 1.86 s). The processes here
    never answer (a stand-in python that sleeps), so the script must give up, after the full wait.
    """
    timeout_s = 2
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\nexec sleep 60\n")
    fake_python.chmod(0o755)
    out_path = tmp_path / "script.out"
    # Start late in a second of the clock: the old deadline then came due about 1.2 s later.
    while time.time() % 1 < 0.75 or time.time() % 1 > 0.8:
        time.sleep(0.005)
    with open(out_path, "w") as out:
        started = time.monotonic()
        proc = subprocess.Popen(
            ["bash", str(SCRIPT), "--model_dir", str(tmp_path), "--log_dir", str(tmp_path / "logs"),
             "--master_port", str(free_port()), "--prefill_port", str(free_port()), "--decode_port", str(free_port()),
             "--start_timeout", str(timeout_s), "--stop_timeout", "5"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "PYTHON": str(fake_python)},
        )
    try:
        gave_up = None
        while proc.poll() is None or gave_up is None:
            if gave_up is None and "did not answer 200" in out_path.read_text():
                gave_up = time.monotonic() - started
            assert time.monotonic() - started < 60, out_path.read_text()
            time.sleep(0.01)
        text = out_path.read_text()
        assert proc.returncode == 1, text
        assert f"did not answer 200 within {timeout_s}s" in text
        assert gave_up >= timeout_s, f"gave up after {gave_up:.2f}s with --start_timeout {timeout_s}"
        pids = [int(p) for p in re.search(
            r"master \(pid (\d+)\), prefill node \(pid (\d+)\), decode node \(pid (\d+)\)", text).groups()]
        assert all(_gone(pid) for pid in pids), text
    finally:
        stop_script(proc, 30)
