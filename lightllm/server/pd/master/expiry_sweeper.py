"""The master's background task that drops silent nodes even when no request looks at them.

:class:`~.node_registry.NodeRegistry` also expires lazily on every query, but a node that dies
while the master is idle must still be dropped on time so its in-flight requests fail within
the bound; the sweeper checks every half heartbeat interval.  Since a check is then due every
period, the registry takes a longer gap between checks for a stall of the master itself and
does not count it against the nodes (:meth:`~.node_registry.NodeRegistry.watch_for_stalls`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from lightllm.server.pd.master.node_registry import NodeRegistry

logger = logging.getLogger(__name__)


class ExpirySweeper:
    """Runs ``registry.expire()`` every ``period_s`` seconds on the master's event loop."""

    def __init__(self, registry: NodeRegistry, period_s: Optional[float] = None) -> None:
        self.registry = registry
        self.period_s = period_s if period_s is not None else registry.heartbeat_interval_s / 2
        if not self.period_s > 0:
            raise ValueError(f"period_s must be > 0, got {self.period_s!r}")
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        """Start sweeping on the running event loop (call from a coroutine, once)."""
        if self._task is not None:
            raise RuntimeError("the expiry sweeper is already running")
        # From now on a check is due every period, so a longer gap is a stall of the master itself.
        self.registry.watch_for_stalls(self.period_s)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pd-node-expiry")

    async def stop(self) -> None:
        """Stop sweeping and wait for the task to end."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                self.registry.expire()
            except Exception:  # noqa: BLE001 - keep sweeping; a crash here would hide dead nodes
                logger.exception("PD node expiry sweep failed")
