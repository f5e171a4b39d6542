"""A stop signal that lands outside uvicorn's serving: after the children are ready, before the
server serves, it interrupts the start-up (exit 1 and its one line), as one a moment earlier does.

A SIGTERM in that window ended the server with exit 0 and nothing in the log, while one a second
earlier gave exit 1 and `error: interrupted by signal 15 during start-up` (outside pass).
"""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from lightllm.server.launch.supervisor import StopOutsideServing


@pytest.fixture
def stop():
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield StopOutsideServing()
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def test_a_signal_before_the_server_serves_interrupts_the_start_up(stop) -> None:
    stop.server = SimpleNamespace(started=False, should_exit=False)
    os.kill(os.getpid(), signal.SIGTERM)  # handled here, in the main thread, before the next bytecode
    assert stop.requested and stop.server.should_exit
    assert stop.startup_interruption() == "interrupted by signal 15 during start-up"
    assert stop.exit_code(SimpleNamespace(exit_code=0)) == 1


def test_a_signal_after_serving_leaves_the_supervisors_exit_code(stop) -> None:
    stop.server = SimpleNamespace(started=True, should_exit=False)
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.startup_interruption() is None
    assert stop.exit_code(SimpleNamespace(exit_code=0)) == 0
    assert stop.exit_code(SimpleNamespace(exit_code=1)) == 1


def test_no_signal_and_a_server_that_never_started_is_a_failed_start(stop) -> None:
    stop.server = SimpleNamespace(started=False, should_exit=False)
    assert stop.startup_interruption() is None
    assert stop.exit_code(SimpleNamespace(exit_code=0)) == 1
