"""Log lines a client can repeat at will pass at most once per interval, with the count dropped."""

from __future__ import annotations

import logging

import pytest

from lightllm.server.http.log_throttle import INVALID_REQUEST_LINE, LineThrottle, throttle_uvicorn_request_errors


def test_repeats_within_the_interval_are_counted_into_the_next_line(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    logger = logging.getLogger("test.log_throttle")
    logger.addFilter(LineThrottle(frozenset({INVALID_REQUEST_LINE}), 10.0, lambda: now[0]))
    with caplog.at_level(logging.WARNING, logger="test.log_throttle"):
        for step in range(43):
            now[0] = step * 0.1
            logger.warning(INVALID_REQUEST_LINE)
            logger.warning("another line")
        now[0] = 10.0
        logger.warning(INVALID_REQUEST_LINE)
    lines = [record.getMessage() for record in caplog.records]
    assert lines.count("another line") == 43
    assert [line for line in lines if line != "another line"] == [
        INVALID_REQUEST_LINE, "Invalid HTTP request received. (42 more since the last such line)"]


def test_the_uvicorn_throttle_is_installed_once() -> None:
    throttle_uvicorn_request_errors()
    throttle_uvicorn_request_errors()
    assert sum(isinstance(f, LineThrottle) for f in logging.getLogger("uvicorn.error").filters) == 1
