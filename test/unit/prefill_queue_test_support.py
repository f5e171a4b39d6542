"""Helpers shared by the prefill-queue strategy tests: request builders and order shorthands."""

from __future__ import annotations

from typing import List, Sequence

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy


def make_req(
    request_id: int,
    prompt_len: int,
    *,
    output_len: int = 0,
    cur_kv_len: int = 0,
    arrival: int = 0,
    infer_high_priority: int = 0,
) -> InferReq:
    """Build a request; ``arrival`` is its processed-prefill-token snapshot."""
    return InferReq(
        request_id=request_id,
        prompt_ids=list(range(prompt_len)),
        output_ids=[1] * output_len,
        cur_kv_len=cur_kv_len,
        arrival_processed_prefill_tokens=arrival,
        infer_high_priority=infer_high_priority,
    )


def decode_req(request_id: int, arrival: int = 0) -> InferReq:
    """A request with one generated token pending."""
    return make_req(request_id, 8, output_len=1, cur_kv_len=8, arrival=arrival)


def ids(reqs: Sequence[InferReq]) -> List[int]:
    """The request ids of ``reqs``, in order."""
    return [r.request_id for r in reqs]


def order(name: str, reqs: Sequence[InferReq], processed: int = 0, **kwargs) -> List[int]:
    """Ids of ``reqs`` as a freshly built strategy ``name`` reorders them at ``processed``."""
    return ids(build_prefill_queue_strategy(name).reorder(reqs, processed, **kwargs))
