"""Whether a whole (non-streamed) answer is large enough to be shaped and encoded off the event loop.

The event loop serves every connection: building and encoding a large answer there stops every
other stream and request for as long as it takes (16 choices' prompt logprobs of a 4,085-token
prompt made a 98 MB answer that held the loop 7 s).  Small answers stay on the loop, where a
thread hop would only add latency.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

# Entries of an answer (a token, one of its alternatives, a prompt position or one of its
# alternatives) from which it is built on a worker thread: about a megabyte of JSON.
OFF_LOOP_ENTRIES = 10_000


def answer_entries(event_lists: Iterable[Sequence[Any]], jobs: Sequence[Any]) -> int:
    """How many entries an answer of ``event_lists`` (one list per choice) for ``jobs`` holds, roughly."""
    entries = 0
    alternatives = max((job.params.logprobs or 0 for job in jobs), default=0)
    for events in event_lists:
        entries += len(events) * (1 + alternatives)
    for job in jobs:
        if job.params.prompt_logprobs is not None:
            entries += len(job.prompt_ids) * (1 + job.params.prompt_logprobs)
    return entries


def large_answer(event_lists: Iterable[Sequence[Any]], jobs: Sequence[Any]) -> bool:
    """Whether the answer is worth building on a worker thread (see the module docstring)."""
    return answer_entries(event_lists, jobs) >= OFF_LOOP_ENTRIES
