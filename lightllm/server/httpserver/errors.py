"""Why the HTTP process's request manager refuses or ends a request.

The API layer maps these by class name (see :mod:`lightllm.server.api_errors`) to 503 bodies.
"""

from __future__ import annotations


class ServerBusyError(RuntimeError):
    """No request slot became free in time."""


class ServerUnavailableError(RuntimeError):
    """The server takes no more requests (it is shutting down or one of its processes died).

    ``code`` is the machine-readable reason the HTTP layer puts in the 503 error body.
    """

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code
