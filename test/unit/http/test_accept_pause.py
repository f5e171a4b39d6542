"""Out of file descriptors: accept pauses, logged at most once per interval with the count between."""

from __future__ import annotations

import logging
import resource

import pytest

from lightllm.server.http.transport.accept_pause import PAUSE_LOG_INTERVAL_SECONDS, PAUSE_SECONDS, AcceptPause
from lightllm.server.http.server_options import RESERVED_FILE_DESCRIPTORS, HttpLimits, ensure_file_descriptors


def test_pauses_are_logged_once_per_interval_with_the_count_between(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.accept_pause")
    pause = AcceptPause(logger)
    with caplog.at_level(logging.WARNING, logger="test.accept_pause"):
        now = 100.0
        for _ in range(60):  # 12 s of pauses, five a second
            pause.start("Too many open files", now)
            assert pause.until == now + PAUSE_SECONDS and not pause.ends(now)
            assert pause.ends(now + PAUSE_SECONDS) and pause.until == 0.0
            now += PAUSE_SECONDS
    lines = [record.getMessage() for record in caplog.records]
    assert lines == ["cannot accept connections (Too many open files); pausing accept for 0.2s",
                     "cannot accept connections (Too many open files); pausing accept for 0.2s "
                     f"({int(PAUSE_LOG_INTERVAL_SECONDS / PAUSE_SECONDS) - 1} more pauses since the last such line)"]


def test_the_open_file_warning_counts_what_the_cap_needs(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    limits = HttpLimits(max_connections=2048)
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (400, 400))
    monkeypatch.setattr(resource, "setrlimit", lambda kind, value: (_ for _ in ()).throw(ValueError("no")))
    with caplog.at_level(logging.WARNING):
        ensure_file_descriptors(limits)
    needed = 2048 + 2 * limits.reserve_connections + RESERVED_FILE_DESCRIPTORS
    [line] = [record.getMessage() for record in caplog.records]
    assert line.startswith(f"the open-file limit (400) is below the {needed} files --http_max_connections 2048 needs "
                           f"(with twice its reserve of {limits.reserve_connections} connections and "
                           f"{RESERVED_FILE_DESCRIPTORS} for the server's own files)")
