"""``hrrn``'s float-keyed sort returns exactly the order of the original exact comparator.

The original sorted with ``cmp_to_key`` and integer cross-multiplication; its code is kept here
as the reference.  The property tests draw waits and costs that make exact ties (equal ratios,
ties broken by request id), duplicate request ids (input order) and near-ties (distinct ratios
whose floats are equal) frequent, and check that the rewrite returns the same permutation.
"""

from __future__ import annotations

from functools import cmp_to_key
from typing import Dict, List, Tuple

from hypothesis import given, settings
from hypothesis import strategies as st

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.base import split_by_infer_priority
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.hrrn import (
    HRRN_COST_KEY,
    HrrnStrategy,
    _hrrn_order,
)


class ReferenceHrrnStrategy(HrrnStrategy):
    """``order_prefill`` as it was before the rewrite."""

    def order_prefill(self, prefill_reqs: List[InferReq], processed_prefill_tokens: int) -> List[InferReq]:
        high, normal = split_by_infer_priority(prefill_reqs)
        waited: Dict[int, int] = {}
        cost: Dict[int, int] = {}
        for req in normal:
            waited[id(req)] = self._waited(req, processed_prefill_tokens)
            cost[id(req)] = self.bind_cost(req)

        def compare(a: InferReq, b: InferReq) -> int:
            lhs = waited[id(a)] * cost[id(b)]
            rhs = waited[id(b)] * cost[id(a)]
            if lhs != rhs:
                return -1 if lhs > rhs else 1
            return (a.request_id > b.request_id) - (a.request_id < b.request_id)

        return high + sorted(normal, key=cmp_to_key(compare))


def _req(request_id: int, arrival: int, cost: int, priority: int) -> InferReq:
    req = InferReq(
        request_id=request_id,
        prompt_ids=[0] * 4,
        arrival_processed_prefill_tokens=arrival,
        infer_high_priority=priority,
    )
    # Costs far beyond any prompt make near-ties reachable; bind_cost keeps a bound cost.
    req.strategy_state[HRRN_COST_KEY] = cost
    return req


def _same_order(specs: List[Tuple[int, int, int, int]], processed: int) -> None:
    orders = []
    for cls in (ReferenceHrrnStrategy, HrrnStrategy):
        reqs = [_req(*spec) for spec in specs]
        orders.append(_positions(reqs, cls().order_prefill(list(reqs), processed)))
    assert orders[0] == orders[1]


def _positions(reqs: List[InferReq], ordered: List[InferReq]) -> List[int]:
    # Input positions, not request ids: duplicate ids must keep their input order too.
    where = {id(req): pos for pos, req in enumerate(reqs)}
    return [where[id(req)] for req in ordered]


_small = st.tuples(
    st.integers(0, 30),  # request id (duplicates happen)
    st.integers(0, 40),  # arrival snapshot
    st.integers(1, 12),  # cost
    st.sampled_from([0, 0, 0, -1, 1]),  # infer_high_priority
)


@settings(max_examples=300, deadline=None)
@given(specs=st.lists(_small, max_size=40))
def test_small_values_with_many_exact_ties(specs: List[Tuple[int, int, int, int]]) -> None:
    _same_order(specs, 40)


@settings(max_examples=300, deadline=None)
@given(
    base=st.integers(2**40, 2**62),
    tweaks=st.lists(
        st.tuples(st.integers(0, 50), st.integers(-3, 3), st.integers(1, 2**20), st.integers(-2, 2)),
        min_size=2,
        max_size=25,
    ),
)
def test_huge_waits_with_float_near_ties(base: int, tweaks: List[Tuple[int, int, int, int]]) -> None:
    # waited = k * cost + delta: ratios k + delta / cost, within an ulp of each other for huge k.
    processed = 2**90
    specs = []
    for request_id, delta, cost, k_offset in tweaks:
        waited = (base + k_offset) * cost + delta
        specs.append((request_id, processed - waited, cost, 0))
    _same_order(specs, processed)


def test_near_ties_are_detected_and_resorted() -> None:
    # 2**60 / 3 and (2**60 + 1) / 3 round to the same float; the exact order still puts the
    # larger first, whatever the request ids say.
    reqs = [_req(1, 0, 3, 0), _req(2, 0, 3, 0)]
    waited = [2**60, 2**60 + 1]
    assert (waited[0] / 3) == (waited[1] / 3)
    assert _hrrn_order(reqs, waited, [3, 3]) == [1, 0]


def test_cost_binding_is_unchanged() -> None:
    fresh = InferReq(request_id=1, prompt_ids=[0] * 100, cur_kv_len=30)
    HrrnStrategy().order_prefill([fresh], 0)
    assert fresh.strategy_state[HRRN_COST_KEY] == 70
