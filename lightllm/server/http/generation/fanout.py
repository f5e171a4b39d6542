"""Fan-out of one API request into concurrent generations, and server-sent-event helpers.

Each choice of a request (every prompt times ``n``) is one ``manager.generate`` call;
:class:`GenerationFanout` runs them concurrently and merges their token events.  Every call is
primed (its first event awaited) before any response byte is sent, so a request the manager
refuses still gets a proper 400/503 status even when streaming.

A client that leaves gets one INFO line per API request here, with the number of its generations
that were aborted (:meth:`GenerationFanout.client_left`); the request manager logs each aborted
generation at debug only, since one request may run hundreds (32 prompts times ``n`` 16).  The
aborts are counted on ``/metrics`` as ``finish_reason="abort"`` either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from lightllm.common.sampling import SamplingParams
from lightllm.server.http.errors import (APIError, client_closed_request, generation_failed, grammar_failed,
                                         internal_error, manager_error)
from lightllm.server.core.objs.finish_status import FINISH_ERROR, FINISH_GRAMMAR_FAILED, FINISH_REASON_NAMES
from lightllm.server.core.objs.request_spec import Priority, RequestSpec
from lightllm.server.request_manager import RequestManager

logger = logging.getLogger(__name__)

# The finish reasons of a request the model rank could not finish, and the client's answer to each:
# the server failed (500), or the request's own structured-output grammar could not go on (400).
_FAILURE_ANSWERS = {
    FINISH_REASON_NAMES[FINISH_ERROR]: generation_failed,
    FINISH_REASON_NAMES[FINISH_GRAMMAR_FAILED]: grammar_failed,
}


def _is_error(event: Any) -> bool:
    return getattr(event, "finish_reason", None) in _FAILURE_ANSWERS


def _failure_answer(event: Any) -> APIError:
    return _FAILURE_ANSWERS[event.finish_reason]()


def sse(payload: dict[str, Any]) -> bytes:
    """Encode one server-sent event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode("utf-8")


