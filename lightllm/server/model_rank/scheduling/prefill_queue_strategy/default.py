"""``default``: FCFS that honours the internal inference priority."""

from __future__ import annotations

from typing import List

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.base import PrefillQueueStrategy


class DefaultStrategy(PrefillQueueStrategy):
    """Stable sort of prefill requests by ``infer_high_priority`` (more negative first).

    Requests of equal priority keep their input (arrival) order, i.e. first come, first served.
    """

    name = "default"

    def order_prefill(self, prefill_reqs: List[InferReq], processed_prefill_tokens: int) -> List[InferReq]:
        """Return the requests stably sorted by inference priority."""
        return sorted(prefill_reqs, key=lambda req: req.infer_high_priority)
