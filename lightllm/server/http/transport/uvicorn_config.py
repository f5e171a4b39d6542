"""The uvicorn configuration of a server's public port: the guarded protocol and its limits.

Kept apart from :mod:`~lightllm.server.http.server_options` (plain settings) because it ties the
settings to the protocol class, which itself reads those settings.
"""

from __future__ import annotations

import argparse
from typing import Any

import uvicorn

from lightllm.server.http.log_throttle import throttle_uvicorn_request_errors
from lightllm.server.http.transport.protocol import guarded_protocol_class
from lightllm.server.http.server_options import HttpServerOptions


def build_uvicorn_config(app: Any, args: argparse.Namespace, options: HttpServerOptions, **overrides: Any) -> Any:
    """The uvicorn config serving ``app`` on ``--host:--port`` through the guarded HTTP/1.1 protocol.

    ``overrides`` are passed to ``uvicorn.Config`` as they are (e.g. ``timeout_graceful_shutdown``).
    """
    throttle_uvicorn_request_errors()
    settings: dict[str, Any] = dict(
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        http=guarded_protocol_class(options.limits),
        ws="none",  # no WebSocket routes; the protocol serves an upgrade request as plain HTTP
        timeout_keep_alive=options.limits.keep_alive_timeout,
    )
    settings.update(overrides)
    return uvicorn.Config(app, **settings)
