"""``hrrn``: Highest Response Ratio Next with token-based aging.

Inspired by SGLang pull request #32911.

score = waited / cost, where
  waited = processed_prefill_tokens - req.arrival_processed_prefill_tokens
  cost   = max(1, input_len - cur_kv_len), bound the first time the request is ordered here.

Waiting is measured in prefill tokens the backend submitted since the request arrived, so all
TP ranks compute identical scores.  The cost stays fixed across chunked-prefill rounds: if it
shrank with every chunk, a long prompt that has started would gain priority from its own
progress rather than from waiting.
"""

from __future__ import annotations

from functools import cmp_to_key
from typing import Dict, List

from lightllm.server.router.model_infer.infer_req import InferReq
from lightllm.server.router.model_infer.mode_backend.prefill_queue_strategy.base import (
    PrefillQueueStrategy,
    split_by_infer_priority,
)
from lightllm.server.router.model_infer.mode_backend.prefill_queue_strategy.waiting_bound import prefill_waited_tokens

HRRN_COST_KEY = "hrrn_cost"


class HrrnStrategy(PrefillQueueStrategy):
    """High-priority requests first (arrival order), then normal ones by descending HRRN score.

    Ties of the score are broken by ascending ``request_id``.  Scores are compared exactly by
    integer cross-multiplication, so there are no floating-point near-ties that ranks could
    resolve differently.
    """

    name = "hrrn"

    def order_prefill(self, prefill_reqs: List[InferReq], processed_prefill_tokens: int) -> List[InferReq]:
        """Return high-priority requests, then normal ones by score, ties by request id."""
        high, normal = split_by_infer_priority(prefill_reqs)
        waited: Dict[int, int] = {}
        cost: Dict[int, int] = {}
        for req in normal:
            waited[id(req)] = self._waited(req, processed_prefill_tokens)
            cost[id(req)] = self.bind_cost(req)

        def compare(a: InferReq, b: InferReq) -> int:
            # waited_a / cost_a > waited_b / cost_b  <=>  waited_a * cost_b > waited_b * cost_a
            lhs = waited[id(a)] * cost[id(b)]
            rhs = waited[id(b)] * cost[id(a)]
            if lhs != rhs:
                return -1 if lhs > rhs else 1
            return (a.request_id > b.request_id) - (a.request_id < b.request_id)

        return high + sorted(normal, key=cmp_to_key(compare))

    @staticmethod
    def bind_cost(req: InferReq) -> int:
        """Return the request's HRRN service cost, binding it on first use."""
        bound = req.strategy_state.get(HRRN_COST_KEY)
        if bound is None:
            bound = max(1, req.input_len - req.cur_kv_len)
            req.strategy_state[HRRN_COST_KEY] = bound
        return bound

    @staticmethod
    def _waited(req: InferReq, processed_prefill_tokens: int) -> int:
        waited = prefill_waited_tokens(req, processed_prefill_tokens)
        if waited < 0:
            raise ValueError(
                f"processed_prefill_tokens ({processed_prefill_tokens}) is below request "
                f"{req.request_id}'s arrival_processed_prefill_tokens "
                f"({req.arrival_processed_prefill_tokens}); the counter must be monotonic"
            )
        return waited
