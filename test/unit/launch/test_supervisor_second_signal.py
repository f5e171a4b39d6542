"""A second stop signal during the drain ends the requests at once, and the log says so, not that they finished."""

from __future__ import annotations

import asyncio
import logging
import signal
import types

from supervisor_test_support import RequestsInFlight
from lightllm.server.launch.supervisor import SHUTTING_DOWN, Supervisor


def test_second_signal_logs_the_ended_requests_not_that_every_request_finished(caplog):
    async def scenario() -> RequestsInFlight:
        manager = RequestsInFlight(2)
        manager.loop = asyncio.get_running_loop()
        supervisor = Supervisor(manager, graceful_shutdown_seconds=30)
        supervisor.server = types.SimpleNamespace(should_exit=False)
        supervisor.stop_signal(signal.SIGTERM)
        await asyncio.sleep(0.05)
        supervisor.stop_signal(signal.SIGTERM)
        for _ in range(200):
            if supervisor.server.should_exit:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the drain task wakes up after the requests ended
        assert supervisor.server.should_exit
        return manager

    with caplog.at_level(logging.INFO, logger="lightllm.supervisor"):
        manager = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert manager.refused == SHUTTING_DOWN and [code for _, code, _ in manager.failed] == [SHUTTING_DOWN]
    messages = [record.getMessage() for record in caplog.records]
    assert ("ended with an error at shutdown: 2 generation(s) running (a request runs one per choice) and 0 "
            "request(s) still being prepared") in messages
    assert "every request finished; shutting down" not in messages
