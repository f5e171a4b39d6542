"""A real server whose HTTP front door thread dies exits non-zero within bounds, saying why.

Before, the port stayed open, every request (``/health`` included) waited forever and the
process never exited; the log had only the thread's traceback.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from failure_clients import leftovers
from front_door_killer import KILL_MARK
from lightllm.utils.free_ports import free_port

RUNNER = Path(__file__).with_name("front_door_killer.py")
START_TIMEOUT_SECONDS = 180
EXIT_BOUND_SECONDS = 5.0  # as for a dead child (docs/EN/failure_handling.md)


def test_a_dead_front_door_thread_stops_the_server_with_exit_code_1(tiny_llama_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, str(RUNNER), "--model_dir", str(tiny_llama_dir), "--port", str(port)],
                                stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                cwd=str(RUNNER.parent))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET " + KILL_MARK + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        killed_at = time.monotonic()
        code = proc.wait(timeout=EXIT_BOUND_SECONDS + 5)
        exited_after = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = log_path.read_text()
    assert code == 1, log
    assert exited_after < EXIT_BOUND_SECONDS, (exited_after, log)
    failures = [line for line in log.splitlines() if "front door thread failed" in line]
    assert len(failures) == 1 and "(OverflowError: timeout is too large)" in failures[0], log
    assert "Traceback" not in log, log
    assert leftovers(proc.pid) == []
