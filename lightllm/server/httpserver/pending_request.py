"""One request's state in the HTTP process: detokenized output in, token events out."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, List, Optional

from lightllm.server.core.objs.io_messages import DetokenizedOutput
from lightllm.server.httpserver.metrics import ServerMetrics
from lightllm.server.httpserver.request_counting import RequestCounting
from lightllm.server.manager_errors import ServerUnavailableError
from lightllm.server.request_manager import GenerationEvent

# How often a running request asks whether its client is still connected, whether or not
# tokens are flowing: a client that walked away is noticed within this time.
DISCONNECT_CHECK_SECONDS = 0.5

# Put in a request's queue to wake it when the server fails every pending request.
_FAILED = object()
# Put in a request's queue by its timer: time to ask whether the client is still connected.
_CHECK_CLIENT = object()


def _prompt_logprobs(entries: Optional[List[Any]]) -> Optional[List[Any]]:
    if entries is None:
        return None
    # (token_id, logprob, top alternatives, rank in the full distribution or None)
    return [(token_id, logprob, dict(top), rank[0] if rank else None) for token_id, logprob, top, *rank in entries]


class PendingRequest:
    """A submitted request's queue of events, filled by the receiver and drained by :meth:`events`."""

    def __init__(self, prompt_tokens: int, slot: int = -1, counting: RequestCounting = RequestCounting.FULL):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_tokens = prompt_tokens
        self.slot = slot
        # Which metrics counters this request feeds (decided from its spec by the manager).
        self.counting = counting
        # CLOCK_MONOTONIC ns of submission and of rank 0 first scheduling it (0: not yet).
        self.arrival_ns = 0
        self.scheduled_ns = 0
        self.completion_tokens = 0
        # Tokens the client took (counted by the metrics as they went); the rest stayed queued.
        self.taken_tokens = 0
        self.first_token_seconds: Optional[float] = None  # since submission, for /metrics
        self.finished = False
        self.failure: Optional[ServerUnavailableError] = None

    def deliver(self, message: DetokenizedOutput) -> None:
        """Queue one event per token of ``message`` (or one token-less event that only finishes)."""
        if self.finished:
            return
        tokens = message.tokens
        if not tokens and message.finish_reason is not None:
            self.finished = True
            self.queue.put_nowait(
                GenerationEvent(message.request_id, -1, "", 0.0, message.finish_reason, self.prompt_tokens,
                                message.prompt_cache_len, self.completion_tokens, stop_reason=message.stop_reason)
            )
            return
        for i, token in enumerate(tokens):
            self.completion_tokens += 1
            last = i == len(tokens) - 1
            self.queue.put_nowait(
                GenerationEvent(
                    message.request_id,
                    token.token_id,
                    token.text,
                    token.logprob,
                    message.finish_reason if last else None,
                    self.prompt_tokens,
                    message.prompt_cache_len,
                    self.completion_tokens,
                    None if token.top_logprobs is None else dict(token.top_logprobs),
                    _prompt_logprobs(message.prompt_logprobs) if i == 0 else None,
                    message.stop_reason if last else None,
                )
            )
        if message.finish_reason is not None:
            self.finished = True

    def post(self, item: Any) -> bool:
        """Queue an item the manager's owner addressed to this request (yielded as is, in arrival
        order with the tokens); False once the request finished."""
        if self.finished:
            return False
        self.queue.put_nowait(item)
        return True

    @property
    def queue_seconds(self) -> Optional[float]:
        """Submission to first scheduling, None while (or if never) scheduled."""
        if not self.scheduled_ns or not self.arrival_ns:
            return None
        return max(0, self.scheduled_ns - self.arrival_ns) / 1e9

    def fail(self, failure: ServerUnavailableError) -> bool:
        """End the request with ``failure`` unless it already ended; True if it was ended now."""
        if self.finished or self.failure is not None:
            return False
        self.failure = failure
        self.queue.put_nowait(_FAILED)
        return True

    async def events(self, request: Any, started: float, metrics: ServerMetrics) -> AsyncIterator[Any]:
        """The request's token events until it finishes, fails, or its client disconnects, with
        any :meth:`post`-ed item in its place among them.

        The client (``request``, None: never asked) is asked at once and then every ``DISCONNECT_CHECK_SECONDS``
        whether tokens are flowing or not, so a walk-away client of a long generation is
        noticed within that time. ``started`` (``perf_counter``) times the first token.
        """
        # One timer per check interval puts a marker in the queue, rather than a timeout around
        # every wait: ``wait_for`` per token cost a task and a timer handle per token per request.
        timer: Optional[asyncio.TimerHandle] = None
        loop = asyncio.get_running_loop()
        if request is not None:
            # The first check at once: uvicorn stops reading a connection once its body is in, so
            # a client's close is seen only after a check resumed reading.  Checking first at
            # DISCONNECT_CHECK_SECONDS noticed a departure up to twice that late (a PD decode node
            # finished requests whose master had already given them up).
            self.queue.put_nowait(_CHECK_CLIENT)
        last_token_at: Optional[float] = None
        try:
            while True:
                event = self.queue.get_nowait() if not self.queue.empty() else await self.queue.get()
                if event is _FAILED:
                    return
                if event is _CHECK_CLIENT:
                    if await request.is_disconnected():
                        return
                    timer = loop.call_later(DISCONNECT_CHECK_SECONDS, self.queue.put_nowait, _CHECK_CLIENT)
                    continue
                if not isinstance(event, GenerationEvent):  # posted: the submitter reads it
                    yield event
                    continue
                now = time.perf_counter()
                if event.token_id >= 0:
                    self.taken_tokens += 1
                    if last_token_at is None:
                        self.first_token_seconds = now - started
                        metrics.on_first_token(self.first_token_seconds, event.cached_tokens, self.counting,
                                               self.prompt_tokens)
                    else:
                        metrics.on_next_token(now - last_token_at)
                    last_token_at = now
                if event.token_id >= 0 or event.finish_reason is not None:
                    yield event
                if event.finish_reason is not None:
                    return
        finally:
            if timer is not None:
                timer.cancel()
