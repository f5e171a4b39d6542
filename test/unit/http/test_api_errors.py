"""Manager errors become HTTP errors by type (lightllm.server.manager_errors), never by class name."""

from __future__ import annotations

from lightllm.server.http.errors import manager_error
from lightllm.server.manager_errors import DuplicateRequestIdError, ServerBusyError, ServerUnavailableError


def test_manager_error_types_map_to_their_status() -> None:
    busy = manager_error(ServerBusyError("no slot"))
    assert (busy.status_code, busy.code, busy.message) == (503, "server_busy", "no slot")
    gone = manager_error(ServerUnavailableError("shutting down", "shutting_down"))
    assert (gone.status_code, gone.code) == (503, "shutting_down")
    duplicate = manager_error(DuplicateRequestIdError(42))
    assert (duplicate.status_code, duplicate.code) == (409, "duplicate_request_id")
    assert "42" in duplicate.message
    refused = manager_error(ValueError("bad prompt"), "prompt")
    assert (refused.status_code, refused.param) == (400, "prompt")


def test_subclasses_are_recognised() -> None:
    class SlotsExhausted(ServerBusyError):
        pass

    assert manager_error(SlotsExhausted("x")).status_code == 503


def test_a_foreign_class_with_the_same_name_is_not_a_busy_error() -> None:
    ServerBusyError = type("ServerBusyError", (RuntimeError,), {})  # noqa: N806 - the point is the name
    error = manager_error(ServerBusyError("leaks detail"))
    assert (error.status_code, error.code) == (500, "internal_error")
    assert "leaks" not in error.message
