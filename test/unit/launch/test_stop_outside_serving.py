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


def test_a_signal_before_serving_stays_an_interruption_if_uvicorn_then_marks_the_server_started(stop) -> None:
    """A signal between the launcher's last check and uvicorn's own handlers: uvicorn's start-up
    still sets ``started`` and then serves nothing (review)."""
    stop.server = SimpleNamespace(started=False, should_exit=False)
    os.kill(os.getpid(), signal.SIGTERM)
    stop.server.started = True
    assert stop.startup_interruption() == "interrupted by signal 15 during start-up"
    assert stop.exit_code(SimpleNamespace(exit_code=0)) == 1


def test_a_real_uvicorn_server_that_served_and_drained_keeps_exit_0(stop) -> None:
    """The drain path: the server started, a signal stops it, and uvicorn replays the signal here."""
    import asyncio

    import uvicorn

    async def app(scope, receive, send):  # pragma: no cover - no request is sent
        raise AssertionError("no request expected")

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    stop.server = server

    async def serve_then_stop() -> None:
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        server.should_exit = True
        await task

    asyncio.run(serve_then_stop())
    assert server.started
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's replay of the signal that stopped it
    assert stop.startup_interruption() is None
    assert stop.exit_code(SimpleNamespace(exit_code=0)) == 0
