"""A membership-only PD master (registration, heartbeats, readiness) served by uvicorn in a thread.

For tests of the node side of PD membership: real HTTP on loopback with the real registry and
membership router, without a model.
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, Dict, List, Optional, Tuple

import httpx
import uvicorn
from fastapi import FastAPI

from lightllm.server.http.errors import install_error_handlers
from lightllm.server.pd.master.expiry_sweeper import ExpirySweeper
from lightllm.server.pd.master.membership_api import membership_router, new_master_id, readiness_router
from lightllm.server.pd.master.node_registry import NodeRegistry


class MembershipMaster:
    """Registry + membership endpoints on a free loopback port; ``stop()`` ends it."""

    def __init__(self, heartbeat_interval_s: float, max_missed_heartbeats: int = 3) -> None:
        self.registry = NodeRegistry(heartbeat_interval_s=heartbeat_interval_s, max_missed_heartbeats=max_missed_heartbeats)
        # (node id, reason) of every node the registry dropped, in order.
        self.dropped: List[Tuple[str, str]] = []
        self.registry.add_drop_listener(lambda info, reason: self.dropped.append((info.node_id, reason)))
        sweeper = ExpirySweeper(self.registry)

        @asynccontextmanager
        async def lifespan(app: FastAPI):
            sweeper.start()
            yield
            await sweeper.stop()

        app = FastAPI(lifespan=lifespan)
        install_error_handlers(app)
        app.include_router(membership_router(self.registry, new_master_id()))
        app.include_router(readiness_router(self.registry))
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "membership master did not start"
            time.sleep(0.01)

    def nodes(self) -> List[Dict[str, Any]]:
        """The master's ``GET /pd/nodes`` list."""
        return httpx.get(f"{self.url}/pd/nodes", timeout=10).json()["nodes"]

    def wait_node(self, node_id_prefix: str, timeout: float = 30) -> Dict[str, Any]:
        """The first listed node whose id starts with ``node_id_prefix`` (polling, bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found: Optional[Dict[str, Any]] = next(
                (node for node in self.nodes() if node["node_id"].startswith(node_id_prefix)), None)
            if found is not None:
                return found
            time.sleep(0.1)
        raise TimeoutError(f"no node {node_id_prefix}* registered with the master in {timeout}s")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
