"""A client that leaves a request of many generations gets one INFO line, not one per generation.

Five ``{"prompt": ["x"] * 32, "n": 16}`` requests whose client closed after 0.3 s wrote 2,402 lines
(one per generation) before; now each API request logs once, with the count of generations aborted.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

import pytest

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.http.errors import APIError
from lightllm.server.http.generation.fanout import GenerationFanout, sse_response
from lightllm.server.http.generation.planning import choice_jobs
from lightllm.server.request_manager import GenerationEvent

FANOUT_LOGGER = "lightllm.server.http.generation.fanout"


class GoneClient:
    scope = {"path": "/generate"}

    async def is_disconnected(self) -> bool:
        return True


class LeavingManager:
    """Each generation yields ``tokens`` tokens (choice 0 finishes after its first), then ends without a
    finish reason, as the request manager ends a generation whose client went away."""

    def __init__(self, tokens: int) -> None:
        self._tokens = tokens
        self._calls = 0

    async def generate(self, spec: RequestSpec, *, request: Any = None) -> AsyncIterator[GenerationEvent]:
        choice = self._calls
        self._calls += 1
        for index in range(self._tokens):
            finish = "stop" if choice == 0 else None
            yield GenerationEvent(choice, 5, "a", -0.1, finish, 3, 0, index + 1)
            if finish:
                return
            await asyncio.sleep(0)


def _jobs(prompts: int, n: int) -> list:
    jobs = []
    for prompt in range(prompts):
        jobs += choice_jobs(prompt * n, [1, 2, 3], SamplingParams(max_new_tokens=50), n)
    return jobs


def _departures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.levelno >= logging.INFO and "went away" in record.getMessage()]


def test_a_request_of_512_generations_whose_client_left_mid_answer_logs_one_line(caplog) -> None:
    async def scenario() -> None:
        fanout = GenerationFanout(LeavingManager(tokens=3), _jobs(32, 16), label="cmpl-abc")  # type: ignore[arg-type]
        await fanout.start()
        await fanout.collect()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(scenario())
    # Choice 0 finished before the client left: it is not counted as aborted.
    assert _departures(caplog) == ["request cmpl-abc: its client went away; aborting 511 of its 512 generations"]


def test_a_request_whose_client_left_before_its_first_token_logs_one_line(caplog) -> None:
    async def scenario() -> None:
        fanout = GenerationFanout(LeavingManager(tokens=0), _jobs(4, 4), request=GoneClient())  # type: ignore[arg-type]
        with pytest.raises(APIError) as refused:
            await fanout.start()
        assert refused.value.status_code == 499

    with caplog.at_level(logging.DEBUG):
        asyncio.run(scenario())
    assert _departures(caplog) == ["a /generate request: its client went away; aborting 16 of its 16 generations"]


def test_a_stream_torn_down_by_its_client_logs_one_line(caplog) -> None:
    async def scenario() -> None:
        fanout = GenerationFanout(LeavingManager(tokens=1000), _jobs(2, 2), label="chatcmpl-x")  # type: ignore[arg-type]
        await fanout.start()

        async def stream() -> AsyncIterator[bytes]:
            async for _ in fanout.events():
                yield b"data: {}\n\n"

        body = sse_response(stream(), fanout).body_iterator
        await body.__anext__()
        await body.aclose()  # as the server does when the connection is lost

    with caplog.at_level(logging.DEBUG):
        asyncio.run(scenario())
    assert _departures(caplog) == ["request chatcmpl-x: its client went away; aborting 3 of its 4 generations"]
