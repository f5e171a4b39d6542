"""kill -9 of each child process mid-stream: every client gets an error within 2 s and the
server exits non-zero within 5 s, leaving no shared memory or IPC folder behind (issue 14)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

from failure_clients import ClientResult, alive, child_pids, leftovers, payload, run_client, wait_all_ended
from server_process import start_server

ERROR_BOUND_SECONDS = 2.0
EXIT_BOUND_SECONDS = 5.0


@pytest.mark.parametrize("victim", ["detokenization", "router", "model_rank0"])
def test_killed_child_fails_every_request_and_stops_the_server(tiny_llama_dir, tmp_path, victim):
    # Three streams and one non-streaming request run; two more wait in the router's queue.
    server = start_server(tiny_llama_dir, tmp_path, ["--max_total_token_num", "8192", "--running_max_req_size", "4"])
    try:
        pids = child_pids(server.log())
        assert {"detokenization", "router", "model_rank0"} <= set(pids)
        model = server.model_name
        streams = [
            run_client(server.url, "/v1/completions", payload("/v1/completions", model), stream=True),
            run_client(server.url, "/generate_stream", payload("/generate_stream", model), stream=True),
            run_client(server.url, "/v1/completions", payload("/v1/completions", model), stream=True),
        ]
        for result in streams:
            assert result.first_event.wait(30)
            assert result.status == 200 and result.events, (result.status, result.body, result.transport_error)
        plain = [run_client(server.url, path, payload(path, model), stream=False)
                 for path in ("/generate", "/v1/completions", "/generate")]
        time.sleep(0.5)
        assert all(r.ended_at is None for r in streams + plain), "a request ended before the kill"

        killed_at = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        late: list[int] = []
        while server.proc.poll() is None and time.monotonic() - killed_at < ERROR_BOUND_SECONDS:
            try:
                late.append(httpx.post(f"{server.url}/generate", json=payload("/generate", model, 4), timeout=5).status_code)
            except httpx.HTTPError:
                break
        wait_all_ended(streams + plain, ERROR_BOUND_SECONDS + 1)
        try:
            code = server.proc.wait(timeout=max(0.1, EXIT_BOUND_SECONDS - (time.monotonic() - killed_at)))
        except subprocess.TimeoutExpired:
            code = None
        exited_after = time.monotonic() - killed_at
    finally:
        server.stop(signal.SIGKILL)

    for result in streams + plain:
        assert result.ended_at is not None, f"{result.path} still waiting"
        assert result.ended_at - killed_at <= ERROR_BOUND_SECONDS, (result.path, result.ended_at - killed_at)
        assert result.transport_error is None, result.transport_error
        error = result.error()
        assert error is not None, (result.path, result.status, result.body, result.events[-1:])
        assert error["code"] == "server_failed" and victim in error["message"], error
        assert "length" not in result.finish_reasons()
    for result in streams:  # the status line was sent: the error is an event, then the stream ends
        assert result.status == 200
        assert result.done_sentinel == result.path.startswith("/v1/")
    for result in plain:
        assert result.status == 503, result.body
    assert all(status == 503 for status in late), late

    assert code is not None and code != 0, f"server still running {exited_after:.1f}s after the kill"
    assert exited_after <= EXIT_BOUND_SECONDS
    assert f"{victim} exited unexpectedly" in server.log()
    assert not leftovers(server.proc.pid)
    assert not [name for name, pid in pids.items() if alive(pid)]
