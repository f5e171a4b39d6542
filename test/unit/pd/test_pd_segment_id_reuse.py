"""A PD node takes a request's next segment under the same id once the previous one released it.

The wait ends when the release arrives (an event set by the manager's release path), not at
the next tick of a poll; an id still held at the bound is reported in use.
"""

from __future__ import annotations

import asyncio
import types

from lightllm.server.httpserver.manager import HttpServerManager


def _manager_with_live(request_ids) -> HttpServerManager:
    # Only the live-id table and the release path matter to this wait; the rest is not built.
    manager = HttpServerManager.__new__(HttpServerManager)
    manager._live = {request_id: 3 for request_id in request_ids}
    manager._id_freed = {}
    manager.shm = types.SimpleNamespace(release=lambda slot, request_id: False)  # the slot stays out of the pool
    return manager


def test_the_next_segment_waits_for_the_previous_release() -> None:
    manager = _manager_with_live([8])

    async def scenario() -> tuple:
        waiter = asyncio.create_task(manager.wait_request_id_free(8, timeout=5.0))
        await asyncio.sleep(0)
        waiting_before_release = not waiter.done()
        await manager._release_slot(8, 3)  # the previous segment's slot release arrives
        free = await asyncio.wait_for(waiter, 5.0)
        return waiting_before_release, free

    assert asyncio.run(scenario()) == (True, True)
    assert manager._id_freed == {}


def test_a_release_of_another_slot_does_not_free_the_id() -> None:
    manager = _manager_with_live([8])

    async def scenario() -> bool:
        waiter = asyncio.create_task(manager.wait_request_id_free(8, timeout=0.2))
        await asyncio.sleep(0)
        await manager._release_slot(8, 4)  # a stale release naming another slot
        return await waiter

    assert asyncio.run(scenario()) is False
    assert 8 in manager._live


def test_an_id_still_held_after_the_bound_is_reported_in_use() -> None:
    manager = _manager_with_live([8])
    assert asyncio.run(manager.wait_request_id_free(8, timeout=0.05)) is False
    assert asyncio.run(manager.wait_request_id_free(9, timeout=0.05)) is True
