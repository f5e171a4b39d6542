"""``GET /version`` and ``GET``/``POST /ping``: the service endpoints vLLM's OpenAI server has beside /health.

* ``GET /version`` answers ``{"version": <lightllm's package version>}`` (``lightllm.__version__``).
* ``/ping`` is the probe SageMaker sends (vLLM serves it on ``GET`` and ``POST``): it answers exactly
  what ``GET /health`` answers in the same app, status and body, by running that route. On a PD
  master ``/health`` is the master's own readiness (a prefill and a decode node alive), so /ping
  follows it there too. Like the other probes (:data:`~lightllm.server.http.service.health.PROBE_PATHS`)
  it needs no API key, and the front door answers a ``GET``/``HEAD`` of it on a fresh connection.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

import lightllm
from lightllm.server.http.errors import JSONErrorRoute
from lightllm.server.http.service.health import HEALTH_PATH, PING_PATH

VERSION_PATH = "/version"


class ServiceEndpoints:
    """``/version`` and ``/ping``."""

    def router(self) -> APIRouter:
        """An APIRouter with ``GET /version`` and ``GET``/``HEAD``/``POST /ping``."""
        router = APIRouter(route_class=JSONErrorRoute)
        router.add_api_route(VERSION_PATH, self.version, methods=["GET"])
        router.add_api_route(VERSION_PATH, self.version, methods=["HEAD"], include_in_schema=False)
        # One route per method, so each has an OpenAPI operation id of its own.
        for method in ("GET", "POST"):
            router.add_api_route(PING_PATH, self.ping, methods=[method])
        # HEAD as on /health: the front door answers it on a fresh connection, so the app must too.
        router.add_api_route(PING_PATH, self.ping, methods=["HEAD"], include_in_schema=False)
        return router

    async def version(self) -> Response:
        """``GET /version``."""
        return JSONResponse({"version": lightllm.__version__})

    async def ping(self, request: Request) -> Response:
        """``/ping``: the app's own answer to ``GET /health`` (``HEAD`` for ``HEAD``)."""
        method = "HEAD" if request.method == "HEAD" else "GET"
        # The same request asking for /health, routed through the app's router as any request is, so
        # whichever route serves /health there (a PD master's own comes first) answers it. The probe
        # routes read no body and no query.
        scope = {**request.scope, "method": method, "path": HEALTH_PATH, "raw_path": HEALTH_PATH.encode("ascii"),
                 "query_string": b""}
        answer = _CapturedResponse()
        await request.app.router(scope, request.receive, answer.send)
        return answer.response()


class _CapturedResponse:
    """An ASGI ``send`` that keeps the response it is given, to answer it again as a :class:`Response`."""

    def __init__(self) -> None:
        self.status = 500
        self.headers: List[Tuple[bytes, bytes]] = []
        self.body: List[bytes] = []

    async def send(self, message: Dict[str, Any]) -> None:
        """Record one ASGI response message."""
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
        elif message["type"] == "http.response.body":
            self.body.append(message.get("body", b""))

    def response(self) -> Response:
        """The recorded response (its headers, content-length and content-type included, as they were)."""
        response = Response(content=b"".join(self.body), status_code=self.status)
        response.raw_headers = self.headers
        return response
