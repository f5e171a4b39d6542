"""OpenAI-style error bodies for every failing HTTP response.

Every 4xx/5xx answer of the server has the shape
``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``,
whether it comes from request validation, the request manager, an unknown route or an
unexpected exception.  Unexpected exceptions are logged with their traceback; the body
only says that an internal error happened.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Coroutine

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from lightllm.server.http.retry_after import retry_after_headers
from lightllm.server.manager_errors import (
    DuplicateRequestIdError,
    ServerBusyError,
    ServerChatTemplateError,
    ServerUnavailableError,
)

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
SERVICE_UNAVAILABLE = "service_unavailable_error"


class APIError(Exception):
    """An error that should reach the client as an OpenAI-style JSON body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        error_type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        # Fields added to the error object after the four standard ones (a busy PD node's role).
        self.extra = dict(extra or {})

    def to_dict(self) -> dict[str, Any]:
        """The ``{"error": {...}}`` body for this error."""
        body = error_body(self.message, self.error_type, self.param, self.code)
        body["error"].update(self.extra)
        return body

    def to_response(self) -> JSONResponse:
        """A JSON response carrying this error and its status code."""
        return JSONResponse(self.to_dict(), status_code=self.status_code,
                            headers=retry_after_headers(self.status_code, self.code))


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """Build the OpenAI error envelope."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def sse_error(error: APIError) -> bytes:
    """One server-sent event carrying ``error`` (used once a stream has already started)."""
    return f"data: {json.dumps(error.to_dict(), ensure_ascii=False)}\n\n".encode("utf-8")


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 error about the client's request."""
    return APIError(400, message, INVALID_REQUEST, param, code)


def model_not_found(model: str, served: "list[str] | None" = None) -> APIError:
    """A 404 error for a ``model`` field that names a model this server does not serve."""
    names = ", ".join(f"'{name}'" for name in served) if served else "the model listed by /v1/models"
    return APIError(
        404,
        f"The model '{model}' does not exist; this server serves {names}",
        INVALID_REQUEST,
        "model",
        "model_not_found",
    )


def server_busy(message: str, role: str | None = None) -> APIError:
    """A 503 error for a request the server cannot take right now.

    ``role``: the busy PD node role, added to the body as ``"role"`` (a PD master's answer).
    """
    extra = {"role": role} if role else None
    return APIError(503, message or "The server is busy; retry later", SERVICE_UNAVAILABLE, None, "server_busy", extra)


def client_closed_request() -> APIError:
    """The answer to a client that closed its connection before its first token (nginx's 499).

    Nobody reads it; it tells the access log the request ended because its client left.
    """
    return APIError(499, "The client closed the request before its first token", INVALID_REQUEST, None,
                    "client_closed_request")


def internal_error() -> APIError:
    """A 500 error whose body deliberately carries no details of the failure."""
    return APIError(500, "Internal server error; see the server log", SERVER_ERROR, None, "internal_error")


def generation_failed() -> APIError:
    """A 500 error for a request the model rank finished with an error (finish reason "error").

    Only this request failed; the rank carries on with the others.  The cause is in the server
    log, not in the body.
    """
    return APIError(
        500,
        "The server failed while generating this request (other requests are not affected); see the server log",
        SERVER_ERROR,
        None,
        "generation_failed",
    )


def grammar_failed() -> APIError:
    """A 400 error for a request whose structured-output grammar could not go on while it was generated.

    The grammar is the client's input (``response_format``, ``structured_outputs``, ``guided_*``,
    a forced tool call), so this is not a server failure: the same request fails again, and a
    client that retries 500s must not.  llguidance's reason is in the server log with the request id.
    """
    return APIError(
        400,
        "This request's structured-output grammar could not go on while the output was generated: it can "
        "never end (a recursive schema that requires nesting, say), it names a token the model's vocabulary "
        "lacks (<[99999]>, <|nope|>), or it nested deeper or grew more ambiguous than the parser's limit allows; "
        "the server's log (behind a PD master, its node's) names the reason",
        INVALID_REQUEST,
        None,
        "grammar_failed",
    )


def manager_error(exc: Exception, param: str | None = None) -> APIError:
    """Translate an exception raised by the request manager into an :class:`APIError`.

    The types come from :mod:`lightllm.server.manager_errors`: ``ServerBusyError`` and
    ``ServerUnavailableError`` (shutting down, a process died) become 503,
    ``ServerChatTemplateError`` (the server's template does not compile) 500 ``chat_template_invalid``,
    ``DuplicateRequestIdError`` 409, any other ``ValueError`` (a request the manager refuses) 400,
    anything else is logged and becomes a 500 without details.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ServerBusyError):
        return server_busy(str(exc), getattr(exc, "role", None))
    if isinstance(exc, ServerUnavailableError):
        # The server is shutting down or lost a process: the request may succeed on another replica.
        return APIError(503, str(exc), SERVICE_UNAVAILABLE, None, exc.code or "server_unavailable")
    if isinstance(exc, ServerChatTemplateError):
        return APIError(500, str(exc), SERVER_ERROR, None, "chat_template_invalid")
    if isinstance(exc, DuplicateRequestIdError):
        # Only server code assigns ids (a PD master); a clash is a conflict, not a bad body.
        return APIError(409, str(exc), INVALID_REQUEST, None, "duplicate_request_id")
    if isinstance(exc, ValueError):
        # An error that knows its field (a request's own chat template) names it.
        return invalid_request(str(exc), getattr(exc, "param", None) or param)
    logger.error("request failed inside the request manager", exc_info=exc)
    return internal_error()


class JSONErrorRoute(APIRoute):
    """A route whose unexpected exceptions become a logged 500 JSON error.

    Starlette's generic ``Exception`` handler answers the client but then re-raises into
    the server; catching inside the route keeps the process quiet apart from our log line.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """The route's handler, answering an unexpected exception with a logged 500 JSON error.

        API errors and the HTTP and validation exceptions pass on to their own handlers.
        """
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (APIError, StarletteHTTPException, RequestValidationError):
                raise
            except Exception:  # noqa: BLE001 - this is the last line of defence
                logger.exception("unhandled error while serving %s %s", request.method, request.url.path)
                return internal_error().to_response()

        return guarded


def _validation_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(part) for part in loc if part not in ("body", "query", "path")]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every failure into the OpenAI error shape."""

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.to_response()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"No route {request.method} {request.url.path}"
            return APIError(404, message, NOT_FOUND, None, "not_found").to_response()
        if exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
            return APIError(405, message, INVALID_REQUEST, None, "method_not_allowed").to_response()
        error_type = SERVER_ERROR if exc.status_code >= 500 else INVALID_REQUEST
        return APIError(exc.status_code, str(exc.detail), error_type).to_response()

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = _validation_param(tuple(first.get("loc", ())))
        return invalid_request(f"{param or 'request'}: {first.get('msg')}", param).to_response()

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.error("unhandled error while serving %s %s", request.method, request.url.path, exc_info=exc)
        return internal_error().to_response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)
