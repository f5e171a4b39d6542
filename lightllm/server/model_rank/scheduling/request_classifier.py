"""Request classification: the single rule that splits ready requests into decode and prefill.

The step engine's classify phase splits the ready requests once per step with its mode's
:class:`RequestClassifier` and hands the two lists on: the prefill-queue strategy orders only
the prefill list and the step planner takes both.  Neither re-derives the split, so they can
never disagree about which requests a prefill strategy may reorder.  A mode backend picks its
classifier once, from its run mode; nothing passes classification flags around.

Variants
--------
:data:`NORMAL_CLASSIFIER`
    Normal mode and the decode node.  A request is decode when exactly one token is pending,
    whatever produced that state.  A prompt whose prefix-cache hit leaves a single prompt token
    uncomputed therefore runs through the decode forward, which is cheaper and gives the same
    logits.
:data:`STRICT_PREFILL_CLASSIFIER`
    For backends whose prefill forward must see every prompt (per-prompt work in the prefill
    forward).  A request is decode only when it has a single pending token *and* has already
    produced an output token.
:data:`NO_DECODE_CLASSIFIER`
    A PD prefill node, which never decodes: every ready request is prefill work.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence

from lightllm.server.model_rank.scheduling.infer_req import InferReq


class ClassifiedRequests(NamedTuple):
    """A step's ready requests split by the classifier, each list in input (admission) order.

    Attributes:
        decode: requests this step runs as decode rows, one token each.
        prefill: requests the prefill-queue strategy orders and the planner chunks.
    """

    decode: List[InferReq]
    prefill: List[InferReq]


class RequestClassifier:
    """Normal classification: one pending token means decode."""

    name = "normal"

    def is_decode(self, req: InferReq) -> bool:
        """Return True when ``req`` is decode work in this step."""
        return req.pending_token_num == 1

    def split(self, reqs: Sequence[InferReq]) -> ClassifiedRequests:
        """Split ``reqs`` into decode and prefill requests, each keeping its input order."""
        decode_reqs: List[InferReq] = []
        prefill_reqs: List[InferReq] = []
        for req in reqs:
            (decode_reqs if self.is_decode(req) else prefill_reqs).append(req)
        return ClassifiedRequests(decode_reqs, prefill_reqs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class StrictPrefillClassifier(RequestClassifier):
    """Decode only after the first output token: every prompt goes through the prefill forward."""

    name = "strict_prefill"

    def is_decode(self, req: InferReq) -> bool:
        """One pending token and at least one output token."""
        return req.pending_token_num == 1 and len(req.output_ids) > 0


class NoDecodeClassifier(RequestClassifier):
    """Nothing is decode (a PD prefill node)."""

    name = "no_decode"

    def is_decode(self, req: InferReq) -> bool:
        """Always False."""
        return False


NORMAL_CLASSIFIER = RequestClassifier()
STRICT_PREFILL_CLASSIFIER = StrictPrefillClassifier()
NO_DECODE_CLASSIFIER = NoDecodeClassifier()


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
