"""Measures how long requests wait for their prompt to be prefilled, for /metrics.

A request's prefill wait runs from the moment the backend receives it to the step that
completes its prompt (the step that samples its first token).  It is measured on two clocks:
processed prefill tokens (the clock of the overtaking bound) and wall seconds of this rank.  It
also records how many tokens of later work overtook each request before its first token, the
quantity the bound limits, so /metrics shows directly how close requests come to it.  Plain Python: the
rank process feeds it and copies :meth:`fields` into the shared stats block.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Iterable, List, Tuple

from lightllm.server.core.objs.prefill_wait_histogram import (
    BOUND_BASE_FIELD,
    BOUND_ENABLED_FIELD,
    BOUND_FRACTION_PPM_FIELD,
    LONGEST_OVERTAKEN_FIELD,
    OVERTAKEN_FIELDS,
    PROTECTED_FIELD,
    LONGEST_TOKENS_FIELD,
    LONGEST_US_FIELD,
    TOKEN_FIELDS,
    US_FIELDS,
    WAIT_TOKEN_BUCKETS,
    WAIT_US_BUCKETS,
    bucket_increments,
)
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec
from lightllm.server.model_rank.scheduling.request_state import ReqState


def prefill_waited_tokens(req: InferReq, processed_prefill_tokens: int) -> int:
    """Processed prefill tokens since ``req`` arrived (its wait on the counter clock)."""
    return processed_prefill_tokens - req.arrival_processed_prefill_tokens


def overtaken_tokens(req: InferReq) -> int:
    """Tokens of later work served ahead of ``req`` so far (0 before the bound first saw it)."""
    return req.overtake.overtaken_tokens if req.overtake is not None else 0


class PrefillWaitTracker:
    """Histograms of completed prefill waits and overtaken tokens, and the worst still running.

    Args:
        bound: the overtaking bound in force (published with the measurements).
        clock: seconds source (monotonic); injectable for tests.
    """

    def __init__(self, bound: OvertakeBoundSpec | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.bound = bound if bound is not None else OvertakeBoundSpec()
        self._overtaken = [0] * (len(WAIT_TOKEN_BUCKETS) + 2)
        self.longest_overtaken = 0
        self.protected = 0
        self._arrival_s: Dict[int, float] = {}
        # Cumulative bucket counts (one per bound, then +Inf) and the sum, per clock.
        self._tokens = [0] * (len(WAIT_TOKEN_BUCKETS) + 2)
        self._us = [0] * (len(WAIT_US_BUCKETS) + 2)
        self.longest_tokens = 0
        self.longest_us = 0

    def on_arrival(self, req: InferReq) -> None:
        """The backend received ``req`` (call right after its intake).

        A request whose prompt KV is computed elsewhere (a decode node's reservation, waiting in
        ``TRANSFERRING``) has no prefill wait on this rank and is not tracked.
        """
        if req.state is ReqState.TRANSFERRING:
            return
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
            _count(self._overtaken, overtaken_tokens(req), WAIT_TOKEN_BUCKETS)
            completed.append((tokens, seconds))
            # The wait is over; only the arrival time of requests still waiting is kept.
            del self._arrival_s[req.request_id]
        for req in released:
            self._arrival_s.pop(req.request_id, None)
        longest_tokens, longest_s, longest_overtaken, protected = 0, 0.0, 0, 0
        for req in live:
            if req.output_ids or req.request_id not in self._arrival_s:
                continue
            longest_tokens = max(longest_tokens, prefill_waited_tokens(req, processed_prefill_tokens))
            longest_s = max(longest_s, now - self._arrival_s[req.request_id])
            longest_overtaken = max(longest_overtaken, overtaken_tokens(req))
            protected += req.overtake is not None and req.overtake.protected
        self.longest_overtaken = longest_overtaken
        self.protected = protected
        self.longest_tokens = longest_tokens
        self.longest_us = int(longest_s * 1e6)
        return completed

    def _observe(self, tokens: int, seconds: float) -> None:
        _count(self._tokens, tokens, WAIT_TOKEN_BUCKETS)
        _count(self._us, int(seconds * 1e6), WAIT_US_BUCKETS)

    @property
    def completed_count(self) -> int:
        """Prefill waits observed so far."""
        return self._tokens[-2]

    def fields(self) -> Dict[str, int]:
        """Values of the shared stats fields (see ``prefill_wait_histogram.PREFILL_WAIT_FIELDS``)."""
        values = {LONGEST_TOKENS_FIELD: self.longest_tokens, LONGEST_US_FIELD: self.longest_us}
        values.update(zip(TOKEN_FIELDS, self._tokens))
        values.update(zip(US_FIELDS, self._us))
        values.update(zip(OVERTAKEN_FIELDS, self._overtaken))
        values[LONGEST_OVERTAKEN_FIELD] = self.longest_overtaken
        values[PROTECTED_FIELD] = self.protected
        values[BOUND_BASE_FIELD] = self.bound.base_tokens
        values[BOUND_FRACTION_PPM_FIELD] = round(self.bound.fraction * 1e6)
        values[BOUND_ENABLED_FIELD] = int(self.bound.enabled)
        return values


def _count(counts: List[int], value: int, bounds: Tuple[int, ...]) -> None:
    """Add one observation to cumulative bucket ``counts`` (last entry: the sum)."""
    for i, inc in enumerate(bucket_increments(value, bounds)):
        counts[i] += inc
    counts[-1] += value
