"""``promote_shortest``: a deliberately small reorder that lets one short prompt jump ahead."""

from __future__ import annotations

from typing import List

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.base import (
    PrefillQueueStrategy,
    split_by_infer_priority,
)


class PromoteShortestStrategy(PrefillQueueStrategy):
    """High-priority requests first, then the shortest normal request, then the rest.

    High-priority (negative ``infer_high_priority``) requests keep their arrival order.  Among
    the normal requests exactly one, the one with the fewest uncached prefill tokens left
    (``pending_token_num``; the earliest on ties), moves to the head of the normal group; every
    other request keeps its relative order.  Promoting only one per step bounds how far long
    prompts can be pushed back.
    """

    name = "promote_shortest"

    def order_prefill(self, prefill_reqs: List[InferReq], processed_prefill_tokens: int) -> List[InferReq]:
        """Return high-priority requests, then the promoted shortest one, then the others."""
        high, normal = split_by_infer_priority(prefill_reqs)
        if not normal:
            return high
        # min() returns the first minimum, which gives the "earliest on ties" rule.
        shortest_index = min(range(len(normal)), key=lambda i: normal[i].pending_token_num)
        promoted = normal[shortest_index]
        return high + [promoted] + normal[:shortest_index] + normal[shortest_index + 1 :]
