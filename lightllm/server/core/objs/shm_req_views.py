"""What :class:`~lightllm.server.core.objs.shm_req_buffer.ShmReqBuffer` hands its callers: typed
views of a request record, and the errors of a record that is not the caller's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from lightllm.server.core.objs.shm_req_layout import NO_REQUEST

TopRow = List[Tuple[int, float]]


class StaleRecordError(LookupError):
    """A slot does not hold the request its reader expected (it was released or reused).

    ``what`` names the kind of slot: a request record's, or a top-logprob row's.
    """

    def __init__(self, slot: int, expected: int, found: int, what: str = "shared-memory slot"):
        holder = "is free" if found == NO_REQUEST else f"holds request {found}"
        super().__init__(f"{what} {slot} no longer holds request {expected} (it {holder})")
        self.slot = slot
        self.expected = expected
        self.found = found


class SlotOccupiedError(RuntimeError):
    """:meth:`ShmReqBuffer.write_request` was given a slot that still holds a request."""


@dataclass(frozen=True)
class AdmissionFields:
    """What the router admits a request by: a few numbers of its :class:`~.request_spec.RequestSpec`.

    The router reads these instead of the whole spec so that admission never copies a prompt.
    """

    prompt_len: int
    max_new_tokens: int
    high_priority_request: bool
    pd_kind: int = 0  # PD_KIND_DECODE arrivals bypass the router's queue


@dataclass(frozen=True)
class DecodeOptions:
    """What the detokenizer needs to turn a request's tokens into text."""

    prompt_ids: List[int]
    stop_sequences: List[str]
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    print_eos_token: bool = False
    stop_token_ids: List[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0


@dataclass(frozen=True)
class OutputSnapshot:
    """Output published for a request from position ``start`` on, as read at one moment."""

    output_len: int
    token_ids: List[int]
    logprobs: List[float]
    top_logprobs: Optional[List[TopRow]]  # None when the request asked for no alternatives
    finish_status: int
    prompt_cache_len: int
