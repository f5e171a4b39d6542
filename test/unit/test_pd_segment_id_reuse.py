"""A PD node takes a request's next segment under the same id once the previous one released it."""

from __future__ import annotations

import asyncio
import types

from lightllm.server.httpserver.manager import HttpServerManager


def _manager_with_live(request_ids):
    # Only the live-id table matters to this wait; the rest of the manager is not involved.
    return types.SimpleNamespace(_live={request_id: 3 for request_id in request_ids})


def test_the_next_segment_waits_for_the_previous_release() -> None:
    manager = _manager_with_live([8])

    async def scenario() -> bool:
        async def release_soon() -> None:
            await asyncio.sleep(0.05)
            del manager._live[8]  # the previous segment's slot release arrives

        releaser = asyncio.create_task(release_soon())
        free = await HttpServerManager.wait_request_id_free(manager, 8, timeout=5.0)
        await releaser
        return free

    assert asyncio.run(scenario()) is True


def test_an_id_still_held_after_the_bound_is_reported_in_use() -> None:
    manager = _manager_with_live([8])
    assert asyncio.run(HttpServerManager.wait_request_id_free(manager, 8, timeout=0.05)) is False
    assert asyncio.run(HttpServerManager.wait_request_id_free(manager, 9, timeout=0.05)) is True
