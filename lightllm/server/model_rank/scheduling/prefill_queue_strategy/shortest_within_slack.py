"""``shortest_within_slack``: shortest first, but never past another request's slack.

``default`` (first come, first served) is the yardstick this strategy is held to: a shorter
request may overtake a longer one only while every request it overtakes still gets its first
token within a small slack of when ``default`` would have given it.  The slack of a request is

    slack(r) = max(min_slack_steps * step, slack_fraction * Q(r))

where ``step`` is the largest prefill step seen so far (the budget) and ``Q(r)`` is the largest
prefill backlog (pending prompt tokens of every prefill request) seen while ``r`` waits.
Measuring the slack against the backlog rather than against the request's own position is what
lets short prompts overtake the *first* long prompts of a burst: a long prompt at the front of a
long queue has a small own wait, but the tail of the long requests (what a P95 SLO is about)
sits behind the whole backlog.

Time is measured on a *step clock* in tokens: every step that ran prefill advances it by
``max(tokens processed, largest step seen)``, i.e. by a full budget when the budget was not
filled.  The planner gives a step either to promoted short prompts or to the long head's chunk
(a long chunk does not fit behind a short one when ``--chunked_prefill_size`` equals
``--batch_max_tokens``), so a step spent on a few short prompts costs the overtaken request a
whole step, not just the short prompts' tokens.  For the same reason the strategy waits until
the short prompts it could promote fill a step, or until the oldest of them has waited
``patience_steps`` steps, before it spends a step on them.

The clock and the largest step are kept on the strategy instance; they depend only on the
sequence of ``processed_prefill_tokens`` values, which every TP rank sees identically.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import compress, islice
from operator import attrgetter
from typing import List, Optional

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.base import PrefillQueueStrategy
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec

# Keys of the per-request metadata this strategy binds in ``req.strategy_state``.
FCFS_FINISH_KEY = "slack_fcfs_finish"  # step clock at which default would finish the prompt
FIRST_SEEN_KEY = "slack_first_seen"  # step clock when the request was first ordered
BACKLOG_KEY = "slack_backlog"  # largest prefill backlog seen while waiting


class StepClock:
    """Prefill steps measured in tokens, each counted as at least the largest step seen.

    ``observe`` is called once per ordering with the processed-prefill-token counter; a step
    that advanced the counter by ``d`` advances the clock by ``max(d, budget)``, where
    ``budget`` is the largest ``d`` observed so far (the step budget once one full step ran).
    """

    def __init__(self) -> None:
        self.value = 0
        self.budget = 0
        self._last: Optional[int] = None

    def observe(self, processed_prefill_tokens: int) -> int:
        """Advance with the counter's new value; return the clock."""
        if self._last is None:
            self.value = processed_prefill_tokens
        elif processed_prefill_tokens > self._last:
            step = processed_prefill_tokens - self._last
            self.budget = max(self.budget, step)
            self.value += max(step, self.budget)
        # A counter that did not move (no prefill ran) leaves the clock alone; one that moved
        # back (a new counter) restarts the differences from there without moving the clock.
        self._last = processed_prefill_tokens
        return self.value


