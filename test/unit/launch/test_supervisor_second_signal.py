"""A second stop signal during the drain ends the requests at once, and the log says so, not that they finished."""

from __future__ import annotations

import asyncio
import logging
import signal
import types
from typing import Optional

from lightllm.server.launch.supervisor import SHUTTING_DOWN, Supervisor


class TwoRequestsInFlight:
    """The supervisor's request manager: two requests that end only when failed."""

    def __init__(self) -> None:
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.refused: Optional[str] = None
        self.failed_with: Optional[str] = None
        self._idle = asyncio.Event()

    def refuse_new_requests(self, message: str, code: str) -> None:
        self.refused = code

    def fail_pending(self, message: str, code: str, backend_alive: bool) -> int:
        self.failed_with = code
        self._idle.set()
        return 2

    async def wait_until_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


def test_second_signal_logs_the_ended_requests_not_that_every_request_finished(caplog):
    async def scenario() -> TwoRequestsInFlight:
        manager = TwoRequestsInFlight()
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
    assert manager.refused == SHUTTING_DOWN and manager.failed_with == SHUTTING_DOWN
    messages = [record.getMessage() for record in caplog.records]
    assert "ended 2 request(s) with an error at shutdown" in messages
    assert "every request finished; shutting down" not in messages
