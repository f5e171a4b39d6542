"""A PD node takes a request's next segment under the same id once the previous one released it.

The wait ends when the release arrives (an event set by the manager's release path), not at
the next tick of a poll; an id still held at the bound is reported in use.
"""

from __future__ import annotations

import asyncio
import types

from manager_metrics_support import manager_over

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.io_messages import NewRequest
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.httpserver.manager import HttpServerManager
from lightllm.server.httpserver.metrics import ServerMetrics


async def _submit_and_leave(manager: HttpServerManager, request_id: int) -> None:
    """Submit ``request_id`` and leave before its first token: its id stays live until its slot's release."""
    spec = RequestSpec.build([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=8))
    events = manager.generate(spec, request_id=request_id)
    first = asyncio.ensure_future(events.__anext__())
    sent = manager.sockets.to_router.sent
    while not any(isinstance(message, NewRequest) and message.request_id == request_id for message in sent):
        await asyncio.sleep(0)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await events.aclose()


def _manager_with_live(request_ids) -> HttpServerManager:
    """A manager whose ``request_ids`` were submitted on slot 3 and not yet released.

    Its records keep nothing and free no slot on release (the slot stays out of the pool); only the
    live ids and the release path matter to this wait.
    """
    shm = types.SimpleNamespace(write_request=lambda *args: None, scheduled_ns=lambda *args: 0,
                                release=lambda slot, request_id: False)
    manager = manager_over(ServerMetrics("default", None), shm, slot=3)

    async def submit() -> None:
        for request_id in request_ids:
            await _submit_and_leave(manager, request_id)

    asyncio.run(submit())
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
