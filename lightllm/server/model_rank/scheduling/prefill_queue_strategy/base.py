"""The contract every prefill-queue strategy follows.

A strategy runs on the ready requests of each backend step, after not-ready requests are
filtered out and before compute-token budgeting and KV allocation.  It only decides the order
in which prefill requests are offered to the step planner.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, List, Optional, Sequence, Tuple

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import (
    OvertakeBound,
    OvertakeBoundSpec,
)
from lightllm.server.model_rank.scheduling.request_classifier import NORMAL_CLASSIFIER, RequestClassifier


class PrefillQueueStrategy(ABC):
    """Base class of the prefill-queue strategies.

    ``reorder`` keeps decode requests (recognised by the mode's :class:`RequestClassifier`, the
    same one the step planner uses) at the front in their existing order and lets the subclass order only
    the prefill requests through ``order_prefill``; it then applies the overtaking bound
    (:class:`OvertakeBound`), so every strategy is bounded by the same code.  The engine reports
    each submitted prefill step back through :meth:`charge`.

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

    def reorder(
        self,
        reqs: Sequence[InferReq],
        processed_prefill_tokens: int,
        *,
        classifier: RequestClassifier = NORMAL_CLASSIFIER,
    ) -> List[InferReq]:
        """Return ``reqs`` reordered: decode requests first (stable), then ordered prefill ones.

        Prefill requests come in the strategy's order, except that protected ones (see
        :class:`OvertakeBound`) are pulled in front of every request ``default`` puts behind them.
        ``reqs`` is expected in the order the backend received the requests (arrival order).

        ``processed_prefill_tokens`` is the backend's ``ProcessedPrefillTokenCounter.value``;
        ``classifier`` is the mode backend's classification variant.
        """
        if isinstance(processed_prefill_tokens, bool) or not isinstance(processed_prefill_tokens, int):
            raise ValueError(
                f"processed_prefill_tokens must be an int, got {type(processed_prefill_tokens).__name__}"
            )
        if processed_prefill_tokens < 0:
            raise ValueError(f"processed_prefill_tokens must be >= 0, got {processed_prefill_tokens}")
        decode_reqs, prefill_reqs = classifier.split(reqs)
        self.overtake_bound.bind(prefill_reqs)
        # Hand the subclass its own list so a careless in-place sort cannot reach the caller.
        ordered_prefill = list(self.order_prefill(list(prefill_reqs), processed_prefill_tokens))
        self._check_permutation(prefill_reqs, ordered_prefill)
        return decode_reqs + self.overtake_bound.apply(ordered_prefill)

    def charge(self, served: Sequence[Tuple[InferReq, int]], unserved: Sequence[InferReq]) -> None:
        """Account for a submitted prefill step: ``served`` (request, chunk tokens), ``unserved``
        the prefill requests it skipped (see :meth:`OvertakeBound.charge`)."""
        self.overtake_bound.charge(served, unserved)

    @abstractmethod
    def order_prefill(self, prefill_reqs: List[InferReq], processed_prefill_tokens: int) -> List[InferReq]:
        """Return ``prefill_reqs`` in the order the step planner should consider them."""

    def _check_permutation(self, before: List[InferReq], after: List[InferReq]) -> None:
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
