"""The contract every prefill-queue strategy follows.

A strategy runs in the order phase of each engine step, after the classify phase has split the
ready requests into decode and prefill (``request_classifier.py``) and before compute-token
budgeting and KV allocation.  It sees only the prefill requests and only decides the order in
which they are offered to the step planner.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, List, Optional, Sequence, Tuple

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import (
    OvertakeBound,
    OvertakeBoundSpec,
)


class PrefillQueueStrategy(ABC):
    """Base class of the prefill-queue strategies.

    :meth:`order` receives the step's prefill requests (the engine's classify phase has already
    set the decode ones aside), lets the subclass order them through ``order_prefill`` and then
    applies the overtaking bound (:class:`OvertakeBound`), so every strategy is bounded by the
    same code.  The engine reports each submitted prefill step back through :meth:`charge`.

    Args:
        overtake_bound: ``--prefill_max_overtake_tokens`` / ``--prefill_overtake_fraction``: how
            much later work may be served ahead of a request before it is protected (``None``:
            the defaults; ``OvertakeBoundSpec.off()`` disables the bound).

    Contract for subclasses:
      * ``order_prefill`` returns a permutation of its input;
      * it never mutates the input list or request state, except metadata it binds lazily in
        ``req.strategy_state``;
      * it is deterministic: ties are broken by input order or ``request_id``, never by wall
        clock or randomness, so every TP rank computes the same order.
    """

    name: ClassVar[str] = ""

    def __init__(self, overtake_bound: Optional[OvertakeBoundSpec] = None) -> None:
        self.overtake_bound = OvertakeBound(overtake_bound)

    def admit(self, req: InferReq) -> None:
        """Note a request as the backend takes it in (its arrival number for the overtaking bound)."""
        self.overtake_bound.number(req)

    def order(self, prefill_reqs: Sequence[InferReq], processed_prefill_tokens: int) -> List[InferReq]:
        """Return ``prefill_reqs`` in the order the step planner should consider them.

        The order is the strategy's, except that protected requests (see :class:`OvertakeBound`)
        are pulled in front of every request ``default`` puts behind them.  ``prefill_reqs`` is
        expected in the order the backend received the requests (arrival order) and holds no
        decode requests; ``processed_prefill_tokens`` is the backend's
        ``ProcessedPrefillTokenCounter.value``.

        The engine calls this in every step that has ready requests, even with no prefill among
        them, because strategies may track the counter from step to step (the slack strategy's
        step clock).
        """
        if isinstance(processed_prefill_tokens, bool) or not isinstance(processed_prefill_tokens, int):
            raise ValueError(
                f"processed_prefill_tokens must be an int, got {type(processed_prefill_tokens).__name__}"
            )
        if processed_prefill_tokens < 0:
            raise ValueError(f"processed_prefill_tokens must be >= 0, got {processed_prefill_tokens}")
        self.overtake_bound.bind(prefill_reqs)
        # Hand the subclass its own list so a careless in-place sort cannot reach the caller.
        ordered_prefill = list(self.order_prefill(list(prefill_reqs), processed_prefill_tokens))
        self._check_permutation(prefill_reqs, ordered_prefill)
        return self.overtake_bound.apply(ordered_prefill)

    def charge(self, served: Sequence[Tuple[InferReq, int]], unserved: Sequence[InferReq],
               deferred: Sequence[Tuple[InferReq, InferReq]] = ()) -> None:
        """Account for a submitted prefill step: ``served`` (request, chunk tokens), ``unserved``
        the prefill requests it skipped, ``deferred`` (request, owner) those that wait for the
        owner's chunk (see :meth:`OvertakeBound.charge`)."""
        self.overtake_bound.charge(served, unserved, deferred)

    @abstractmethod
    def order_prefill(self, prefill_reqs: List[InferReq], processed_prefill_tokens: int) -> List[InferReq]:
        """Return ``prefill_reqs`` in the order the step planner should consider them."""

    def _check_permutation(self, before: Sequence[InferReq], after: List[InferReq]) -> None:
        # A dropped or duplicated request would silently stall or double-schedule it, so a
        # faulty strategy must fail loudly; the check is O(n) on identities.
        if len(before) != len(after) or {id(r) for r in before} != {id(r) for r in after}:
            raise RuntimeError(
                f"prefill queue strategy {self.name!r} did not return a permutation of its input "
                f"({len(before)} requests in, {len(after)} out)"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, overtake_bound={self.overtake_bound.spec.describe()!r})"


def split_by_infer_priority(reqs: Sequence[InferReq]) -> Tuple[List[InferReq], List[InferReq]]:
    """Split into ``(high, normal)``: negative ``infer_high_priority`` is high; input order kept.

    Only the internal inference priority counts; the router's ``high_priority_request``
    admission flag does not influence prefill ordering.
    """
    high: List[InferReq] = []
    normal: List[InferReq] = []
    for req in reqs:
        (high if req.infer_high_priority < 0 else normal).append(req)
    return high, normal
