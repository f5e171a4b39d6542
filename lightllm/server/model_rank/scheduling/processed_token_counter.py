"""The backend's count of prefill tokens submitted for execution.

HRRN measures how long a request has waited in units of prefill work done by the backend since
the request arrived, not in seconds: every TP rank submits the same batches, so every rank
computes the same waits and the same order, while wall clocks may differ between ranks.
"""

from __future__ import annotations


class ProcessedPrefillTokenCounter:
    """Monotonic count of prefill tokens the backend has submitted.

    The backend owns one instance (no global).  A new ``InferReq`` stores ``snapshot()`` as its
    ``arrival_processed_prefill_tokens``; the backend calls ``advance`` once per submitted
    prefill batch (see ``step_planner.submit_prefill``).
    """

    def __init__(self, initial: int = 0) -> None:
        self._value = _check_count(initial, "initial")

    @property
    def value(self) -> int:
        """Prefill tokens submitted so far."""
        return self._value

    def advance(self, n: int) -> None:
        """Add ``n`` submitted prefill tokens; ``n`` must be a non-negative int."""
        self._value += _check_count(n, "n")

    def snapshot(self) -> int:
        """Current value, to be stored as a new request's ``arrival_processed_prefill_tokens``."""
        return self._value

    def __repr__(self) -> str:
        return f"ProcessedPrefillTokenCounter(value={self._value})"


def _check_count(n: int, param: str) -> int:
    # bool is an int subclass; accepting True as 1 would hide caller bugs.
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"{param} must be an int, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"{param} must be >= 0, got {n}")
    return n
