"""Browsers' cross-origin checks (CORS), with a refused preflight answered in the API's error shape.

Starlette's middleware refuses a preflight from an origin, method or header the server does not
allow with a plain-text 400 (``Disallowed CORS origin``); every other refusal of this server is
the JSON error body clients parse, so the preflight's is too.  The browser enforces the policy
either way; the body only tells whoever reads it (a developer's console, a probe) why.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from lightllm.server.http.errors import INVALID_REQUEST, error_body

# Starlette's names for what a preflight asked for that is not allowed.
_WHAT = {"origin": "the origin is not in --allowed_origins", "method": "the method is not allowed",
         "headers": "a requested header is not allowed", "private-network": "private network access is not allowed"}


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
