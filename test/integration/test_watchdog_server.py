"""A child process that stops making progress without dying is caught by ``--watchdog_timeout``.

Before the watchdog a model rank stopped with SIGSTOP (as a rank stuck in a kernel or in a
collective that never returns) left ``/health`` at 200 and every request waiting forever.  Now,
once the rank made no progress for the timeout, every client gets 503 ``server_failed`` (an error
event for a stream under way) naming the process, the server stops its children (SIGKILL ends a
stopped one), removes its shared memory and exits with code 1.

The timeout is the smallest the flag takes (15 s), so each test waits about that long; bounds are
generous, timings decide nothing else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Dict, List

import httpx

from failure_clients import ClientResult, alive, child_pids, leftovers, payload, run_client, wait_all_ended
from server_process import ServerHandle, start_server

WATCHDOG_SECONDS = 15
# After the timeout: the watcher's round, the hand-over to the event loop, a loaded machine.
DETECTION_SLACK_SECONDS = 15.0
# The exit after the errors: the children's stop (SIGUSR1, SIGKILL after 2 s) and uvicorn's 1 s.
EXIT_BOUND_SECONDS = 10.0


def _kill_stopped_leftovers(pids: Dict[str, int]) -> None:
    """SIGKILL any child still there (a stopped one never exits on its own)."""
    for pid in pids.values():
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wait_exit(server: ServerHandle, timeout: float):
    try:
        return server.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _health_after_failure(url: str) -> str:
    """What /health says once the clients had their errors: 503, or the port already closed."""
    try:
        return str(httpx.get(f"{url}/health", timeout=5).status_code)
    except httpx.HTTPError:
        return "closed"


def _assert_failed_naming(results: List[ClientResult], victim: str) -> None:
    for result in results:
        assert result.ended_at is not None, f"{result.path} still waiting"
        assert result.transport_error is None, result.transport_error
        error = result.error()
        assert error is not None, (result.path, result.status, result.body, result.events[-1:])
        assert error["code"] == "server_failed", error
        assert victim in error["message"] and "made no progress" in error["message"], error
        assert "length" not in result.finish_reasons()


def test_a_stopped_model_rank_fails_every_request_and_stops_the_server(tiny_llama_dir, tmp_path):
    server = start_server(tiny_llama_dir, tmp_path, ["--max_total_token_num", "8192", "--running_max_req_size", "4",
                                                     "--watchdog_timeout", str(WATCHDOG_SECONDS)])
    pids: Dict[str, int] = {}
    try:
        pids = child_pids(server.log())
        model = server.model_name
        streams = [
            run_client(server.url, "/v1/completions", payload("/v1/completions", model), stream=True),
            run_client(server.url, "/generate_stream", payload("/generate_stream", model), stream=True),
        ]
        for result in streams:
            assert result.first_event.wait(30)
            assert result.status == 200 and result.events, (result.status, result.body, result.transport_error)
        plain = [run_client(server.url, "/generate", payload("/generate", model), stream=False)]
        time.sleep(0.5)
        assert all(r.ended_at is None for r in streams + plain), "a request ended before the stop"

        stopped_at = time.monotonic()
        os.kill(pids["model_rank0"], signal.SIGSTOP)
        wait_all_ended(streams + plain, WATCHDOG_SECONDS + DETECTION_SLACK_SECONDS)
        health = _health_after_failure(server.url)
        code = _wait_exit(server, EXIT_BOUND_SECONDS)
    finally:
        _kill_stopped_leftovers(pids)
        server.stop(signal.SIGKILL)

    _assert_failed_naming(streams + plain, "model_rank0")
    for result in streams:  # the status line was sent: the error is an event, then the stream ends
        assert result.status == 200
        assert result.done_sentinel == result.path.startswith("/v1/")
    assert plain[0].status == 503, plain[0].body
    # The watchdog waited for its timeout (the rank's last beat came just before the stop).
    assert min(r.ended_at for r in streams + plain) - stopped_at >= WATCHDOG_SECONDS - 1
    assert health in ("503", "closed"), health
    assert code == 1, f"exit code {code}"
    assert "child process model_rank0 made no progress for" in server.log()
    assert f"(--watchdog_timeout {WATCHDOG_SECONDS}); failing every request and shutting down" in server.log()
    assert not leftovers(server.proc.pid)
    assert not [name for name, pid in pids.items() if alive(pid)]


def test_an_idle_tp_server_outlives_the_timeout_and_a_stopped_rank1_is_caught(tiny_llama_dir, tmp_path):
    server = start_server(tiny_llama_dir, tmp_path, ["--tp", "2", "--max_total_token_num", "4096",
                                                     "--watchdog_timeout", str(WATCHDOG_SECONDS)])
    pids: Dict[str, int] = {}
    try:
        pids = child_pids(server.log())
        # Idle for longer than the timeout: rank 1 hears from rank 0 only at each 5 s keep-alive,
        # the other processes wake every second; none of them may be taken for hung.
        time.sleep(WATCHDOG_SECONDS + 3)
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        assert "made no progress" not in server.log()

        os.kill(pids["model_rank1"], signal.SIGSTOP)
        # Rank 0 runs the request's forward and waits in its collective for rank 1.
        stream = run_client(server.url, "/v1/completions", payload("/v1/completions", server.model_name, 8),
                            stream=True)
        wait_all_ended([stream], WATCHDOG_SECONDS + DETECTION_SLACK_SECONDS)
        code = _wait_exit(server, EXIT_BOUND_SECONDS)
    finally:
        _kill_stopped_leftovers(pids)
        server.stop(signal.SIGKILL)

    _assert_failed_naming([stream], "model_rank1")
    assert code == 1, f"exit code {code}"
    line = next(line for line in server.log().splitlines() if "made no progress" in line)
    assert "model_rank1" in line and "failing every request and shutting down" in line, line
    assert not leftovers(server.proc.pid)
    assert not [name for name, pid in pids.items() if alive(pid)]
