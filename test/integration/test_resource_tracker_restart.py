"""A killed resource tracker is replaced: the server's segments are still removed if it is then
killed, and a normal shutdown prints no traceback for segments the new tracker never saw."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Optional

from failure_clients import alive, leftovers
from server_process import start_server

RESTART_LINE = "multiprocessing's resource tracker (pid"


def _tracker_pid(launcher_pid: int) -> Optional[int]:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError):
            continue
        if int(stat[1]) == launcher_pid and b"resource_tracker" in cmdline and stat[0] != "Z":
            return int(entry.name)
    return None


def _kill_tracker_and_wait_for_its_replacement(server) -> int:
    old = _tracker_pid(server.proc.pid)
    assert old is not None, "the launcher's resource tracker was not found"
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 15
    new = None
    while time.monotonic() < deadline:
        new = _tracker_pid(server.proc.pid)
        if RESTART_LINE in server.log() and new not in (None, old):
            break
        time.sleep(0.1)
    assert RESTART_LINE in server.log(), server.log()[-3000:]
    assert new not in (None, old)
    return new


def test_a_replaced_tracker_still_removes_the_segments_of_a_killed_server(tiny_llama_dir, tmp_path):
    server = start_server(tiny_llama_dir, tmp_path, ["--max_total_token_num", "4096"])
    try:
        tracker = _kill_tracker_and_wait_for_its_replacement(server)
        # _req, _req_top, _stats and the watchdog's _beat (--watchdog_timeout is on by default).
        assert "registering the server's 4 shared-memory segment(s)" in server.log()
        server.proc.kill()
        server.proc.wait(30)
        # The tracker cleans up once every child holding its pipe has noticed the launcher's death
        # and exited: seconds alone, more under the full suite on two cores (15 s fell short once).
        # The deadline only bounds a hang.
        deadline = time.monotonic() + 60
        while (alive(tracker) or [p for p in leftovers(server.proc.pid) if "/dev/shm/" in p]) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in leftovers(server.proc.pid) if "/dev/shm/" in p]
    finally:
        server.stop(signal.SIGKILL)


def test_a_replaced_tracker_lets_the_server_shut_down_quietly(tiny_llama_dir, tmp_path):
    server = start_server(tiny_llama_dir, tmp_path, ["--max_total_token_num", "4096"])
    try:
        _kill_tracker_and_wait_for_its_replacement(server)
        code = server.stop(signal.SIGTERM)
    finally:
        server.stop(signal.SIGKILL)
    log = server.log()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log and "KeyError" not in log, log[-3000:]
    assert "relaunching" not in log  # multiprocessing's own warning: the launcher's line says it
    assert not leftovers(server.proc.pid)
