"""A FastAPI app served by uvicorn on a free loopback port, for tests of the clients that call it.

The clients are tested against a small real HTTP server (not lightllm's own): real sockets, real
streaming, answers the test chooses.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Dict, Iterator, List

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


@contextlib.contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run ``app`` on a free loopback port until the block ends; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "canned server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        sock.close()


def require_key(app: FastAPI, key: str, seen: List[Dict[str, Any]], message: str = "Missing API key") -> None:
    """Answer every request without ``Authorization: Bearer key`` with a 401 in OpenAI's error shape,
    as a server started with ``--api_key`` does; each request's path and header go to ``seen``."""

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        seen.append({"path": request.url.path, "authorization": request.headers.get("authorization")})
        if request.headers.get("authorization") != f"Bearer {key}":
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                           "code": "missing_api_key"}}, status_code=401)
        return await call_next(request)
