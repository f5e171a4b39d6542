"""The waiting bound every prefill-queue strategy runs under.

A strategy may reorder the prefill queue however it likes, but a request that has waited more
than ``max_wait_tokens`` processed prefill tokens is *aged*: aged requests are moved in front of
every request that is not, in arrival order.  Together with the step planner's rule that the
head of the prefill order always gets a chunk (truncated to the remaining budget if needed),
this bounds how long any request can wait, whatever the strategy (see
``docs/EN/prefill_queue_strategy.md``, "The waiting bound", for the formula and its proof).

Waiting is measured on the ``ProcessedPrefillTokenCounter`` clock, which advances identically on
every TP rank, so every rank ages the same requests at the same step.  The bound is applied
here once, around ``order_prefill``, rather than inside each strategy, so a strategy added to
the registry is bounded without writing a line for it.
"""

from __future__ import annotations

from typing import List, Sequence

from lightllm.server.router.model_infer.infer_req import InferReq

# Chosen from simulator measurements (docs/EN/results.md, "Choosing the waiting bound"): the
# smallest power of two that keeps hrrn's and promote_shortest's short-TTFT gains in every seed
# scenario, while bounding a long prompt's wait under sustained short traffic.
DEFAULT_PREFILL_MAX_WAIT_TOKENS = 65536


def check_max_wait_tokens(value: int) -> int:
    """Return ``value`` if it is a valid ``prefill_max_wait_tokens`` (an int >= 0, 0 disables)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"prefill_max_wait_tokens must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"prefill_max_wait_tokens must be >= 0 (0 disables the bound), got {value}")
    return value


def prefill_waited_tokens(req: InferReq, processed_prefill_tokens: int) -> int:
    """Processed prefill tokens since ``req`` arrived (its wait on the counter clock)."""
    return processed_prefill_tokens - req.arrival_processed_prefill_tokens


class PrefillWaitBound:
    """Moves aged requests (waited > ``max_wait_tokens``) to the front, in arrival order.

    Args:
        max_wait_tokens: the bound in processed prefill tokens; ``0`` disables it (the
            strategy's order is returned unchanged).
    """

    def __init__(self, max_wait_tokens: int) -> None:
        self.max_wait_tokens = check_max_wait_tokens(max_wait_tokens)

    @property
    def enabled(self) -> bool:
        """Whether the bound reorders anything."""
        return self.max_wait_tokens > 0

    def is_aged(self, req: InferReq, processed_prefill_tokens: int) -> bool:
        """Whether ``req`` has waited past the bound (always False when disabled)."""
        return self.enabled and prefill_waited_tokens(req, processed_prefill_tokens) > self.max_wait_tokens

    def apply(
        self,
        arrival_order: Sequence[InferReq],
        strategy_order: Sequence[InferReq],
        processed_prefill_tokens: int,
    ) -> List[InferReq]:
        """Return ``strategy_order`` with the aged requests moved to the front in arrival order.

        ``arrival_order`` is the same requests as the backend holds them (admission order, which
        every TP rank shares); aged requests are sorted stably by their arrival snapshot, so
        equal snapshots keep that order.  Non-aged requests keep the strategy's order.  Neither
        input is modified.
        """
        if not self.enabled:
            return list(strategy_order)
        # waited > max_wait_tokens  <=>  arrived before this snapshot (one subtraction per step).
        aged_before = processed_prefill_tokens - self.max_wait_tokens
        aged = [r for r in arrival_order if r.arrival_processed_prefill_tokens < aged_before]
        if not aged:
            return list(strategy_order)
        aged.sort(key=lambda r: r.arrival_processed_prefill_tokens)
        aged_ids = {id(r) for r in aged}
        return aged + [r for r in strategy_order if id(r) not in aged_ids]

    def __repr__(self) -> str:
        return f"PrefillWaitBound(max_wait_tokens={self.max_wait_tokens})"
