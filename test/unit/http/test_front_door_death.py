"""A front door whose thread dies of an exception ends the server instead of leaving its port hanging.

The failure is injected as a tester saw it: ``selector.select(timeout)`` raising ``OverflowError``
(a huge ``--http_header_timeout`` made the timeout too large for ``select``).
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from typing import Any, List, Optional, Tuple

import pytest
import uvicorn

from api_fakes import FakeManager
from lightllm.server.http.app import create_app
from lightllm.server.http.transport.front_door import FrontDoor
from lightllm.server.http.transport.listen_sockets import bind_listeners
from lightllm.server.http.transport.protocol import guarded_protocol_class
from lightllm.server.http.server_options import AuthPolicy, HttpLimits, HttpServerOptions
from lightllm.server.launch.supervisor import SERVER_FAILED, SupervisedServer, Supervisor

LIMITS = HttpLimits(header_timeout=20, body_timeout=5, keep_alive_timeout=5, max_connections=6,
                    max_connections_per_client=3)
BOUND_SECONDS = 5.0


class _FailingSelector(selectors.DefaultSelector):  # type: ignore[misc, valid-type]
    """Registers as usual; ``select`` raises once :attr:`armed` is set (at once when armed from the start)."""

    def __init__(self, armed: bool) -> None:
        super().__init__()
        self.armed = threading.Event()
        if armed:
            self.armed.set()

    def select(self, timeout: Optional[float] = None) -> List[Tuple[Any, int]]:
        if self.armed.is_set():
            raise OverflowError("timeout is too large")
        return super().select(0.05 if timeout is None else min(timeout, 0.05))


def _door(armed: bool) -> Tuple[FrontDoor, _FailingSelector]:
    door = FrontDoor(bind_listeners("127.0.0.1", 0), LIMITS, AuthPolicy())
    selector = _FailingSelector(armed)
    door._selector = selector  # the thread only ever uses this attribute
    door._lingering._selector = selector
    return door, selector


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except ConnectionRefusedError:
        return True


def test_a_dead_thread_logs_its_cause_closes_the_port_and_calls_the_handler(caplog: pytest.LogCaptureFixture) -> None:
    door, _ = _door(armed=True)
    port = door.port
    causes: List[str] = []
    called = threading.Event()
    door.set_death_handler(lambda cause: (causes.append(cause), called.set()))
    with caplog.at_level(logging.ERROR, logger="lightllm.server.http.transport.front_door"):
        door.start()
        assert called.wait(BOUND_SECONDS), "the death handler was not called"
    try:
        assert causes == ["OverflowError: timeout is too large"]
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == ["the HTTP front door thread failed (OverflowError: timeout is too large); "
                          "shutting the server down"], errors
        # Refused at once, not accepted into a backlog nobody reads.
        assert _refused(port)
        # A handler set after the death is called at once, with the same cause.
        late: List[str] = []
        door.set_death_handler(late.append)
        assert late == causes
    finally:
        door.close()


def test_a_planned_close_is_not_a_death() -> None:
    door, _ = _door(armed=False)
    causes: List[str] = []
    door.set_death_handler(causes.append)
    door.start()
    door.close()
    assert not door._thread.is_alive() and causes == []


class _FailableManager(FakeManager):
    """The scripted manager with what the supervisor calls when the server fails."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: Optional[Any] = None
        self.failed_with: List[Tuple[str, str, bool]] = []

    def fail_pending(self, message: str, code: str, backend_alive: bool) -> int:
        self.failed_with.append((message, code, backend_alive))
        return 0


def test_a_dead_front_door_stops_a_serving_server_with_exit_code_1() -> None:
    door, selector = _door(armed=False)
    door.start()
    manager = _FailableManager()
    options = HttpServerOptions(limits=LIMITS)
    config = uvicorn.Config(create_app(manager, options), log_level="error", http=guarded_protocol_class(LIMITS))
    supervisor = Supervisor(manager, 0)
    server = SupervisedServer(config, supervisor, front_door=door)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not door.serving:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        manager.loop = door._loop
        port = door.port
        selector.armed.set()
        thread.join(BOUND_SECONDS)
        assert not thread.is_alive(), "the server kept running with a dead front door"
        assert supervisor.exit_code == 1
        assert len(manager.failed_with) == 1
        message, code, backend_alive = manager.failed_with[0]
        assert code == SERVER_FAILED and backend_alive  # the children live: requests are aborted there
        assert "its HTTP front door failed (OverflowError: timeout is too large)" in message
        assert _refused(port)
    finally:
        server.should_exit = True
        thread.join(10)
        door.close()
