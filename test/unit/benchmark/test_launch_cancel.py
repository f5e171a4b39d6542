"""Interrupted and cancelled server launches leave no process behind; readiness is the server's own.

The servers here are real processes: a small script that takes ``--host``/``--port`` like the
API server, starts a child that never exits on its own (as a server starts its model
processes), optionally sleeps before it listens, then answers ``/health`` with 200.  Where the
real API server's behaviour matters (it refuses a port that is taken) the real one runs.
"""

from __future__ import annotations

import http.server
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from lightllm.benchmark.launch_guard import LaunchCancelled, LaunchGuard
from lightllm.benchmark.pd_cluster import PdTopology
from lightllm.benchmark.deployment import ServerSpec, stop_servers_on_sigterm
from lightllm.benchmark.server_launcher import Topology, launch_all
from lightllm.benchmark.server_process import ServerProcess, ServerStartError
from lightllm.benchmark.server_session import session_alive, session_listens_on

_SCRIPT = '''
import argparse, http.server, os, subprocess, sys, time
parser = argparse.ArgumentParser()
parser.add_argument("--host")
parser.add_argument("--port", type=int)
parser.add_argument("--delay", type=float, default=0.0)
args = parser.parse_args()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
print(f"server {os.getpid()} child {child.pid}", flush=True)
time.sleep(args.delay)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *_args):
        pass

http.server.HTTPServer((args.host, args.port), Health).serve_forever()
'''
_SPAWN_WAIT_S = 120.0  # bound on waiting for the scripts to start; never reached when all is well


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "script_server.py"
    path.write_text(_SCRIPT)
    return path


class ScriptTopology(Topology):
    """One script server per spec; it listens only after ``delay`` seconds."""

    name = "script"

    def __init__(self, script: Path, delay: float) -> None:
        self.script = script
        self.delay = delay

    def launch(self, spec: ServerSpec, log_dir: Path, guard: LaunchGuard | None = None) -> ServerProcess:
        return ServerProcess.start(["--delay", str(self.delay)], Path(log_dir) / f"{spec.strategy}.log",
                                   start_timeout_s=600, guard=guard, program=[sys.executable, str(self.script)])


def _spawned(log_dir: Path) -> list[tuple[int, int]]:
    """(server pid, child pid) of every script server that got as far as starting its child."""
    found = []
    for log in sorted(log_dir.glob("*.log")):
        match = re.search(r"server (\d+) child (\d+)", log.read_text(errors="replace"))
        if match:
            found.append((int(match.group(1)), int(match.group(2))))
    return found


def _wait_for_spawned(log_dir: Path, count: int) -> list[tuple[int, int]]:
    deadline = time.monotonic() + _SPAWN_WAIT_S
    while len(found := _spawned(log_dir)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _interrupt_main_once_spawned(log_dir: Path, count: int, signum: int, seen: list) -> threading.Thread:
    """Signal the main thread as soon as ``count`` servers started their children (mid start-up)."""

    def run() -> None:
        seen.extend(_wait_for_spawned(log_dir, count))
        signal.pthread_kill(threading.main_thread().ident, signum)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _assert_all_gone(spawned: list[tuple[int, int]]) -> None:
    for server, _child in spawned:
        # The server's pid is its session id: the session must be empty, its child included.
        left = session_alive(server)
        assert left == [], f"processes of server {server} survived: {left}"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
def test_a_signal_during_launch_all_stops_every_spawned_server(tmp_path, script, signum, parallel):
    specs = [ServerSpec("/m", s) for s in ("default", "promote_shortest", "hrrn")]
    # Parallel: every server is starting when the signal lands; sequential: the first one is.
    expected = 3 if parallel else 1
    previous = signal.getsignal(signal.SIGTERM)
    seen: list[tuple[int, int]] = []
    try:
        stop_servers_on_sigterm()  # what compare_strategies does: SIGTERM raises SystemExit(143)
        thread = _interrupt_main_once_spawned(tmp_path, expected, signum, seen)
        with pytest.raises(KeyboardInterrupt if signum == signal.SIGINT else SystemExit):
            launch_all(ScriptTopology(script, delay=3600), specs, tmp_path, parallel=parallel)
        thread.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(seen) == expected
    _assert_all_gone(_spawned(tmp_path))


def test_cancelling_a_guard_from_another_thread_stops_a_start_in_progress(tmp_path, script):
    guard = LaunchGuard()
    outcome: list[BaseException] = []

    def start() -> None:
        try:
            ServerProcess.start(["--delay", "3600"], tmp_path / "one.log", start_timeout_s=600, guard=guard,
                                program=[sys.executable, str(script)])
        except BaseException as exc:  # noqa: BLE001 - the test inspects what the start raised
            outcome.append(exc)

    thread = threading.Thread(target=start)
    thread.start()
    spawned = _wait_for_spawned(tmp_path, 1)
    guard.cancel()
    thread.join()
    assert len(spawned) == 1 and len(outcome) == 1 and isinstance(outcome[0], LaunchCancelled)
    _assert_all_gone(spawned)
    # Nothing is spawned for a launch that is already cancelled, by either topology.
    with pytest.raises(LaunchCancelled):
        ScriptTopology(script, delay=0).launch(ServerSpec("/m", "late"), tmp_path / "late", guard=guard)
    with pytest.raises(LaunchCancelled):
        PdTopology(start_timeout_s=30).launch(ServerSpec("/m", "pd"), tmp_path / "pd", guard=guard)
    assert not (tmp_path / "late").exists() and not (tmp_path / "pd").exists()


def test_stop_also_ends_the_children_of_a_server_that_died_without_stopping_them(tmp_path, script):
    server = ServerProcess.start(["--delay", "0"], tmp_path / "server.log", start_timeout_s=120,
                                 program=[sys.executable, str(script)])
    [(leader, child)] = _spawned(tmp_path)
    assert leader == server.pid and child in session_alive(leader)
    # The script has no SIGTERM handling, as a server still importing: SIGTERM ends it alone.
    server.stop()
    assert session_alive(leader) == []


class _Foreign(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"another server")

    def log_message(self, *_args: object) -> None:
        pass


def test_a_health_answer_from_another_server_on_the_port_is_not_ready(tiny_llama_dir, tmp_path):
    foreign = http.server.HTTPServer(("127.0.0.1", 0), _Foreign)
    port = foreign.server_address[1]
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    try:
        assert session_listens_on(os.getsid(0), port) is True  # the foreign server is this test's
        # The API server binds its port first thing and exits (code 3) when it is taken; start()
        # must wait for that instead of trusting the foreign /health answer.
        with pytest.raises(ServerStartError, match="Address already in use"):
            ServerProcess.start(["--model_dir", str(tiny_llama_dir)], tmp_path / "server.log", port=port,
                                start_timeout_s=300)
    finally:
        foreign.shutdown()
        foreign.server_close()


def test_session_listens_on_tells_whose_socket_listens():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert session_listens_on(os.getsid(0), port) is False  # bound, not listening yet
        sock.listen()
        assert session_listens_on(os.getsid(0), port) is True
        assert session_listens_on(os.getsid(0) + 1_000_000, port) is False
