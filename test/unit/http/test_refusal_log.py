"""Connection refusals are logged as one line per interval, and a held-back count is written on time.

The front door's thread used to wait on its selector without a timeout when no connection was
pending a deadline, so counts held back after a burst of refusals waited for the next connection,
possibly forever. Here the interval is shortened to keep the test quick.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import List

import pytest

from lightllm.server.http.transport import connection_book
from lightllm.server.http.transport.connection_book import ConnectionBook
from lightllm.server.http.transport.front_door import FrontDoor
from lightllm.server.http.transport.listen_sockets import bind_listeners
from lightllm.server.http.server_options import AuthPolicy, HttpLimits

INTERVAL = 0.5
# A pending connection's head deadline far beyond the test: it must not be what wakes the thread.
LIMITS = HttpLimits(header_timeout=60, max_connections=10, max_connections_per_client=1)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture()
def lines(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(connection_book, "_LOG_INTERVAL_SECONDS", INTERVAL)
    handler = _Lines()
    logger = logging.getLogger("lightllm.server.http.transport.front_door")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def _refused(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_next_log_due_follows_the_counts(lines: List[str]) -> None:
    book = ConnectionBook(LIMITS)
    assert book.next_log_due() is None
    assert book.admit("p") == (False, None)
    assert book.admit("p")[1] is not None  # the client's one place is taken
    assert book.next_log_due() == float("-inf")  # nothing logged yet: due at once
    book.log_refusals()
    assert book.next_log_due() is None and len(lines) == 1
    book.count_refusal("too_many_connections")
    due = book.next_log_due()
    assert due is not None and 0 < due - time.monotonic() <= INTERVAL


def test_held_back_refusals_are_logged_within_the_interval_while_idle(lines: List[str]) -> None:
    door = FrontDoor(bind_listeners("127.0.0.1", 0), LIMITS, AuthPolicy())
    door.start()
    holder = socket.create_connection(("127.0.0.1", door.port))  # takes the client's one place
    try:
        time.sleep(0.2)
        first = _refused(door.port)
        assert b" 503 " in first and b"too_many_client_connections" in first
        deadline = time.monotonic() + 5
        while not lines:
            assert time.monotonic() < deadline, "the first refusal was not logged"
            time.sleep(0.02)
        assert "1 too_many_client_connections" in lines[0]
        _refused(door.port)
        _refused(door.port)
        logged = time.monotonic()
        # No more traffic: the held-back count must still come out about one interval later.
        while len(lines) < 2:
            assert time.monotonic() - logged < INTERVAL + 3, "held-back refusals were not logged while idle"
            time.sleep(0.02)
        assert "2 too_many_client_connections" in lines[1]
    finally:
        holder.close()
        door.close()
