"""A server child ends the moment its launcher dies, even while it is stopped.

Before, a child only checked its parent once a second from a thread: a SIGSTOPped child (as the
watchdog tests leave one) outlived a ``kill -9`` of the launcher for good, and since it kept
multiprocessing's resource tracker's pipe open, every ``/dev/shm/lightllm_<pid>_*`` segment stayed
until someone killed it.  Now :func:`~lightllm.utils.process_utils.run_child` asks the kernel for
SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), checked against the parent it was spawned by.
Real processes, as the launcher starts them (spawn); the bounds are generous.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from types import SimpleNamespace
from typing import Any, Optional

from lightllm.utils import process_utils

GONE_BOUND_SECONDS = 10.0


def _state(pid: int) -> Optional[str]:
    """The kernel's state letter of ``pid`` (``T`` stopped, ``Z`` zombie), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _wait_state(pid: int, done: Any, bound_seconds: float = GONE_BOUND_SECONDS) -> Optional[str]:
    deadline = time.monotonic() + bound_seconds
    state = _state(pid)
    while not done(state) and time.monotonic() < deadline:
        time.sleep(0.02)
        state = _state(pid)
    return state


def _sleeping_child(ready_conn: Any) -> None:
    """A server child reduced to run_child and a body that waits."""

    def body(mark_ready: Any) -> None:
        mark_ready()
        time.sleep(3600)

    process_utils.run_child("orphan_test", ready_conn, body)


def _launcher(report: Any) -> None:
    """A launcher reduced to spawning one child from its main thread, as start_processes does."""
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_sleeping_child, args=(child_conn,), daemon=False)
    child.start()
    assert parent_conn.recv()[0] == "ready"
    report.send(child.pid)
    time.sleep(3600)


def test_a_stopped_child_ends_when_its_launcher_is_killed():
    ctx = mp.get_context("spawn")
    receive, report = ctx.Pipe(duplex=False)
    launcher = ctx.Process(target=_launcher, args=(report,), daemon=False)  # it has a child of its own
    launcher.start()
    child_pid = None
    try:
        assert receive.poll(60), "the launcher did not report its child"
        child_pid = receive.recv()
        os.kill(child_pid, signal.SIGSTOP)
        assert _wait_state(child_pid, lambda state: state == "T") == "T"
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.join(10)
        # Gone, or a zombie waiting for whoever adopted it: either way it holds nothing open.
        state = _wait_state(child_pid, lambda state: state in (None, "Z"))
        assert state in (None, "Z"), f"the stopped child outlived its killed launcher (state {state})"
    finally:
        if child_pid is not None and _state(child_pid) not in (None, "Z"):
            os.kill(child_pid, signal.SIGKILL)
        if launcher.is_alive():
            launcher.kill()
            launcher.join(10)


def _exit_with_a_parent_already_gone(spawner_pid: int) -> None:
    """The race: the launcher died before the child armed its signal (its parent is now another)."""
    try:
        mp.parent_process = lambda: SimpleNamespace(pid=spawner_pid)
        process_utils._exit_with_parent()
    except BaseException:  # noqa: BLE001 - any failure is told apart from the exit under test
        os._exit(3)
    os._exit(0)  # not reached when the check works


def test_a_child_whose_parent_died_before_it_armed_the_signal_exits_at_once():
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_exit_with_a_parent_already_gone, args=(os.getpid() + 10**6,))
    child.start()
    child.join(60)
    assert child.exitcode == 1


def test_children_are_started_only_from_the_main_thread():
    """The kernel ties the parent-death signal to the thread that started the child."""
    from lightllm.server.launch.start import start_processes

    errors = []

    def start() -> None:
        try:
            start_processes(None, None, None)  # type: ignore[arg-type]
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(60)
    assert errors == ["the server's children are started from the launcher's main thread"]

