"""Starting a real server process on loopback for integration tests."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import httpx

from lightllm.utils.free_ports import free_port

START_TIMEOUT_SECONDS = 180


@dataclass
class ServerHandle:
    """A running server: its URL, process and log."""

    url: str
    proc: subprocess.Popen
    log_path: Path
    model_name: str

    def log(self) -> str:
        """Everything the server printed so far."""
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str) -> float:
        """Current value of an unlabelled-or-single-series Prometheus metric."""
        body = httpx.get(f"{self.url}/metrics", timeout=10).text
        match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", body, re.MULTILINE)
        if match is None:
            raise KeyError(f"metric {name} not found")
        return float(match.group(1))

    def wait_idle(self, timeout: float = 60) -> None:
        """Wait until no request is waiting or running (polling, bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.metric("lightllm_running_requests") == 0 and self.metric("lightllm_waiting_requests") == 0:
                return
            time.sleep(0.2)
        raise TimeoutError("server did not become idle")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Send ``sig`` and wait for exit; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(
    model_dir: Path, log_dir: Path, extra_args: Optional[List[str]] = None, *, own_process_group: bool = False
) -> ServerHandle:
    """Start ``python -m lightllm.server.api_server`` and wait until /health answers.

    ``own_process_group``: the server leads a process group of its own (as under systemd or a
    terminal), so a test can signal the whole group with ``os.killpg(proc.pid, sig)``.
    """
    port = free_port()
    log_path = log_dir / f"server_{port}.log"
    cmd = [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", str(model_dir), "--port", str(port)]
    cmd += list(extra_args or [])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                start_new_session=own_process_group)
    handle = ServerHandle(f"http://127.0.0.1:{port}", proc, log_path, Path(model_dir).name)
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during start-up:\n{handle.log()}")
        try:
            if httpx.get(f"{handle.url}/health", timeout=2).status_code == 200:
                return handle
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    handle.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not become healthy in {START_TIMEOUT_SECONDS}s:\n{handle.log()}")


def stream_token_ids(url: str, prompt: str, max_new_tokens: int, timeout: float = 120) -> list[int]:
    """Token ids of a greedy ``/generate_stream`` answer to ``prompt`` (EOS ignored)."""
    ids = []
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "do_sample": False, "ignore_eos": True}}
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=timeout) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data:"):
                ids.append(json.loads(line[5:])["token"]["id"])
    return ids
