"""Browsers' cross-origin checks (CORS): the server's one policy, applied by the app and the front door.

Starlette's middleware refuses a preflight from an origin, method or header the server does not
allow with a plain-text 400 (``Disallowed CORS origin``); every other refusal of this server is
the JSON error body clients parse, so the preflight's is too.  The browser enforces the policy
either way; the body only tells whoever reads it (a developer's console, a probe) why.

The policy (which origins, methods and headers, for how long a preflight holds) is built in one
place, :func:`cors_options`, from ``--allowed_origins``.  The front door
(:mod:`lightllm.server.http.transport.front_door`) answers health probes and its refusals before the app
sees the request; :class:`CorsHeaders` gets the headers of those answers from the app's own CORS
layer, run on the same request, so they are what the app would have sent.
"""

from __future__ import annotations

import logging
from typing import Any, Coroutine, Dict, List, Optional, Sequence, Tuple

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from lightllm.server.http.errors import INVALID_REQUEST, error_body

# Starlette's names for what a preflight asked for that is not allowed.
_WHAT = {"origin": "the origin is not in --allowed_origins", "method": "the method is not allowed",
         "headers": "a requested header is not allowed", "private-network": "private network access is not allowed"}

HeaderList = List[Tuple[bytes, bytes]]
logger = logging.getLogger(__name__)


def cors_options(allowed_origins: Sequence[str]) -> Optional[Dict[str, Any]]:
    """The keyword arguments of the app's CORS layer for ``--allowed_origins``; None: no CORS layer.

    As in vLLM's defaults, any method and header, no credentials.
    """
    if not allowed_origins:
        return None
    return {"allow_origins": list(allowed_origins), "allow_methods": ["*"], "allow_headers": ["*"], "max_age": 600}


class JsonErrorCorsMiddleware(CORSMiddleware):
    """:class:`CORSMiddleware` whose refused preflight is a JSON 400 (``code`` ``cors_preflight_refused``)."""

    def preflight_response(self, request_headers: Headers) -> Response:
        """Starlette's answer, its plain-text refusal rewritten as the API's error body (headers kept)."""
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        refused = response.body.decode("utf-8", "replace").removeprefix("Disallowed CORS ").split(", ")
        reasons = "; ".join(_WHAT.get(item, item) for item in refused)
        headers = {key: value for key, value in response.headers.items()
                   if key.lower() not in ("content-type", "content-length")}
        return JSONResponse(error_body(f"CORS preflight refused: {reasons}", INVALID_REQUEST, None,
                                       "cors_preflight_refused"), status_code=400, headers=headers)


async def _answer_without_headers(scope: Dict[str, Any], receive: Any, send: Any) -> None:
    """The app behind the layer in :class:`CorsHeaders`: an answer with no headers of its own."""
    await send({"type": "http.response.start", "status": 200, "headers": []})


def _run_at_once(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run ``coroutine``, which never waits, to its end on the calling thread (no event loop needed)."""
    try:
        coroutine.send(None)
    except StopIteration:
        return
    coroutine.close()
    raise RuntimeError("the CORS layer waited for something while adding headers")


class CorsHeaders:
    """The headers the app's CORS layer adds to an answer to a request, for answers given outside the app.

    Thread-safe: the layer is built once and only read.  A request shaped as a preflight gets the
    headers of a plain answer: the front door's answers (a probe, a 503) are never the preflight's.
    """

    def __init__(self, allowed_origins: Sequence[str]) -> None:
        options = cors_options(allowed_origins)
        self._layer = None if options is None else JsonErrorCorsMiddleware(_answer_without_headers, **options)
        self._failure_logged = False

    @property
    def enabled(self) -> bool:
        """False when ``--allowed_origins`` is empty: no answer carries CORS headers."""
        return self._layer is not None

    def for_request(self, method: str, headers: Sequence[Tuple[bytes, bytes]]) -> HeaderList:
        """What the layer puts on an answer (with no ``Vary`` of its own) to ``method`` with request ``headers``.

        Never raises: a failure of the layer (a Starlette version it was not tried with) gives no
        headers and is logged once; CORS headers are never worth a front door.
        """
        if self._layer is None:
            return []
        try:
            return self._added(method, headers)
        except Exception:  # noqa: BLE001 - any failure of the layer
            if not self._failure_logged:
                self._failure_logged = True
                logger.exception("the CORS layer failed on a front door answer; answering without CORS headers")
            return []

    def _added(self, method: str, headers: Sequence[Tuple[bytes, bytes]]) -> HeaderList:
        assert self._layer is not None
        scope = {"type": "http", "method": method, "headers": [(name.lower(), value) for name, value in headers]}
        added: HeaderList = []

        async def keep(message: Dict[str, Any]) -> None:
            added.extend(message.get("headers", ()))

        async def receive() -> Dict[str, Any]:
            return {"type": "http.disconnect"}

        request_headers = Headers(scope=scope)
        if (request_headers.get("origin") is not None and method == "OPTIONS"
                and "access-control-request-method" in request_headers):
            # Shaped as a preflight: the headers of a plain answer (the layer's own call would answer it).
            _run_at_once(self._layer.simple_response(scope, receive, keep, request_headers=request_headers))
        else:
            # The layer's own entry, as the app runs it: a request without Origin passes Starlette 0.x's
            # layer untouched (its simple_response would fail on it), and gets Vary: Origin from 1.x's.
            _run_at_once(self._layer(scope, receive, keep))
        return added
