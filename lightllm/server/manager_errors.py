"""Why a request manager refuses or ends a request: the error types the HTTP layer maps to bodies.

Every request manager (the HTTP process's own, and later a PD master's) raises these, and
:func:`lightllm.server.http.errors.manager_error` recognises them by type.  The module imports
nothing, so the HTTP layer can depend on it without pulling in shared memory or zmq.
"""

from __future__ import annotations


class ServerBusyError(RuntimeError):
    """The server cannot take the request now (no request slot became free in time); retry later.

    ``role`` names the busy PD node role (``"prefill"`` or ``"decode"``) when a PD master
    refuses; the HTTP layer adds it to the 503 error body.
    """

    def __init__(self, message: str = "", role: str | None = None):
        super().__init__(message)
        self.role = role


class ServerUnavailableError(RuntimeError):
    """The server takes no more requests (it is shutting down or one of its processes died).

    ``code`` is the machine-readable reason the HTTP layer puts in the 503 error body.
    """

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class ServerChatTemplateError(RuntimeError):
    """The server's own chat template (the checkpoint's) cannot be compiled: no chat can render.

    Not the client's fault, so not a ``ValueError`` (a 400): the HTTP layer answers 500 with
    code ``chat_template_invalid``; the operator fixes it with ``--chat_template``.
    """


class DuplicateRequestIdError(ValueError):
    """A caller-assigned request id is already in use by a live request of this server.

    Only server code that owns its requests (for example a PD master) assigns ids; a clash is
    that caller's bug, refused before anything is written.
    """

    def __init__(self, request_id: int):
        super().__init__(f"request id {request_id} is already in use by a live request")
        self.request_id = request_id
