"""scripts/start_1p1d.sh starts a real 1P1D cluster on the tiny model and stops all of it on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx

from lightllm.utils.process_utils import free_port

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

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, out_path.read_text()
        assert "stopped; logs in" in out_path.read_text()
        assert all(_gone(pid) for pid in pids), out_path.read_text()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        # Each server runs in a session of its own (its pid is the group id).
        for pid in pids:
            if not _gone(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
