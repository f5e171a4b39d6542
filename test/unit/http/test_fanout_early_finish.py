"""A choice of an n > 1 request that finishes first is closed at once, not when the request ends:
its manager counts it as running (metrics, a drain) and times it until then."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.http.generation.fanout import GenerationFanout
from lightllm.server.http.generation.planning import choice_jobs
from lightllm.server.request_manager import GenerationEvent


class TwoSpeedManager:
    """Choice 0 ends after one token; choice 1 goes on until choice 0's generation was closed."""

    def __init__(self) -> None:
        self.closed: list[tuple[int, str]] = []  # (choice, finish reason) as each generation closes
        self.first_closed = asyncio.Event()
        self._calls = 0

    async def generate(self, spec: RequestSpec, *, request: Any = None) -> AsyncIterator[GenerationEvent]:
        choice = self._calls
        self._calls += 1
        reason = None
        try:
            if choice == 1:
                yield GenerationEvent(choice, 5, "a", -0.1, None, 3, 0, 1)
                # A hang guard only: on the code before, choice 0 stayed open until this one ended.
                await asyncio.wait_for(self.first_closed.wait(), 30)
            reason = "length" if choice == 1 else "stop"
            yield GenerationEvent(choice, 6, "b", -0.1, reason, 3, 0, 2 if choice == 1 else 1)
        finally:
            self.closed.append((choice, reason or "abort"))
            if choice == 0:
                self.first_closed.set()


def test_a_finished_choice_is_closed_while_the_others_still_run() -> None:
    async def scenario() -> tuple[TwoSpeedManager, dict[int, list[Any]]]:
        manager = TwoSpeedManager()
        jobs = choice_jobs(0, [1, 2, 3], SamplingParams(max_new_tokens=2), 2)
        fanout = GenerationFanout(manager, jobs)  # type: ignore[arg-type]
        await fanout.start()
        return manager, await fanout.collect()

    manager, collected = asyncio.run(scenario())
    # Choice 0 closed (finished, not aborted) before choice 1 could end.
    assert manager.closed == [(0, "stop"), (1, "length")]
    assert [event.finish_reason for event in collected[0]] == ["stop"]
    assert [event.finish_reason for event in collected[1]] == [None, "length"]
