"""The supervisor's answer to the watchdog: hung children end the server as dead ones do, a drain included."""

from __future__ import annotations

import asyncio
import logging
import signal
import types
from typing import Tuple

from supervisor_test_support import RequestsInFlight
from lightllm.server.launch.supervisor import SERVER_FAILED, SHUTTING_DOWN, Supervisor
from lightllm.server.launch.watchdog import Stall


def _run(drain_first: bool, caplog) -> Tuple[Supervisor, RequestsInFlight]:
    async def scenario() -> Tuple[Supervisor, RequestsInFlight]:
        manager = RequestsInFlight(1)
        manager.loop = asyncio.get_running_loop()
        supervisor = Supervisor(manager, graceful_shutdown_seconds=600)
        supervisor.server = types.SimpleNamespace(should_exit=False)
        if drain_first:
            supervisor.stop_signal(signal.SIGTERM)
            await asyncio.sleep(0.05)
            assert not supervisor.server.should_exit  # draining: the request may still finish
        # Called from the watcher thread in the server; the hand-over to the loop is the same.
        supervisor.children_stalled([Stall("model_rank1", 16.4), Stall("model_rank0", 15.2)], 15.0)
        supervisor.child_died("model_rank1", -9)  # the launcher's SIGKILL of the hung rank: not a second failure
        for _ in range(200):
            if supervisor.server.should_exit:
                break
            await asyncio.sleep(0.01)
        return supervisor, manager

    with caplog.at_level(logging.INFO, logger="lightllm.supervisor"):
        return asyncio.run(asyncio.wait_for(scenario(), 30))


def test_hung_children_fail_every_request_with_server_failed_naming_them(caplog):
    supervisor, manager = _run(False, caplog)
    assert supervisor.server.should_exit and supervisor.exit_code == 1
    (message, code, backend_alive), = manager.failed
    assert code == SERVER_FAILED and not backend_alive
    assert message.startswith("The server failed: its child processes model_rank1 (16 s) and model_rank0 (15 s) made "
                              "no progress (--watchdog_timeout 15); the request was not completed"), message
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors[0] == ("child processes model_rank1 (16 s) and model_rank0 (15 s) made no progress "
                         "(--watchdog_timeout 15); failing every request and shutting down")
    assert not any("exited unexpectedly" in line for line in errors)


def test_a_hang_during_a_drain_ends_the_drain_at_once_with_exit_code_1(caplog):
    supervisor, manager = _run(True, caplog)
    assert manager.refused == SHUTTING_DOWN
    assert supervisor.server.should_exit and supervisor.exit_code == 1
    assert [code for _, code, _ in manager.failed] == [SERVER_FAILED]
    # The drain's wait ended because the failure ended the request, not because it finished.
    assert "every request finished; shutting down" not in [r.getMessage() for r in caplog.records]


def _died_of_sigbus() -> int:
    """The exit code multiprocessing reports for a child killed by SIGBUS (as a full /dev/shm kills one)."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=_kill_self_with_sigbus)
    child.start()
    child.join()
    return child.exitcode


def _kill_self_with_sigbus() -> None:
    import os

    os.kill(os.getpid(), signal.SIGBUS)


def test_a_child_killed_by_a_signal_is_named_by_it_and_sigbus_points_at_dev_shm(caplog):
    exitcode = _died_of_sigbus()

    async def scenario() -> RequestsInFlight:
        manager = RequestsInFlight(1)
        manager.loop = asyncio.get_running_loop()
        supervisor = Supervisor(manager, graceful_shutdown_seconds=600)
        supervisor.server = types.SimpleNamespace(should_exit=False)
        supervisor.child_died("model_rank0", exitcode)
        for _ in range(200):
            if supervisor.server.should_exit:
                break
            await asyncio.sleep(0.01)
        return manager

    with caplog.at_level(logging.INFO, logger="lightllm.supervisor"):
        manager = asyncio.run(asyncio.wait_for(scenario(), 30))
    why = ("killed by SIGBUS, exit code -7: a shared-memory page could not be backed, usually because /dev/shm ran "
           "out of space (docs/EN/memory.md, Shared memory)")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors[0] == f"child process model_rank0 exited unexpectedly ({why}); failing every request and shutting down"
    (message, code, _), = manager.failed
    assert code == SERVER_FAILED and f"its model_rank0 process exited unexpectedly ({why})" in message
