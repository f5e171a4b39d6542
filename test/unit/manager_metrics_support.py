"""An HttpServerManager whose generate() runs over a slot pool and router that accept everything."""

from __future__ import annotations

import types
from typing import Any, Optional, Tuple

from lightllm.server.httpserver.manager import HttpServerManager
from lightllm.server.httpserver.metrics import ServerMetrics
from lightllm.server.request_gate import RequestGate


class _Slots:
    async def take(self, wait_seconds: Optional[float] = None, wants_top: bool = False) -> Tuple[int, Optional[int]]:
        return 0, None

    async def put(self, slot: int) -> None:
        pass


class _Router:
    async def send_pyobj(self, message: Any) -> None:
        pass


def manager_over(metrics: ServerMetrics, shm: Any = None) -> HttpServerManager:
    """The manager's generate() over slot 0 of ``shm`` (default: a record store that keeps nothing
    and reports every request unscheduled), a router that takes every message, and ``metrics``."""
    manager = HttpServerManager.__new__(HttpServerManager)
    manager.vocab_size, manager.max_req_total_len = 100, 64
    manager._gate, manager._slots, manager.to_router = RequestGate(), _Slots(), _Router()
    manager.shm = shm or types.SimpleNamespace(write_request=lambda *args: None, scheduled_ns=lambda *args: 0)
    manager._pending, manager._live, manager._id_freed = {}, {}, {}
    manager._next_request_id, manager._active_generations, manager._backend_alive = 1, 0, True
    manager.metrics, manager._prefix_cache = metrics, True
    return manager
