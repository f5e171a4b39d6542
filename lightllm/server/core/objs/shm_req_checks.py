"""Checks of the values a caller is about to store in a shared-memory request record.

They raise ``ValueError`` naming the bad field before anything is written, so a value the
record cannot hold (or a combination the PD protocol forbids) fails the one request that
carries it instead of reaching another process.  :meth:`ShmReqBuffer.write_request
<lightllm.server.core.objs.shm_req_buffer.ShmReqBuffer.write_request>` runs them, and callers
that build a request elsewhere first (the HTTP manager, the PD node wire format) run them early
for a clearer error.
"""

from __future__ import annotations

import numpy as np

from lightllm.server.core.objs.shm_req_layout import MAX_REQUEST_ID, PD_KIND_PREFILL, PD_KINDS

_INT32 = np.iinfo(np.int32)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_request_id(request_id: object) -> None:
    """Raise ``ValueError`` unless ``request_id`` is an id a record can hold."""
    if not _is_int(request_id) or not 0 <= request_id <= MAX_REQUEST_ID:
        raise ValueError(f"request_id must be an int in [0, {MAX_REQUEST_ID}], got {request_id!r}")


def check_internal_priority(infer_high_priority: object, segment_index: object) -> None:
    """Raise ``ValueError`` unless both internal fields fit their record fields."""
    if not _is_int(infer_high_priority) or not _INT32.min <= infer_high_priority <= _INT32.max:
        raise ValueError(f"infer_high_priority must be a 32-bit int, got {infer_high_priority!r}")
    if not _is_int(segment_index) or not 0 <= segment_index <= _INT32.max:
        raise ValueError(f"segment_index must be an int in [0, {_INT32.max}], got {segment_index!r}")


def check_pd_fields(pd_kind: object, kv_start: object, prompt_len: int) -> None:
    """Raise ``ValueError`` unless the internal PD fields fit a request of ``prompt_len`` tokens.

    ``kv_start`` (only a PD prefill request's) must leave at least one prompt position to send.
    """
    if pd_kind not in PD_KINDS or isinstance(pd_kind, bool):
        raise ValueError(f"pd_kind must be one of {PD_KINDS}, got {pd_kind!r}")
    if not _is_int(kv_start) or not 0 <= kv_start < max(prompt_len, 1):
        raise ValueError(f"kv_start must be an int in [0, {max(prompt_len - 1, 0)}], got {kv_start!r}")
    if kv_start and pd_kind != PD_KIND_PREFILL:
        raise ValueError("kv_start applies to PD prefill requests only")


def check_generated_before(generated_before: object, prompt_len: int) -> None:
    """Raise ``ValueError`` unless ``generated_before`` leaves at least one real prompt token.

    ``generated_before`` counts the trailing prompt tokens that earlier segments of the same
    generation produced (a PD continuation); the client's own prompt is never empty.
    """
    if not _is_int(generated_before) or not 0 <= generated_before < max(prompt_len, 1):
        raise ValueError(
            f"generated_before must be an int in [0, {max(prompt_len - 1, 0)}] (less than the prompt length "
            f"{prompt_len}), got {generated_before!r}"
        )
