"""The HTTP process's two sockets: requests and aborts out to the router, messages into its inbox."""

from __future__ import annotations

from typing import Any, Optional

import zmq
import zmq.asyncio

from lightllm.utils.process_utils import zmq_socket


class HttpSockets:
    """Where :class:`~lightllm.server.httpserver.manager.HttpServerManager` sends new requests and
    aborts (``to_router``, connected to ``router_address``) and receives the detokenizer's texts,
    slot releases and rank 0's messages (``inbox``, bound at ``http_address``).

    Opened by the manager's ``start()`` on the serving event loop, closed by its ``stop()``;
    ``to_router`` and ``inbox`` are None until then.
    """

    def __init__(self, router_address: str, http_address: str) -> None:
        self.router_address = router_address
        self.http_address = http_address
        self.zmq_ctx: Optional[zmq.asyncio.Context] = None
        self.to_router: Any = None
        self.inbox: Any = None

    def open(self) -> None:
        """Create the context, connect to the router and bind the inbox."""
        self.zmq_ctx = zmq.asyncio.Context()
        self.to_router = zmq_socket(self.zmq_ctx, zmq.PUSH, self.router_address, bind=False)
        self.inbox = zmq_socket(self.zmq_ctx, zmq.PULL, self.http_address, bind=True)

    def close(self) -> None:
        """Close both sockets at once (nothing queued is sent)."""
        self.zmq_ctx.destroy(linger=0)
