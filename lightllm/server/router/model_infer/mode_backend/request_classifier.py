"""Request classification: the single rule that splits ready requests into decode and prefill.

Every component that needs to know whether a request decodes (the backend's batching, the
prefill-queue strategies, the step planner, the scheduling simulator) calls
:func:`is_decode_request`, so they can never disagree about which requests a prefill strategy
may reorder.

Variants
--------
``is_decode_request(req)``
    Normal mode.  A request is decode when exactly one token is pending, whatever produced that
    state.  A prompt whose prefix-cache hit leaves a single prompt token uncomputed therefore
    runs through the decode forward, which is cheaper and gives the same logits.
``is_decode_request(req, strict_prefill=True)``
    For backends whose prefill forward must see every prompt (for example because it performs
    per-prompt work such as handing the first token over to another node).  A request is decode
    only when it has a single pending token *and* has already produced an output token.
``is_decode_request(req, no_decode=True)``
    For modes that never decode (a PD prefill node).  Nothing is decode; every ready request is
    prefill work.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from lightllm.server.router.model_infer.infer_req import InferReq


def is_decode_request(req: InferReq, no_decode: bool = False, strict_prefill: bool = False) -> bool:
    """Return True when ``req`` is decode work in this step (see the module docstring)."""
    if no_decode:
        return False
    if req.pending_token_num != 1:
        return False
    if strict_prefill:
        return len(req.output_ids) > 0
    return True


def split_decode_and_prefill(
    reqs: Sequence[InferReq], *, no_decode: bool = False, strict_prefill: bool = False
) -> Tuple[List[InferReq], List[InferReq]]:
    """Split ``reqs`` into ``(decode_reqs, prefill_reqs)``, each keeping its input order."""
    decode_reqs: List[InferReq] = []
    prefill_reqs: List[InferReq] = []
    for req in reqs:
        if is_decode_request(req, no_decode=no_decode, strict_prefill=strict_prefill):
            decode_reqs.append(req)
        else:
            prefill_reqs.append(req)
    return decode_reqs, prefill_reqs


def prefill_need_token_num(req: InferReq, chunked_prefill_size: Optional[int]) -> int:
    """Tokens the next prefill chunk of ``req`` computes.

    ``chunked_prefill_size`` of ``None`` or ``0`` means chunked prefill is disabled, so the chunk
    is the whole pending length.  The step planner calls this once per request and reuses the
    result for budgeting, KV allocation and the processed-prefill-token accounting.
    """
    if chunked_prefill_size is not None and chunked_prefill_size < 0:
        raise ValueError(f"chunked_prefill_size must be None or >= 0, got {chunked_prefill_size}")
    pending = req.pending_token_num
    if not chunked_prefill_size:
        return pending
    return min(pending, chunked_prefill_size)
