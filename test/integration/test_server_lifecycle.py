"""Start-up, tensor parallelism, supervision and clean shutdown of the real server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from server_process import start_server


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def _wait_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    """Pids still alive after waiting up to ``timeout`` seconds (children exit asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _shm_segments(pid: int) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"lightllm_{pid}_*")]


def _greedy(url: str, prompts: list[str]) -> list[str]:
    out = []
    for prompt in prompts:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "do_sample": False, "ignore_eos": True}}
        resp = httpx.post(f"{url}/generate", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        out.append(resp.json()["generated_text"][0])
    return out


def test_tp2_equals_tp1_and_shutdown_cleans_up(tiny_llama_dir, tmp_path):
    prompts = ["alpha beta gamma", "def main():", "x"]
    tp1 = start_server(tiny_llama_dir, tmp_path, ["--max_total_token_num", "4096"])
    try:
        expected = _greedy(tp1.url, prompts)
    finally:
        tp1.stop()
    tp2 = start_server(tiny_llama_dir, tmp_path, ["--tp", "2", "--max_total_token_num", "4096"])
    children = _children(tp2.proc.pid)
    assert len(children) >= 4  # detokenization, router, two model ranks
    assert _shm_segments(tp2.proc.pid)
    try:
        assert _greedy(tp2.url, prompts) == expected
    finally:
        code = tp2.stop(signal.SIGINT)
    assert code == 0
    assert not _wait_gone(children)
    assert not _shm_segments(tp2.proc.pid)


def test_dead_child_stops_the_server_with_a_clear_message(tiny_llama_dir, tmp_path):
    server = start_server(tiny_llama_dir, tmp_path, ["--max_total_token_num", "4096"])
    children = _children(server.proc.pid)
    try:
        victim = children[-1]
        os.kill(victim, signal.SIGKILL)
        server.proc.wait(60)
    finally:
        server.stop()
    assert server.proc.returncode != 0
    assert "exited unexpectedly" in server.log()
    assert not _wait_gone(children)
    assert not _shm_segments(server.proc.pid)


def test_impossible_flags_fail_with_one_line(tiny_llama_dir):
    cases = [
        (["--chunked_prefill_size", "4096", "--batch_max_tokens", "1024"], "cannot exceed --batch_max_tokens"),
        (["--prefill_queue_strategy", "sjf"], "invalid choice: 'sjf'"),
        (["--tp", "3"], "--tp 3 must divide"),
        (["--max_total_token_num", "10"], "fewer than one request may need"),
    ]
    for args, message in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", str(tiny_llama_dir), *args],
            capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode != 0
        assert message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
