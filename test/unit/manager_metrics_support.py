"""An HttpServerManager whose generate() runs over a slot pool and router that accept everything."""

from __future__ import annotations

import types
from typing import Any, List, Optional, Tuple

from lightllm.server.httpserver.manager import HttpServerManager
from lightllm.server.httpserver.metrics import ServerMetrics


class _Slots:
    """Slot ``slot`` for every request, at once (of a pool of ``slot_num``, no top-logprob rows)."""

    slot_num, top_slot_num = 2, 0

    def __init__(self, slot: int = 0) -> None:
        self.slot = slot

    async def take(self, wait_seconds: Optional[float] = None, wants_top: bool = False) -> Tuple[int, Optional[int]]:
        return self.slot, None

    async def put(self, slot: int) -> None:
        pass


class _Router:
    """Takes every message; keeps them in ``sent``."""

    def __init__(self) -> None:
        self.sent: List[Any] = []

    async def send_pyobj(self, message: Any) -> None:
        self.sent.append(message)


def served_double(vocab_size: int = 100, max_req_total_len: int = 64) -> Any:
    """What the manager reads of its served model: the limits a spec is checked against."""
    return types.SimpleNamespace(vocab_size=vocab_size, max_req_total_len=max_req_total_len)


def sockets_double() -> Any:
    """The manager's sockets as generate() uses them (never started): a router that takes every message."""
    return types.SimpleNamespace(to_router=_Router(), inbox=None)


def manager_over(metrics: ServerMetrics, shm: Any = None, slot: int = 0) -> HttpServerManager:
    """The manager's generate() over slot ``slot`` (default 0) of ``shm`` (default: a record store
    that keeps nothing and reports every request unscheduled), a router that takes every message
    (``manager.sockets.to_router.sent``), and ``metrics``."""
    shm = shm or types.SimpleNamespace(write_request=lambda *args: None, scheduled_ns=lambda *args: 0)
    return HttpServerManager(served_double(), shm, metrics, _Slots(slot), sockets_double())
