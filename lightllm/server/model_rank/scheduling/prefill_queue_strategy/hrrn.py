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
from typing import List

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.base import (
    PrefillQueueStrategy,
    split_by_infer_priority,
)

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
        # Comprehensions instead of a call per request: this runs over every waiting request
        # each step.  The cost is bound once per request; only the wait changes with the clock.
        waited = [processed_prefill_tokens - req.arrival_processed_prefill_tokens for req in normal]
        if waited and min(waited) < 0:
            for req in normal:
                self._waited(req, processed_prefill_tokens)  # raises for the first one
        bound = [req.strategy_state.get(HRRN_COST_KEY) for req in normal]
        cost = [self.bind_cost(req) if c is None else c for req, c in zip(normal, bound)]
        return high + [normal[i] for i in _hrrn_order(normal, waited, cost)]

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
        waited = processed_prefill_tokens - req.arrival_processed_prefill_tokens
        if waited < 0:
            raise ValueError(
                f"processed_prefill_tokens ({processed_prefill_tokens}) is below request "
                f"{req.request_id}'s arrival_processed_prefill_tokens "
                f"({req.arrival_processed_prefill_tokens}); the counter must be monotonic"
            )
        return waited


def _hrrn_order(reqs: List[InferReq], waited: List[int], cost: List[int]) -> List[int]:
    """Indices of ``reqs`` by descending ``waited / cost`` (exact), ties by request id, then input order.

    Comparing every pair by integer cross-multiplication (``cmp_to_key``) costs a Python call per
    comparison, tens of ms at 10,000 waiting requests.  Instead the sort uses float keys, which
    give the exact order because ``int / int`` is correctly rounded and rounding is monotonic: a
    larger exact ratio never gets a smaller float, so requests whose floats differ are in exact
    order.  Only requests whose floats are equal can be misordered (distinct ratios round to the
    same float only once ``waited * cost`` nears 2**52); those runs are found with integer
    cross-multiplication and re-sorted exactly, so the result is the exact order on every rank.
    """
    n = len(reqs)
    scores = [-(w / c) for w, c in zip(waited, cost)]
    # Two stable sorts on plain keys (C fast paths, no tuples): by request id, then by score, so
    # equal scores stay by request id and equal ids in input order.
    request_ids = [req.request_id for req in reqs]
    order = sorted(range(n), key=request_ids.__getitem__)
    order.sort(key=scores.__getitem__)
    ordered_scores = [scores[i] for i in order]
    # Neighbours with equal floats but unequal exact ratios (w_a * c_b != w_b * c_a); exact
    # equality is transitive, so checking neighbours covers whole runs of equal floats.
    equal_floats = map(float.__eq__, ordered_scores, ordered_scores[1:])
    misordered = any(
        waited[a] * cost[b] != waited[b] * cost[a]
        for a, b in (order[k : k + 2] for k, equal in enumerate(equal_floats) if equal)
    )
    if misordered:
        _resort_float_ties(order, scores, reqs, waited, cost)
    return order


def _resort_float_ties(
    order: List[int], scores: List[float], reqs: List[InferReq], waited: List[int], cost: List[int]
) -> None:
    """Re-sort, in place and exactly, every run of ``order`` whose float scores are equal."""

    def compare(a: int, b: int) -> int:
        # waited_a / cost_a > waited_b / cost_b  <=>  waited_a * cost_b > waited_b * cost_a
        lhs = waited[a] * cost[b]
        rhs = waited[b] * cost[a]
        if lhs != rhs:
            return -1 if lhs > rhs else 1
        return (reqs[a].request_id > reqs[b].request_id) - (reqs[a].request_id < reqs[b].request_id)

    key = cmp_to_key(compare)
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and scores[order[end]] == scores[order[start]]:
            end += 1
        if end - start > 1:
            order[start:end] = sorted(order[start:end], key=key)
        start = end
