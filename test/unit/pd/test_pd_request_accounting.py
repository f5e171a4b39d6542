"""``RequestAccounting``: the master's count of one PD request's tokens, the usage it puts on each
event and what the request metrics observe.  The whole request flow is in
``test_pd_master_request_flow.py``."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from lightllm.server.pd.master.request_accounting import RequestAccounting
from lightllm.server.request_manager import GenerationEvent


class RecordingMetrics:
    """Records the ``ServerMetrics`` calls the accounting makes."""

    def __init__(self) -> None:
        self.calls: List[Tuple[str, Any]] = []

    def on_submit(self, prompt_tokens: int, reads_cache: bool = True) -> None:
        self.calls.append(("submit", prompt_tokens) if reads_cache else ("submit_uncached", prompt_tokens))

    def on_first_token(self, seconds: float, cached_tokens: int) -> None:
        self.calls.append(("first", (seconds, cached_tokens)))

    def on_next_token(self, seconds: float) -> None:
        self.calls.append(("next", seconds))

    def on_finish(self, finish_reason: str, completion_tokens: int, seconds: float, **extra: Any) -> None:
        self.calls.append(("finish", (finish_reason, completion_tokens, seconds, extra)))


def event(token_id: int, cached: int = 0, prompt_logprobs: Optional[List[Any]] = None) -> GenerationEvent:
    # A node's own counts (a continuation's node counts its segment only): the accounting replaces them.
    return GenerationEvent(request_id=1, token_id=token_id, text="", logprob=0.0, finish_reason=None,
                           prompt_tokens=99, cached_tokens=cached, completion_tokens=1,
                           prompt_logprobs=prompt_logprobs)


def test_tokens_are_counted_timed_and_set_as_the_events_usage() -> None:
    metrics = RecordingMetrics()
    accounting = RequestAccounting(metrics, prompt_tokens=4, max_new_tokens=8)
    assert metrics.calls == [("submit", 4)]

    first = event(11, cached=2, prompt_logprobs=[(5, -0.5, {})])
    accounting.count(first)
    assert (first.completion_tokens, first.cached_tokens, first.prompt_logprobs) == (1, 2, [(5, -0.5, {})])
    kind, (seconds, cached) = metrics.calls[-1]
    assert kind == "first" and seconds >= 0 and cached == 2
    assert accounting.first_token_seconds == seconds

    # A later segment's first token: its node's cache hit and prompt logprobs are not the client's.
    second = event(12, cached=6, prompt_logprobs=[(11, -0.1, {})])
    accounting.count(second)
    assert (second.completion_tokens, second.cached_tokens, second.prompt_logprobs) == (2, 2, None)
    kind, gap = metrics.calls[-1]
    assert kind == "next" and gap >= 0

    finish = event(-1, cached=6, prompt_logprobs=[(11, -0.1, {})])  # a token-less finish
    accounting.count(finish)
    assert (finish.completion_tokens, finish.cached_tokens, finish.prompt_logprobs) == (2, 2, None)
    assert accounting.generated == [11, 12] and len(metrics.calls) == 3


def test_the_end_is_observed_once_with_the_last_reason_and_a_busy_refusal_not_at_all() -> None:
    metrics = RecordingMetrics()
    accounting = RequestAccounting(metrics, prompt_tokens=4, max_new_tokens=8)
    accounting.count(event(11, cached=1))
    accounting.end("stop")
    accounting.end("error")  # an error after the last event replaces it
    accounting.observe_end()
    kind, (reason, completion, seconds, extra) = metrics.calls[-1]
    assert (kind, reason, completion) == ("finish", "error", 1) and seconds >= 0
    assert extra == {"prompt_tokens": 4, "first_token_seconds": accounting.first_token_seconds, "max_new_tokens": 8}

    never_ended = RecordingMetrics()
    RequestAccounting(never_ended, prompt_tokens=3, max_new_tokens=2).observe_end()
    assert never_ended.calls[-1][1][:2] == ("abort", 0)  # a request that just stopped (its client left)

    refused = RecordingMetrics()
    busy = RequestAccounting(refused, prompt_tokens=3, max_new_tokens=2)
    busy.end("busy")
    busy.observe_end()
    assert refused.calls == [("submit", 3)]


def test_a_prompt_logprobs_request_is_submitted_as_no_cache_lookup() -> None:
    metrics = RecordingMetrics()
    RequestAccounting(metrics, prompt_tokens=4, max_new_tokens=8, reads_cache=False)
    assert metrics.calls[0] == ("submit_uncached", 4)
