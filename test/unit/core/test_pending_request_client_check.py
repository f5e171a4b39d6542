"""A running request asks whether its client is still there at once, not only after the first interval.

uvicorn stops reading a connection once the request body is in; a client's close is seen only
after a check resumed reading, so a first check at 0.5 s noticed a departure up to 1 s late.
"""

from __future__ import annotations

import asyncio

from lightllm.server.httpserver.metrics import ServerMetrics
from lightllm.server.httpserver.pending_request import PendingRequest


class _Client:
    """A request whose client has already left."""

    def __init__(self) -> None:
        self.asked = 0

    async def is_disconnected(self) -> bool:
        self.asked += 1
        return True


def test_a_departed_client_ends_the_events_before_any_token_or_interval() -> None:
    async def run() -> tuple[int, list]:
        pending, client = PendingRequest(prompt_tokens=3), _Client()
        events = pending.events(client, 0.0, ServerMetrics("default", None))
        task = asyncio.ensure_future(_drain(events))
        # No token arrives and no timer is due: only a check made at once ends it within a few ticks.
        for _ in range(20):
            await asyncio.sleep(0)
        done = task.done()
        task.cancel()
        return client.asked, task.result() if done else None

    asked, received = asyncio.run(run())
    assert asked == 1 and received == []


async def _drain(events) -> list:
    return [event async for event in events]
