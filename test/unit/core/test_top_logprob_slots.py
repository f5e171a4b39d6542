"""The HTTP process's two slot pools: request records for all, top-logprob rows for those that ask.

A request that asks for top logprobs waits for a row within --slot_wait_seconds and is then
refused with the same ServerBusyError (503 server_busy) as for a request slot; a request that
does not ask never waits for a row.
"""

from __future__ import annotations

import asyncio

import pytest

from lightllm.server.httpserver.slot_pool import RequestSlots
from lightllm.server.manager_errors import ServerBusyError, ServerUnavailableError

WAIT = 0.01  # the pools' wait bound: short, only the refusal after it is checked


def _run(body) -> None:
    async def main() -> None:
        slots = RequestSlots(slot_num=3, top_slot_num=1, wait_seconds=WAIT)
        slots.start()
        await body(slots)

    asyncio.run(main())


def test_requests_without_top_logprobs_never_wait_for_a_top_row() -> None:
    async def body(slots: RequestSlots) -> None:
        assert await slots.take(wants_top=True) == (0, 0)
        # Every top row is taken; plain requests still get the remaining request slots.
        assert await slots.take() == (1, None)
        assert await slots.take(wants_top=False) == (2, None)

    _run(body)


def test_a_full_top_pool_refuses_busy_after_the_wait_and_keeps_no_request_slot() -> None:
    async def body(slots: RequestSlots) -> None:
        await slots.take(wants_top=True)
        with pytest.raises(ServerBusyError, match=r"^server is busy: all 1 shared-memory top-logprob slots "
                                                  r"\(--top_logprobs_slots\) are in use and none became free within 0.01 s$"):
            await slots.take(wants_top=True)
        with pytest.raises(ServerBusyError, match="top-logprob slots"):
            await slots.take(0, wants_top=True)
        # The refused requests hold nothing: both other request slots are still free.
        assert [await slots.take(), await slots.take()] == [(1, None), (2, None)]

    _run(body)


def test_the_top_row_comes_back_with_its_request_slot() -> None:
    async def body(slots: RequestSlots) -> None:
        slot, top = await slots.take(wants_top=True)
        waiter = asyncio.create_task(slots.take(10.0, wants_top=True))
        await asyncio.sleep(0)
        assert not waiter.done()
        await slots.put(slot)  # the detokenizer's release of the first request
        assert await waiter == (slot, top)

    _run(body)


def test_a_top_row_is_given_back_when_no_request_slot_frees() -> None:
    async def body(slots: RequestSlots) -> None:
        held = [await slots.take() for _ in range(3)]  # every request slot
        # The wait is shared with the top row's: the answer names the whole of it, not what was left.
        with pytest.raises(ServerBusyError, match=r"all 3 shared-memory request slots are in use and none became "
                                                  r"free within 0.01 s$"):
            await slots.take(wants_top=True)
        await slots.put(held[0][0])
        assert await slots.take(0, wants_top=True) == (held[0][0], 0)  # the row was not kept

    _run(body)


def test_failure_wakes_requests_waiting_for_a_top_row() -> None:
    async def body(slots: RequestSlots) -> None:
        await slots.take(wants_top=True)
        waiter = asyncio.create_task(slots.take(10.0, wants_top=True))
        await asyncio.sleep(0)
        # Counted once, in the pool it waits in: the shutdown's warning counts the generations it ends.
        assert slots.fail(ServerUnavailableError("backend died", "backend_failed")) == 1
        with pytest.raises(ServerUnavailableError, match="backend died"):
            await waiter
        assert slots.fail(ServerUnavailableError("backend died", "backend_failed")) == 0

    _run(body)


def test_a_layout_without_top_rows_refuses_at_once() -> None:
    async def main() -> None:
        slots = RequestSlots(slot_num=2, top_slot_num=0, wait_seconds=600.0)
        slots.start()
        with pytest.raises(ServerBusyError, match="keeps no shared-memory top-logprob slots"):
            await slots.take(wants_top=True)
        assert await slots.take() == (0, None)

    asyncio.run(main())