class ShortestWithinSlackStrategy(PrefillQueueStrategy):
    """High-priority requests first; then default's order with bounded shortest-first overtaking.

    The base order is ``default``'s (stable by ``infer_high_priority``, then arrival).  Each
    step, candidates are tried shortest first (fewest pending tokens, earliest on ties); a
    candidate moves to the front when

    * every request it would overtake (those ahead of it in the base order and not moved) is
      strictly longer than it, and
    * every one of them still has at least one step (or the promoted tokens, if more) of
      laxity: ``fcfs_finish + slack - clock - work ahead of it in the base order``;

    promotion stops once the promoted requests fill the largest step seen.  If they do not fill
    it, they are promoted only when the oldest has waited ``patience_steps`` steps; otherwise the
    base order is returned unchanged.

    Args (the defaults were chosen with the simulator, ``docs/EN/results.md``):
        overtake_bound: the bound every strategy keeps (``None``: the defaults).
        slack_fraction: share of the backlog a request may be delayed by.
        min_slack_steps: slack of every request, in steps, even when the backlog is small.
        patience_steps: steps a promotable request waits for company before a partly filled
            step is spent on it.
    """

    name = "shortest_within_slack"

    def __init__(
        self,
        overtake_bound: Optional[OvertakeBoundSpec] = None,
        *,
        slack_fraction: float = 0.05,
        min_slack_steps: int = 2,
        patience_steps: int = 4,
    ) -> None:
        super().__init__(overtake_bound)
        self.slack_fraction = slack_fraction
        self.min_slack_steps = min_slack_steps
        self.patience_steps = patience_steps
        self.clock = StepClock()

    def order_prefill(self, prefill_reqs: List[InferReq], processed_prefill_tokens: int) -> List[InferReq]:
        """Return default's order with the promotable shortest requests moved to the front."""
        now = self.clock.observe(processed_prefill_tokens)
        base = sorted(prefill_reqs, key=_PRIORITY)
        # base is sorted by priority, so the high-priority (negative) ones are a prefix.
        start = bisect_left(base, 0, key=_PRIORITY)
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

    def slack(self, req: InferReq) -> int:
        """``max(min_slack_steps * step, slack_fraction * largest backlog seen)`` for a bound request."""
        floor = self.min_slack_steps * self.clock.budget
        return max(floor, int(self.slack_fraction * req.strategy_state[BACKLOG_KEY]))

    def _laxities(self, rest: List[InferReq], pending: List[int], now: int) -> List[int]:
        backlog = sum(pending)
        # ``slack`` inlined (same formula): this loop runs over every waiting request each step.
        floor = self.min_slack_steps * self.clock.budget
        fraction = self.slack_fraction
        laxity: List[int] = []
        append = laxity.append
        ahead = 0
        for req, tokens in zip(rest, pending):
            ahead += tokens
            state = req.strategy_state
            if FCFS_FINISH_KEY not in state:
                state[FCFS_FINISH_KEY] = now + ahead
                state[FIRST_SEEN_KEY] = now
                state[BACKLOG_KEY] = seen = backlog
            else:
                seen = state[BACKLOG_KEY]
                if backlog > seen:
                    state[BACKLOG_KEY] = seen = backlog
            append(state[FCFS_FINISH_KEY] + max(floor, int(fraction * seen)) - now - ahead)
        return laxity

    def _promote(self, pending: List[int], laxity: List[int]) -> List[int]:
        """Indices to move to the front, in promotion order (shortest first).

        Candidates are tried shortest first (fewest pending, lowest index on ties); ``c`` is
        promoted when every kept (not promoted) request before it is strictly longer and has at
        least ``max(step, promoted tokens + pending[c])`` of laxity.  Promotion stops once the
        promoted tokens reach the step.  This rule is evaluated in O(n log n) as follows:

        * Index 0 is never promoted (it overtakes nobody) and stays kept, so no request at least
          as long as it can be promoted: only the ones strictly shorter are candidates.
        * When ``c`` is tried, every kept ``j < c`` with ``pending[j] <= pending[c]`` was tried
          before it (it sorts first) and was skipped; every untried ``j < c`` is strictly longer.
          So "all kept requests before ``c`` are longer" holds exactly when no skipped candidate
          has an index below ``c``: one running minimum (``first_skipped``) decides it.
        * The laxity test needs the minimum laxity over the kept indices below ``c``: a min
          segment tree whose promoted leaves are set to infinity answers it in O(log n).
        """
        n = len(pending)
        step = self.clock.budget
        head = pending[0]
        # compress/map keep the O(n) filter in C; sorted() is stable, so ties go by index.
        shorter = compress(range(1, n), map(head.__gt__, islice(pending, 1, None)))
        candidates = sorted(shorter, key=pending.__getitem__)
        if not candidates:
            return []
        tree = _PrefixMinTree(laxity)
        promoted: List[int] = []
        total = 0
        first_skipped = n  # lowest index of a tried candidate that stayed kept
        for c in candidates:
            if step and total >= step:
                break
            if c >= first_skipped:
                continue  # would overtake a skipped request that is no longer than itself
            if tree.prefix_min(c) < max(step, total + pending[c]):
                first_skipped = c
                if c == 1:
                    break  # every later candidate has an index >= 1: none can pass
                continue
            tree.remove(c)
            promoted.append(c)
            total += pending[c]
        return promoted


_PRIORITY = attrgetter("infer_high_priority")
_INF = float("inf")


class _PrefixMinTree:
    """Minimum of a prefix of ``values`` with removable entries, O(log n) per query or removal.

    ``levels[0]`` holds the values, ``levels[k][i]`` the minimum of ``levels[k - 1][2i : 2i + 2]``;
    every level but the top is padded to even length with infinity.  Removing an entry sets its
    leaf to infinity.
    """

    def __init__(self, values: List[int]) -> None:
        level: List[float] = list(values)
        self.levels: List[List[float]] = [level]
        while len(level) > 1:
            if len(level) & 1:
                level.append(_INF)
            # Pairwise minima built in C (map over two slices): the build stays O(n) and cheap.
            level = list(map(min, level[0::2], level[1::2]))
            self.levels.append(level)

    def prefix_min(self, end: int) -> float:
        """Minimum of the kept values at indices ``[0, end)`` (infinity when none)."""
        result = _INF
        depth = 0
        levels = self.levels
        while end:
            if end & 1:
                # Index end - 1 is a left child whose sibling lies outside the prefix.
                value = levels[depth][end - 1]
                if value < result:
                    result = value
            end >>= 1
            depth += 1
        return result

    def remove(self, index: int) -> None:
        """Drop the value at ``index`` from every later query."""
        levels = self.levels
        levels[0][index] = _INF
        for depth in range(1, len(levels)):
            lower = levels[depth - 1]
            index >>= 1
            value = min(lower[2 * index], lower[2 * index + 1])
            if levels[depth][index] == value:
                break  # unchanged here, so unchanged above
            levels[depth][index] = value
