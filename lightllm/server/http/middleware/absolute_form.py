"""ASGI middleware: a request target in absolute form (``GET http://host/v1/models``) is routed by its path.

RFC 9112 section 3.2.2 says a server must accept the absolute form, which a client talking
through a forward proxy sends. uvicorn passes the whole URL on as the path, so such a request
got 404 ``No route GET /http://host/v1/models``. The target's path (``/`` when it has none)
replaces it before any layer reads the path (the key check's exemptions, the client share, the
routes); the query string was split off by the HTTP parser already. The authority is not used:
this server serves the same API whatever the host.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Dict, Optional

Scope = Dict[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

_SCHEMES = ("http://", "https://")


def origin_form_path(target: str) -> Optional[str]:
    """The path of an absolute-form target (``http://host:port/a/b`` -> ``/a/b``), or None for any other form."""
    lowered = target[:8].lower()
    scheme = next((scheme for scheme in _SCHEMES if lowered.startswith(scheme)), None)
    if scheme is None:
        return None
    slash = target.find("/", len(scheme))
    return target[slash:] if slash >= 0 else "/"


class AbsoluteFormMiddleware:
    """Rewrites an absolute-form request's ``path`` and ``raw_path`` to the target's own path."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope.get("type") == "http":
            path = origin_form_path(scope.get("path", ""))
            if path is not None:
                raw_path = origin_form_path(scope["raw_path"].decode("latin-1")) if scope.get("raw_path") else None
                scope = {**scope, "path": path, "raw_path": (raw_path or path).encode("latin-1")}
        await self.app(scope, receive, send)
