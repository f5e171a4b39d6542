"""``shortest_within_slack``'s O(n log n) promotion returns exactly the order of the original.

The original promotion recomputed the prefix minima over every request after each promotion
(quadratic and worse at 10,000 waiting requests).  Its code is kept here, verbatim, as the
reference; the property tests check that the rewrite picks the same indices in the same order
for random inputs, and that whole multi-step runs (random priorities, prefix-cache hits, chunked
progress, step budgets) give the same permutations and bind the same request metadata.
"""

from __future__ import annotations

import copy
import random
from typing import List, Optional, Tuple

from hypothesis import given, settings
from hypothesis import strategies as st

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.shortest_within_slack import (
    BACKLOG_KEY,
    FCFS_FINISH_KEY,
    FIRST_SEEN_KEY,
    ShortestWithinSlackStrategy,
    _PrefixMinTree,
)


# --- the reference: the original algorithm, verbatim --------------------------------------------


class ReferenceSlackStrategy(ShortestWithinSlackStrategy):
    """The strategy as it was before the rewrite (only ``order_prefill`` and its helpers)."""

    def order_prefill(self, prefill_reqs: List[InferReq], processed_prefill_tokens: int) -> List[InferReq]:
        now = self.clock.observe(processed_prefill_tokens)
        base = sorted(prefill_reqs, key=lambda req: req.infer_high_priority)
        start = sum(1 for req in base if req.infer_high_priority < 0)
        high, rest = base[:start], base[start:]
        if len(rest) < 2:
            return base
        pending = [req.pending_token_num for req in rest]
        laxity = self._laxities(rest, pending, now)
        promoted = self._promote(pending, laxity)
        if not promoted:
            return base
        step = self.clock.budget
        if step and sum(pending[i] for i in promoted) < step:
            oldest = min(rest[i].strategy_state[FIRST_SEEN_KEY] for i in promoted)
            if now - oldest < self.patience_steps * step:
                return base
        moved = set(promoted)
        return high + [rest[i] for i in promoted] + [req for i, req in enumerate(rest) if i not in moved]

    def _laxities(self, rest: List[InferReq], pending: List[int], now: int) -> List[int]:
        backlog = sum(pending)
        laxity: List[int] = []
        ahead = 0
        for req, tokens in zip(rest, pending):
            ahead += tokens
            state = req.strategy_state
            if FCFS_FINISH_KEY not in state:
                state[FCFS_FINISH_KEY] = now + ahead
                state[FIRST_SEEN_KEY] = now
                state[BACKLOG_KEY] = backlog
            else:
                state[BACKLOG_KEY] = max(state[BACKLOG_KEY], backlog)
            laxity.append(state[FCFS_FINISH_KEY] + self.slack(req) - now - ahead)
        return laxity

    def _promote(self, pending: List[int], laxity: List[int]) -> List[int]:
        n = len(pending)
        step = self.clock.budget
        kept = [True] * n
        promoted: List[int] = []
        total = 0
        min_laxity, min_pending = _prefix_minima(laxity, pending, kept)
        for c in sorted(range(n), key=lambda i: (pending[i], i)):
            if step and total >= step:
                break
            if min_pending[c] is None or min_pending[c] <= pending[c]:
                continue
            if min_laxity[c] < max(step, total + pending[c]):
                continue
            kept[c] = False
            promoted.append(c)
            total += pending[c]
            min_laxity, min_pending = _prefix_minima(laxity, pending, kept)
        return promoted


def _prefix_minima(
    laxity: List[int], pending: List[int], kept: List[bool]
) -> Tuple[List[Optional[int]], List[Optional[int]]]:
    min_laxity: List[Optional[int]] = []
    min_pending: List[Optional[int]] = []
    low_laxity: Optional[int] = None
    low_pending: Optional[int] = None
    for i in range(len(kept)):
        min_laxity.append(low_laxity)
        min_pending.append(low_pending)
        if kept[i]:
            low_laxity = laxity[i] if low_laxity is None else min(low_laxity, laxity[i])
            low_pending = pending[i] if low_pending is None else min(low_pending, pending[i])
    return min_laxity, min_pending


# --- promotion alone -----------------------------------------------------------------------------


def _with_budget(cls: type, budget: int) -> ShortestWithinSlackStrategy:
    strategy = cls()
    strategy.clock.budget = budget
    return strategy


# Small pending values make ties (and "not strictly longer") frequent; laxities straddle the
# thresholds max(step, total + pending) so both outcomes of the laxity test occur.
_pending = st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=60)


