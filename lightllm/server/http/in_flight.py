"""Requests the server has taken but not yet handed to its request manager, for a graceful shutdown.

Between its arrival and its first ``manager.generate`` call a request is parsed and tokenized,
which for a long prompt takes seconds, and the manager does not know about it yet.  A drain that
waited only for the manager's generations would end the server under such a request, whose
client would then get uvicorn's plain-text 500 instead of an answer.  The middleware here gives
every ``POST`` a :class:`Admission` in its scope; the request counts as *preparing* until the
manager starts its first generation (:func:`generation_started`) or the request ends.  A drain
waits for both counts, and a request admitted before the server began to refuse new ones may
still start its generations (:func:`admitted_before`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Dict, List, Optional, Tuple

from fastapi.responses import JSONResponse

from lightllm.server.http.errors import SERVICE_UNAVAILABLE, error_body

Scope = Dict[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

ADMISSION_KEY = "lightllm.admission"
# A request's place among its client's requests being prepared (lightllm/server/http/client_share.py's
# ClientPlace), released once the request reaches the engine.
CLIENT_SHARE_KEY = "lightllm.client_share"


@dataclass
class PreparingRequests:
    """How many admitted requests have not started a generation yet (read by the supervisor's drain).

    ``closing`` (message, code) is set when the server stops serving (the drain's deadline passed,
    or a process failed): a request that has not answered by then (its body still arriving) is
    cancelled by the HTTP server and gets that 503 instead of the server's plain-text 500.
    """

    count: int = 0
    closing: Optional[Tuple[str, str]] = None
    # One future per waiting request, on that request's loop (tests serve each request on a new one).
    _waiters: List[asyncio.Future] = field(default_factory=list, repr=False)

    @property
    def idle(self) -> bool:
        """True when no request is between its arrival and its first generation."""
        return self.count == 0

    def close(self, message: str, code: str) -> None:
        """The server stops serving: every request still being prepared gets this 503 now."""
        self.closing = (message, code)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait_closed(self) -> None:
        """Return once :meth:`close` was called (at once if it was)."""
        if self.closing is not None:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            self._waiters.remove(waiter)


@dataclass
class Admission:
    """One request's admission: when it arrived, and whether it still counts as preparing."""

    arrived: float
    book: PreparingRequests = field(repr=False)
    preparing: bool = True

    def release(self) -> None:
        """Stop counting the request as preparing (idempotent)."""
        if self.preparing:
            self.preparing = False
            self.book.count -= 1


def _admission(request: Any) -> Admission | None:
    scope = getattr(request, "scope", None)
    return scope.get(ADMISSION_KEY) if isinstance(scope, dict) else None


def generation_started(request: Any) -> None:
    """Called by a request manager once a generation of ``request`` (the client's connection, or None) is counted.

    The request stops counting as preparing, for the drain and for its client's share of the
    requests being prepared (a stream does not hold that place while it generates).
    """
    admission = _admission(request)
    if admission is not None:
        admission.release()
    scope = getattr(request, "scope", None)
    place = scope.get(CLIENT_SHARE_KEY) if isinstance(scope, dict) else None
    if place is not None:
        place.release()


def admitted_before(request: Any, moment: float) -> bool:
    """True when ``request`` arrived before ``moment`` (``time.monotonic()``); False without an admission."""
    admission = _admission(request)
    return admission is not None and admission.arrived < moment


class AdmissionMiddleware:
    """Gives each ``POST`` an :class:`Admission` counted in ``book`` until it starts generating or ends."""

    def __init__(self, app: ASGIApp, book: PreparingRequests) -> None:
        self.app = app
        self.book = book

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        admission = Admission(time.monotonic(), self.book)
        self.book.count += 1
        scope[ADMISSION_KEY] = admission
        started = False

        async def sending(message: Dict[str, Any]) -> None:
            nonlocal started
            started = started or message.get("type") == "http.response.start"
            await send(message)

        served = asyncio.ensure_future(self.app(scope, receive, sending))
        closed = asyncio.ensure_future(self.book.wait_closed())
        try:
            await asyncio.wait({served, closed}, return_when=asyncio.FIRST_COMPLETED)
            if not served.done() and admission.preparing and not started:
                # The server stopped serving (the drain's deadline, a failure) while this request
                # was still being prepared (its body arriving, waiting for its client's place,
                # tokenizing): it ends now with the 503, not seconds later when the HTTP server
                # cancels what is left.
                served.cancel()
            await served
        except asyncio.CancelledError:
            # Cancelled here (above) or by the HTTP server after the drain's deadline: the client
            # gets the drain's 503 rather than the server's plain-text 500, and the task ends.
            if not served.done():
                served.cancel()
                await asyncio.wait({served})
            if self.book.closing is None or started:
                raise
            await closing_response(self.book.closing)(scope, receive, send)
        finally:
            closed.cancel()
            admission.release()


def closing_response(closing: Tuple[str, str]) -> JSONResponse:
    """The 503 of a server that stopped serving, for a request it will not complete."""
    message, code = closing
    return JSONResponse(error_body(message, SERVICE_UNAVAILABLE, None, code), status_code=503,
                        headers={"connection": "close"})
