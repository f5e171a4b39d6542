"""Small messages that cross process boundaries over zmq (pickled dataclasses).

Request content never travels here: only request ids and shared-memory slot indexes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple


@dataclass
class NewRequest:
    """HTTP -> router: a request was written to ``shm_index``."""

    request_id: int
    shm_index: int


@dataclass
class AbortRequest:
    """HTTP or detokenization -> router -> model ranks: stop a request."""

    request_id: int


@dataclass
class AddRequests:
    """Router -> model rank 0: admit these ``(request_id, shm_index)`` pairs."""

    requests: List[Tuple[int, int]]


@dataclass
class AbortRequests:
    """Router -> model rank 0: abort these running requests."""

    request_ids: List[int]


@dataclass
class StepOutput:
    """Model rank 0 -> detokenization: new tokens are in shared memory; some requests ended.

    ``updates`` holds ``(request_id, shm_index)`` of requests whose ``output_len`` grew or whose
    ``finish_status`` was set; ``released`` the requests the backend dropped (their slot is no
    longer written by anyone).
    """

    updates: List[Tuple[int, int]] = field(default_factory=list)
    released: List[Tuple[int, int]] = field(default_factory=list)


@dataclass
class RequestsReleased:
    """Model rank 0 -> router: these requests left the running batch."""

    request_ids: List[int]


@dataclass
class TokenEvent:
    """One generated token as the HTTP process hands it to the client."""

    token_id: int
    text: str
    logprob: float
    # ``(token_id, logprob)`` alternatives, most likely first; None when none were requested.
    top_logprobs: List[Tuple[int, float]] | None = None


@dataclass
class DetokenizedOutput:
    """Detokenization -> HTTP: new text for one request, and whether it ended."""

    request_id: int
    tokens: List[TokenEvent]
    finish_reason: str | None
    prompt_cache_len: int
    # ``(token_id, logprob, top)`` of prompt positions 1.. on the request's first message, for a
    # request that asked for prompt logprobs.
    prompt_logprobs: List[Tuple[int, float, List[Tuple[int, float]]]] | None = None


@dataclass
class SlotReleased:
    """Detokenization -> HTTP: nobody reads or writes this request's slot any more."""

    request_id: int
    shm_index: int