@dataclass
class ChoiceJob:
    """One generation: a tokenized prompt, its sampling params and its choice index."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    # Prompt tokens the prefix cache held, from the first event (GenerationFanout.start): known once
    # the prompt is prefilled, so before any byte of the response is sent.
    cached_tokens: int = 0


class GenerationFanout:
    """Runs one ``manager.generate`` per job concurrently and merges their events."""

    def __init__(self, manager: RequestManager, jobs: list[ChoiceJob], *, high_priority: bool = False,
                 request: Request | None = None, label: str | None = None) -> None:
        self._manager = manager
        self._jobs = jobs
        self._high_priority = high_priority
        self._request = request
        # How the departure line names the request: its response id when the route has one.
        self._label = label
        # Slots whose generation finished (a finish reason arrived): not aborted when the client leaves.
        self._finished: set[int] = set()
        self._left = False
        self._iterators: list[Any] = []
        self._first: list[Any] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def _open(self, job: ChoiceJob) -> Any:
        # The request enters the server here, as one spec per choice.
        spec = RequestSpec(job.prompt_ids, job.params, Priority(high_priority_request=self._high_priority))
        result = self._manager.generate(spec, request=self._request)
        if inspect.isawaitable(result):
            result = await result
        return result.__aiter__()

    async def start(self) -> None:
        """Open every generation and wait for its first event; raise APIError if any fails."""
        try:
            for job in self._jobs:
                # Every choice (n, best_of) counts its prompt in the server's token counters: each
                # is a sequence of its own, and vLLM (0.32) counts a prompt once per sequence too.
                self._iterators.append(await self._open(job))
            firsts = await asyncio.gather(*(it.__anext__() for it in self._iterators), return_exceptions=True)
        except Exception as exc:
            await self.close()
            raise manager_error(exc) from None
        except BaseException:
            await self.close()
            raise
        failure = next((item for item in firsts if isinstance(item, BaseException)), None)
        if failure is None:
            failure = next((_failure_answer(item) for item in firsts if _is_error(item)), None)
        self._finished.update(slot for slot, item in enumerate(firsts)
                              if getattr(item, "finish_reason", None) is not None)
        if failure is None:
            self._first = list(firsts)
            for job, first in zip(self._jobs, firsts):
                job.cached_tokens = getattr(first, "cached_tokens", 0) or 0
            return
        await self.close()
        if isinstance(failure, StopAsyncIteration):
            # The manager ends a generation without a finish only for a client that went away:
            # an everyday event, not a server fault (nobody reads the answer; the access log does).
            if self._request is not None and await self._request.is_disconnected():
                self.client_left()
                raise client_closed_request()
            logger.warning("the request manager ended a generation before its first event")
            raise internal_error()
        if not isinstance(failure, Exception):
            raise failure
        raise manager_error(failure) from None

    async def _choice_items(self, slot: int) -> AsyncIterator[Any]:
        """One generation's items as :meth:`events` reads them: its events, then None at its end,
        or an exception (which ends the whole response)."""
        event = None
        try:
            event = self._first[slot]
            while True:
                if _is_error(event):
                    # Tokens before the failure are delivered; then the client gets an error.
                    if event.token_id >= 0:
                        yield dataclasses.replace(event, finish_reason=None)
                    yield _failure_answer(event)
                    return
                yield event
                if event.finish_reason is not None:
                    self._finished.add(slot)
                    # Closed now, not with the whole request: its manager counts it as running (the
                    # metrics, a drain) and times it until its generation is closed, and the other
                    # choices of an n > 1 request may run long after this one.
                    await _close_generation(self._iterators[slot])
                    break
                event = await self._iterators[slot].__anext__()
        except StopAsyncIteration:
            # The manager stops without a finish event only when the client went away.
            logger.debug("request %s: generation for choice %d ended without a finish reason (its client went away)",
                         getattr(event, "request_id", "?"), self._jobs[slot].index)
            self.client_left()
        except Exception as exc:  # noqa: BLE001 - forwarded to the consumer, which reports it
            yield exc
            return
        yield None

    async def _pump(self, slot: int, queue: asyncio.Queue[tuple[int, Any]]) -> None:
        async for item in self._choice_items(slot):
            await queue.put((slot, item))

    async def _merged_items(self) -> AsyncIterator[tuple[int, Any]]:
        if len(self._jobs) == 1:
            # One choice, the common case: read it in place, without a pump task and a queue
            # hop per token.
            items = self._choice_items(0)
            try:
                async for item in items:
                    yield 0, item
            finally:
                await items.aclose()
            return
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(slot, queue)) for slot in range(len(self._jobs))]
        while True:
            yield await queue.get()

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        """Yield ``(choice_index, event)`` until every generation has finished.

        Raises the APIError of the first generation that fails.
        """
        items = self._merged_items()
        remaining = len(self._jobs)
        try:
            while remaining:
                slot, item = await items.__anext__()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise manager_error(item)
                else:
                    yield self._jobs[slot].index, item
        finally:
            await items.aclose()
            await self.close()

    async def collect(self) -> dict[int, list[Any]]:
        """All events of every choice, keyed by choice index."""
        collected: dict[int, list[Any]] = {job.index: [] for job in self._jobs}
        try:
            async for index, event in self.events():
                collected[index].append(event)
        finally:
            await self.close()
        return collected

    def client_left(self) -> None:
        """Log, once per API request, that its client went away and how many of its generations are
        aborted (those without a finish reason yet); nothing when every one had finished."""
        if self._left:
            return
        self._left = True
        aborted = len(self._jobs) - len(self._finished)
        if aborted <= 0:
            return
        if self._label is not None:
            name = f"request {self._label}"
        else:
            path = self._request.scope.get("path", "?") if self._request is not None else "?"
            name = f"a {path} request"
        logger.info("%s: its client went away; aborting %d of its %d generation%s", name, aborted, len(self._jobs),
                    "" if len(self._jobs) == 1 else "s")

    async def close(self) -> None:
        """Stop pumping and close every generation (the manager aborts unfinished ones)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except BaseException:  # noqa: BLE001 - cancellation of our own tasks is expected
                pass
        self._tasks = []
        for iterator in self._iterators:
            await _close_generation(iterator)
        self._iterators = []


async def _close_generation(iterator: Any) -> None:
    """Close one ``manager.generate`` iterator (the manager aborts it unless it finished); closing
    it again does nothing."""
    closer = getattr(iterator, "aclose", None)
    if closer is not None:
        try:
            await closer()
        except Exception:  # noqa: BLE001 - closing must not mask the real outcome
            logger.exception("closing a generation failed")


def sse_response(stream: AsyncIterator[bytes], fanout: GenerationFanout) -> StreamingResponse:
    """Stream ``stream`` as server-sent events, closing ``fanout``'s generations however it ends.

    A client disconnect closes the body iterator while it waits at a ``yield``; an
    ``async for`` does not close the iterators below it, so the fanout is closed here
    explicitly (and once more after the response, in case the body never started).
    """

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                yield chunk
        except (GeneratorExit, asyncio.CancelledError):
            # The response was torn down mid-stream: its client went away (the server's own
            # failures arrive as exceptions of the stream instead).
            fanout.client_left()
            raise
        finally:
            await fanout.close()

    return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(fanout.close),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
