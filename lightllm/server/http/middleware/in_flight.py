"""Requests the server has taken but not yet handed to its request manager, for a graceful shutdown.

Between its arrival and its first ``manager.generate`` call a request is parsed and tokenized,
which for a long prompt takes seconds, and the manager does not know about it yet.  A drain that
waited only for the manager's generations would end the server under such a request, whose
client would then get uvicorn's plain-text 500 instead of an answer.  The middleware here gives
every ``POST`` a :class:`Admission` in its scope; the request counts as *preparing* until the
manager starts its first generation (:func:`~lightllm.server.admission_scope.generation_started`)
or the request ends.  A drain waits for both counts, and a request admitted before the server began
to refuse new ones may still start its generations
(:func:`~lightllm.server.admission_scope.admitted_before`).  The scope keys and those two hooks are
in :mod:`lightllm.server.admission_scope`, below both this layer and the request managers that call them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Dict, Optional, Set, Tuple

from fastapi.responses import JSONResponse

from lightllm.server.admission_scope import ADMISSION_KEY
from lightllm.server.http.errors import SERVICE_UNAVAILABLE, error_body, manager_error
from lightllm.server.http.service.health import PROBE_PATHS
from lightllm.server.manager_errors import ServerUnavailableError

Scope = Dict[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


@dataclass
class PreparingRequests:
    """How many admitted requests have not started a generation yet (read by the supervisor's drain).

    :meth:`close` (the drain's deadline passed, or a process failed) sets ``closing`` (message,
    code) and cancels every request still being prepared that has not begun its answer (its body
    arriving, waiting for its client's place, tokenizing): each gets that 503 at once from the
    admission middleware, instead of the HTTP server's cancellation seconds later (a plain-text
    500, or the 503 late).
    """

    count: int = 0
    closing: Optional[Tuple[str, str]] = None
    _admissions: Set["Admission"] = field(default_factory=set, repr=False)

    @property
    def idle(self) -> bool:
        """True when no request is between its arrival and its first generation."""
        return self.count == 0

    def admit(self, arrived: float, task: Optional["asyncio.Task[Any]"] = None) -> "Admission":
        """Count a new request as preparing; ``task`` is what :meth:`close` cancels (None: nothing)."""
        admission = Admission(arrived, self, task)
        self.count += 1
        self._admissions.add(admission)
        return admission

    def close(self, message: str, code: str) -> int:
        """The server stops serving: requests still being prepared end now with this 503; returns how many."""
        self.closing = (message, code)
        ended = 0
        for admission in list(self._admissions):
            task = admission.task
            if task is not None and not admission.answering and not task.done():
                task.cancel()
                # Counted and cancelled once: a second close (a second signal after the drain's
                # deadline, a failure during it) must not cancel its 503 as it is written.
                self._admissions.discard(admission)
                ended += 1
        return ended


@dataclass(eq=False)
class Admission:
    """One request's admission: when it arrived, and whether it still counts as preparing.

    ``task``: the request's task (cancelled by :meth:`PreparingRequests.close`); ``answering``: its
    answer has begun (a 4xx being sent, ``/tokenize``), so it is left to finish.
    """

    arrived: float
    book: PreparingRequests = field(repr=False)
    task: Optional["asyncio.Task[Any]"] = field(default=None, repr=False)
    preparing: bool = True
    answering: bool = False

    def release(self) -> None:
        """Stop counting the request as preparing (idempotent)."""
        if self.preparing:
            self.preparing = False
            self.book.count -= 1
            self.book._admissions.discard(self)


def check_admission(manager: Any, request: Any) -> None:
    """The 503 a generation request gets at once when ``manager`` refuses it now (draining and it
    arrived after the signal, or failed), before its body is parsed, its prompt tokenized or its
    grammar checked: work on the tokenizer threads that requests still in flight wait on."""
    try:
        manager.check_admission(request)
    except ServerUnavailableError as exc:
        raise manager_error(exc) from None


# The endpoints that start generations: refused on arrival while the server drains.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate", "/generate_stream"})


@dataclass(frozen=True)
class _ScopeRequest:
    """A request seen by its ASGI scope alone, as :func:`~lightllm.server.admission_scope.admitted_before`
    reads a request."""

    scope: Scope


def refused_on_arrival(manager: Any, scope: Scope) -> Optional[ServerUnavailableError]:
    """The refusal ``manager`` gives this generation request now (draining and it arrived after the
    signal, or failed), else None.

    The arrival is the request's :class:`Admission` (its head received, from the outer
    :class:`AdmissionMiddleware`): a request that arrived before the drain began but reaches this
    check after it (it waited for its client's place) is in flight, and
    may still start.  Without an admission it counts as arriving now.
    """
    if manager is None or scope.get("method") != "POST" or scope.get("path") not in GENERATION_PATHS:
        return None
    try:
        manager.check_admission(_ScopeRequest(scope))
    except ServerUnavailableError as exc:
        return exc
    return None


class DrainRefusalMiddleware:
    """A generation request arriving while ``manager`` refuses new ones gets its 503 before its body
    is read: inside the API-key check and CORS (a client without a valid key gets its 401, a
    browser can read the answer), and once the client share let it through without a place
    (``ClientShareMiddleware`` does not hold such a request back).  :func:`check_admission` in the
    handlers asks again for paths :data:`GENERATION_PATHS` does not name."""

    def __init__(self, app: ASGIApp, manager: Any) -> None:
        self.app = app
        self.manager = manager

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        refusal = refused_on_arrival(self.manager, scope) if scope.get("type") == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
            return
        await closing_response((str(refusal), refusal.code or "server_unavailable"))(scope, receive, send)


class AdmissionMiddleware:
    """Gives each ``POST`` an :class:`Admission` counted in ``book`` until it starts generating or ends.

    A probe's ``POST`` (``/ping``, LightLLM's ``/liveness`` and ``/readiness``) is not a request to
    admit: it passes as its ``GET`` does, so both methods answer alike during a drain or after a failure.
    """

    def __init__(self, app: ASGIApp, book: PreparingRequests) -> None:
        self.app = app
        self.book = book

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        if self.book.closing is not None:
            # Arrived after the server stopped serving (pipelined, or handed over as it stopped).
            await closing_response(self.book.closing)(scope, receive, send)
            return
        admission = self.book.admit(time.monotonic(), asyncio.current_task())
        scope[ADMISSION_KEY] = admission

        async def sending(message: Dict[str, Any]) -> None:
            if message.get("type") == "http.response.start":
                admission.answering = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            # Cancelled by the book's close (the drain's deadline, a failure) or by the HTTP server
            # at its own shutdown: the client gets the drain's 503 rather than the server's
            # plain-text 500, and the task ends.
            if self.book.closing is None or admission.answering:
                raise
            await closing_response(self.book.closing)(scope, receive, send)
        finally:
            admission.release()


def closing_response(closing: Tuple[str, str]) -> JSONResponse:
    """The 503 of a server that stopped serving, for a request it will not complete."""
    message, code = closing
    return JSONResponse(error_body(message, SERVICE_UNAVAILABLE, None, code), status_code=503,
                        headers={"connection": "close"})
