"""Measures how long requests wait for their prompt to be prefilled, for /metrics.

A request's prefill wait runs from the moment the backend receives it to the step that
completes its prompt (the step that samples its first token).  It is measured on two clocks:
processed prefill tokens (the clock of ``--prefill_max_wait_tokens``, so the histogram shows
directly how close waits come to the bound) and wall seconds of this rank.  Plain Python: the
rank process feeds it and copies :meth:`fields` into the shared stats block.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Iterable, List, Tuple

from lightllm.server.core.objs.prefill_wait_histogram import (
    LONGEST_TOKENS_FIELD,
    LONGEST_US_FIELD,
    TOKEN_FIELDS,
    US_FIELDS,
    WAIT_TOKEN_BUCKETS,
    WAIT_US_BUCKETS,
    bucket_increments,
)
from lightllm.server.router.model_infer.infer_req import InferReq
from lightllm.server.router.model_infer.mode_backend.prefill_queue_strategy.waiting_bound import (
    prefill_waited_tokens,
)


class PrefillWaitTracker:
    """Histogram of completed prefill waits and the longest wait still running.

    Args:
        clock: seconds source (monotonic); injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._arrival_s: Dict[int, float] = {}
        # Cumulative bucket counts (one per bound, then +Inf) and the sum, per clock.
        self._tokens = [0] * (len(WAIT_TOKEN_BUCKETS) + 2)
        self._us = [0] * (len(WAIT_US_BUCKETS) + 2)
        self.longest_tokens = 0
        self.longest_us = 0

    def on_arrival(self, req: InferReq) -> None:
        """The backend received ``req`` (call right after ``add_request``)."""
        self._arrival_s[req.request_id] = self._clock()

    def on_step(
        self,
        emitted: Iterable[InferReq],
        released: Iterable[InferReq],
        live: Iterable[InferReq],
        processed_prefill_tokens: int,
    ) -> List[Tuple[int, float]]:
        """Account for one step; return the ``(tokens, seconds)`` waits completed in it.

        ``emitted`` are the requests that got a token this step (a request whose first token it
        is has just finished its prefill wait), ``released`` those that left the backend, ``live``
        those still held.  Afterwards the longest current wait is that of the live requests
        without a first token.
        """
        now = self._clock()
        completed: List[Tuple[int, float]] = []
        for req in emitted:
            if len(req.output_ids) != 1 or req.request_id not in self._arrival_s:
                continue
            tokens = prefill_waited_tokens(req, processed_prefill_tokens)
            seconds = max(0.0, now - self._arrival_s[req.request_id])
            self._observe(tokens, seconds)
            completed.append((tokens, seconds))
            # The wait is over; only the arrival time of requests still waiting is kept.
            del self._arrival_s[req.request_id]
        for req in released:
            self._arrival_s.pop(req.request_id, None)
        longest_tokens, longest_s = 0, 0.0
        for req in live:
            if req.output_ids or req.request_id not in self._arrival_s:
                continue
            longest_tokens = max(longest_tokens, prefill_waited_tokens(req, processed_prefill_tokens))
            longest_s = max(longest_s, now - self._arrival_s[req.request_id])
        self.longest_tokens = longest_tokens
        self.longest_us = int(longest_s * 1e6)
        return completed

    def _observe(self, tokens: int, seconds: float) -> None:
        us = int(seconds * 1e6)
        for counts, value, bounds in ((self._tokens, tokens, WAIT_TOKEN_BUCKETS), (self._us, us, WAIT_US_BUCKETS)):
            for i, inc in enumerate(bucket_increments(value, bounds)):
                counts[i] += inc
            counts[-1] += value  # the sum

    @property
    def completed_count(self) -> int:
        """Prefill waits observed so far."""
        return self._tokens[-2]

    def fields(self) -> Dict[str, int]:
        """Values of the shared stats fields (see ``prefill_wait_histogram.PREFILL_WAIT_FIELDS``)."""
        values = {LONGEST_TOKENS_FIELD: self.longest_tokens, LONGEST_US_FIELD: self.longest_us}
        values.update(zip(TOKEN_FIELDS, self._tokens))
        values.update(zip(US_FIELDS, self._us))
        return values