@settings(max_examples=400, deadline=None)
@given(data=st.data(), pending=_pending, budget=st.sampled_from([0, 0, 1, 8, 30, 64, 200]))
def test_promote_matches_reference(data: st.DataObject, pending: List[int], budget: int) -> None:
    laxity = data.draw(st.lists(st.integers(-50, 300), min_size=len(pending), max_size=len(pending)))
    expected = _with_budget(ReferenceSlackStrategy, budget)._promote(pending, laxity)
    assert _with_budget(ShortestWithinSlackStrategy, budget)._promote(pending, laxity) == expected


def test_promote_matches_reference_on_a_large_queue() -> None:
    # Many promotions (no step budget known yet): the case the original took seconds on.
    rng = random.Random(7)
    pending = [rng.randint(128, 8192) for _ in range(400)]
    laxity = [rng.randint(-1000, 200_000) for _ in pending]
    for budget in (0, 1024):
        expected = _with_budget(ReferenceSlackStrategy, budget)._promote(pending, laxity)
        assert _with_budget(ShortestWithinSlackStrategy, budget)._promote(pending, laxity) == expected


@given(values=st.lists(st.integers(-100, 100), min_size=1, max_size=70), data=st.data())
def test_prefix_min_tree_matches_a_plain_minimum(values: List[int], data: st.DataObject) -> None:
    tree = _PrefixMinTree(values)
    removed = data.draw(st.sets(st.integers(0, len(values) - 1)))
    for index in removed:
        tree.remove(index)
    for end in range(len(values) + 1):
        kept = [v for i, v in enumerate(values[:end]) if i not in removed]
        assert tree.prefix_min(end) == (min(kept) if kept else float("inf"))


# --- whole runs ----------------------------------------------------------------------------------

_request = st.tuples(
    st.integers(min_value=2, max_value=3000),  # prompt tokens
    st.sampled_from([0, 0, 0, 0, -1, 1]),  # infer_high_priority
    st.integers(min_value=0, max_value=100),  # percent of the prompt already cached
)


def _build(specs: List[Tuple[int, int, int]], first_id: int, arrival: int) -> List[InferReq]:
    reqs = []
    for offset, (prompt, priority, cached_pct) in enumerate(specs):
        cached = min(prompt - 1, prompt * cached_pct // 100)
        reqs.append(
            InferReq(
                request_id=first_id + offset,
                prompt_ids=[0] * prompt,
                arrival_processed_prefill_tokens=arrival,
                infer_high_priority=priority,
                cur_kv_len=cached,
            )
        )
    return reqs


@settings(max_examples=150, deadline=None)
@given(
    initial=st.lists(_request, min_size=0, max_size=40),
    steps=st.lists(
        st.tuples(st.lists(_request, max_size=6), st.sampled_from([0, 64, 256, 1024, 4096])),
        min_size=1,
        max_size=12,
    ),
    params=st.tuples(st.sampled_from([0.0, 0.05, 0.3]), st.sampled_from([0, 1, 2, 4]), st.sampled_from([1, 4])),
)
def test_whole_runs_match_reference(
    initial: List[Tuple[int, int, int]],
    steps: List[Tuple[List[Tuple[int, int, int]], int]],
    params: Tuple[float, int, int],
) -> None:
    """Step by step: same permutation, same bound metadata, with the queue served in that order."""
    fraction, min_steps, patience = params
    tuning = dict(slack_fraction=fraction, min_slack_steps=min_steps, patience_steps=patience)
    strategies = (ReferenceSlackStrategy(**tuning), ShortestWithinSlackStrategy(**tuning))
    queue = _build(initial, 0, 0)
    queues = (queue, copy.deepcopy(queue))
    processed = 0
    next_id = len(initial)
    for arrivals, budget in steps:
        fresh = _build(arrivals, next_id, processed)
        next_id += len(arrivals)
        queues = tuple(q + copy.deepcopy(fresh) for q in queues)
        orders = [s.order_prefill(list(q), processed) for s, q in zip(strategies, queues)]
        assert [r.request_id for r in orders[0]] == [r.request_id for r in orders[1]]
        assert [r.strategy_state for r in queues[0]] == [r.strategy_state for r in queues[1]]
        # Serve up to ``budget`` tokens from the head, as a chunked-prefill planner would.
        served = 0
        for ordered in orders:
            left, served = budget, 0
            for req in ordered:
                take = min(left, req.pending_token_num)
                req.cur_kv_len += take
                left -= take
                served += take
        processed += served
        queues = tuple([r for r in q if r.pending_token_num > 0] for q in queues)
