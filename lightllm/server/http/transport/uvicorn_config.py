"""The uvicorn configuration of a server's public port: the guarded protocol and its limits.

Kept apart from :mod:`~lightllm.server.http.server_options` (plain settings) because it ties the
settings to the protocol class, which itself reads those settings.

A client is its socket's peer address (the rule of docs/EN/limits_and_auth.md, "Client address"):
uvicorn's proxy-header rewriting is off, so ``scope["client"]`` is the address the front door
counted the connection under, and ``X-Forwarded-For`` / ``X-Forwarded-Proto`` from any peer
change nothing (uvicorn's default trusted them from 127.0.0.1, letting a local client pick a fresh
address per request).  uvicorn's ``FORWARDED_ALLOW_IPS`` is not read then; a start with it set
gets a warning saying so (``environment_check.unread_variable_warnings``).
"""

from __future__ import annotations

import argparse
from typing import Any

import uvicorn

from lightllm.server.http.log_throttle import throttle_uvicorn_request_errors
from lightllm.server.http.transport.protocol import guarded_protocol_class
from lightllm.server.http.server_options import HttpServerOptions


# A client is the socket peer: no X-Forwarded-* rewriting of scope["client"] / scope["scheme"], and
# an explicit empty trust list, so uvicorn does not read FORWARDED_ALLOW_IPS either.
CLIENT_ADDRESS_SETTINGS: dict[str, Any] = dict(proxy_headers=False, forwarded_allow_ips=[])


def build_uvicorn_config(app: Any, args: argparse.Namespace, options: HttpServerOptions, **overrides: Any) -> Any:
    """The uvicorn config serving ``app`` on ``--host:--port`` through the guarded HTTP/1.1 protocol.

    ``overrides`` are passed to ``uvicorn.Config`` as they are (e.g. ``timeout_graceful_shutdown``),
    except the client-address settings, which no caller may change.
    """
    fixed = CLIENT_ADDRESS_SETTINGS.keys() & overrides.keys()
    if fixed:
        raise ValueError(f"build_uvicorn_config: {', '.join(sorted(fixed))} cannot be overridden: a client is "
                         "its socket's peer address")
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
    settings.update(CLIENT_ADDRESS_SETTINGS)
    return uvicorn.Config(app, **settings)
