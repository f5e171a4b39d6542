"""One PD request's token and latency accounting on the master: its usage and its request metrics.

The master counts a request's tokens itself, over all its segments: a continuation segment's
node sees the earlier output as prompt, so the nodes' own counts are per segment.  The client's
usage is this count (its prompt, the first segment's cache hit, every generated token once), and
the master's request metrics (``ServerMetrics``: time to first token, the gaps between tokens,
the request's end) observe the same tokens.
"""

from __future__ import annotations

import time
from typing import List, Optional

from lightllm.server.httpserver.metrics import ServerMetrics
from lightllm.server.request_manager import GenerationEvent

# The finish reason of a request a node refused busy: it never ran, so it is not a finished
# request in the metrics (the refusal counts it as a failed one).  Not the node's ``busy`` stream
# event (pd.protocol.node_events.BUSY), though both are spelled the same.
FINISH_REASON_BUSY = "busy"


class RequestAccounting:
    """Counts one request's tokens, times them and observes its end in the master's request metrics.

    Made when the request is submitted (which the metrics count then).

    Args:
        metrics: the master's request metrics (``MasterMetrics.requests``).
        prompt_tokens: the client's prompt length.
        max_new_tokens: the completion length the client asked for.

    Attributes:
        generated: the token ids generated so far, over all segments.
        cached_tokens: the first segment's prompt cache hit (0 until the first token).
        first_token_seconds: seconds from submission to the first token (None before it).
        finish_reason: how the request ended so far: the finish reason the client was sent, or
            ``error``, ``abort`` or ``busy`` (None: not ended).
    """

    def __init__(self, metrics: ServerMetrics, prompt_tokens: int, max_new_tokens: int,
                 reads_cache: bool = True) -> None:
        self._metrics = metrics
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.generated: List[int] = []
        self.cached_tokens = 0
        self.first_token_seconds: Optional[float] = None
        self.finish_reason: Optional[str] = None
        self._last_token_at: Optional[float] = None
        self._started = time.perf_counter()
        # The prefill node looks the prompt up in its prefix cache unless it asks prompt_logprobs.
        metrics.on_submit(prompt_tokens, reads_cache=reads_cache)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far, over all segments."""
        return len(self.generated)

    def count(self, event: GenerationEvent) -> None:
        """Count a node's event and set its usage to the master's count.

        A token (``token_id`` >= 0) is timed: the first one against the submission, a later one
        against the token before it.  Only the first token keeps its prompt logprobs: a
        continuation segment's node would report its prompt's, which are earlier output.
        """
        now = time.perf_counter()
        if event.token_id >= 0:
            self.generated.append(event.token_id)
            if self.first_token_seconds is None:
                self.first_token_seconds = now - self._started
                self.cached_tokens = event.cached_tokens
                self._metrics.on_first_token(self.first_token_seconds, self.cached_tokens)
            else:
                self._metrics.on_next_token(now - (self._last_token_at or now))
                event.prompt_logprobs = None
            self._last_token_at = now
        else:
            event.prompt_logprobs = None
        event.completion_tokens = self.completion_tokens
        event.cached_tokens = self.cached_tokens

    def end(self, finish_reason: str) -> None:
        """Record how the request ended (a later end, such as an error after the last event, replaces it)."""
        self.finish_reason = finish_reason

    def observe_end(self) -> None:
        """Observe the request's end in the metrics (not ended: an abort); a busy refusal is not observed."""
        if self.finish_reason == FINISH_REASON_BUSY:
            return
        self._metrics.on_finish(
            self.finish_reason or "abort", self.completion_tokens, time.perf_counter() - self._started,
            prompt_tokens=self.prompt_tokens, first_token_seconds=self.first_token_seconds,
            max_new_tokens=self.max_new_tokens,
        )
