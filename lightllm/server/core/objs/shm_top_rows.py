"""The rows of the top-logprob segment (``<name>_top``): claiming, owner checks, writing and reading.

A request that asks for top logprobs holds one row, named by its record's ``top_slot``; the row
carries its own ``request_id``, checked on every access after the record's own check (see the
write-order rules in :mod:`.shm_req_buffer`). ``pool`` is the segment, or None when the server
has no top-logprob rows (``--top_logprobs_slots`` 0 in tests).
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

import numpy as np

from lightllm.common.sampling import MAX_TOP_LOGPROBS
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shared_segment import SharedArraySegment
from lightllm.server.core.objs.shm_req_layout import NO_REQUEST, NO_TOP_SLOT, wants_top_rows
from lightllm.server.core.objs.shm_req_views import StaleRecordError, TopRow

log = logging.getLogger("lightllm.shm_req_buffer")


def claim_top_row(pool: Optional[SharedArraySegment], slot_num: int, spec: RequestSpec,
                  top_slot: Optional[int]) -> Optional[np.void]:
    """The row ``write_request`` may claim for ``spec`` (None: the request takes none).

    Raises ``ValueError`` when a row is given to a request that asks for no top logprobs, missing
    for one that does, or outside ``[0, slot_num)``.
    """
    if not wants_top_rows(spec.params):
        if top_slot is not None:
            raise ValueError("top_slot was given for a request that asks for no top logprobs")
        return None
    if top_slot is None:
        raise ValueError("the request asks for top logprobs (logprobs or prompt_logprobs > 0) but got no top_slot")
    if isinstance(top_slot, bool) or not isinstance(top_slot, int) or not 0 <= top_slot < slot_num:
        raise ValueError(f"top_slot must be an int in [0, {slot_num}), got {top_slot!r}")
    return pool.array[top_slot]


def top_row_for_write(pool: Optional[SharedArraySegment], rec: np.void, request_id: int) -> Optional[np.void]:
    """The request's row for a writer; None (logged, nothing written) when it holds none or a stale one."""
    top_slot = int(rec["top_slot"])
    if top_slot == NO_TOP_SLOT or pool is None:
        log.warning("ignored top logprobs for request %d: it holds no top-logprob slot", request_id)
        return None
    tops = pool.array[top_slot]
    if int(tops["request_id"]) != request_id:
        log.warning("ignored a stale write of top logprobs to top-logprob slot %d for request %d (it holds %d)",
                    top_slot, request_id, int(tops["request_id"]))
        return None
    return tops


def top_row_for_read(pool: Optional[SharedArraySegment], rec: np.void, request_id: int) -> Optional[np.void]:
    """The request's row for a reader (None: it holds none); ``StaleRecordError`` when not the request's."""
    top_slot = int(rec["top_slot"])
    if top_slot == NO_TOP_SLOT or pool is None:
        return None
    tops = pool.array[top_slot]
    found = int(tops["request_id"])
    if found != request_id:
        raise StaleRecordError(top_slot, request_id, found, what="top-logprob slot")
    return tops


def release_top_row(pool: Optional[SharedArraySegment], rec: np.void, request_id: int) -> None:
    """Free the record's row if the request still holds it (the HTTP process, before the record)."""
    top_slot = int(rec["top_slot"])
    if top_slot != NO_TOP_SLOT and pool is not None:
        tops = pool.array[top_slot]
        if int(tops["request_id"]) == request_id:
            tops["request_id"] = NO_REQUEST


def write_top(tops: np.void, position: int, top: Sequence[Tuple[int, float]]) -> None:
    """Store the alternatives of one position; unused entries get id -1."""
    count = min(len(top), MAX_TOP_LOGPROBS)
    ids = tops["ids"][position]
    ids[:count] = [pair[0] for pair in top[:count]]
    ids[count:] = -1
    tops["logprobs"][position][:count] = [pair[1] for pair in top[:count]]


def read_top(tops: Optional[np.void], start: int, end: int) -> List[TopRow]:
    """The alternatives of positions ``start..end-1`` (empty lists when the request holds no row)."""
    if tops is None:  # a record written without a row (write_request refuses that)
        return [[] for _ in range(max(0, end - start))]
    ids = tops["ids"][start:end].tolist()
    values = tops["logprobs"][start:end].tolist()
    return [
        [(token_id, value) for token_id, value in zip(row_ids, row_values) if token_id >= 0]
        for row_ids, row_values in zip(ids, values)
    ]
