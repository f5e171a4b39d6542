"""A request's admission as a request manager sees it: two keys of its ASGI scope and the hooks reading them.

The HTTP layer's middleware (:mod:`lightllm.server.http.middleware.in_flight` and
:mod:`lightllm.server.http.middleware.client_share`) puts a request's admission and its place among
its client's requests into the request's scope under these keys. The request managers (a server's
:mod:`lightllm.server.httpserver`, the PD master) and :mod:`lightllm.server.request_gate` read them
back through :func:`generation_started` and :func:`admitted_before`. The keys and hooks live here,
below both sides, so a manager depends on no HTTP module and the HTTP layer on no manager: each
side knows only the scope.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

ADMISSION_KEY = "lightllm.admission"
# A request's place among its client's requests being prepared (lightllm/server/http/middleware/client_share.py's
# ClientPlace), released once the request reaches the engine.
CLIENT_SHARE_KEY = "lightllm.client_share"


class Releasable(Protocol):
    """What the scope holds under :data:`CLIENT_SHARE_KEY`: a place given back once (idempotent)."""

    def release(self) -> None:
        """Give the place back; a second call does nothing."""


class ScopeAdmission(Releasable, Protocol):
    """What the scope holds under :data:`ADMISSION_KEY`: when the request arrived (``time.monotonic()``)."""

    arrived: float


def _scope_value(request: Any, key: str) -> Optional[Any]:
    # ``request``: the client's connection (a Starlette Request, or anything with a ``scope`` dict),
    # or None for a generation no connection asked for (a PD node's continuation, a test).
    scope = getattr(request, "scope", None)
    return scope.get(key) if isinstance(scope, dict) else None


def generation_started(request: Any) -> None:
    """Called by a request manager once a generation of ``request`` (the client's connection, or None) is counted.

    The request stops counting as preparing, for the drain and for its client's share of the
    requests being prepared (a stream does not hold that place while it generates).
    """
    admission: Optional[ScopeAdmission] = _scope_value(request, ADMISSION_KEY)
    if admission is not None:
        admission.release()
    place: Optional[Releasable] = _scope_value(request, CLIENT_SHARE_KEY)
    if place is not None:
        place.release()


def admitted_before(request: Any, moment: float) -> bool:
    """True when ``request`` arrived before ``moment`` (``time.monotonic()``); False without an admission."""
    admission: Optional[ScopeAdmission] = _scope_value(request, ADMISSION_KEY)
    return admission is not None and admission.arrived < moment
