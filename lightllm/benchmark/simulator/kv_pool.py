"""KV cache accounting by token count, standing in for the server's slot allocator."""

from __future__ import annotations


class KvTokenPool:
    """A counter of free KV tokens.

    The server's allocator hands out individual slots; the scheduling decisions only ever look at
    how many are free (``allocatable_token_num``), so a count is all the simulator needs.  There
    is no prefix cache: a released request's tokens return to the pool at once.
    """

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self.used = 0

    def free_tokens(self) -> int:
        """Tokens that can be allocated now (a callable, as the step planner accepts)."""
        return self.capacity - self.used

    def alloc(self, n: int) -> None:
        """Take ``n`` tokens; running out is a scheduling bug, so it raises."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self.capacity - self.used:
            raise RuntimeError(f"KV pool exhausted: asked for {n} tokens, {self.capacity - self.used} free")
        self.used += n

    def free(self, n: int) -> None:
        """Give ``n`` tokens back."""
        if n < 0 or n > self.used:
            raise ValueError(f"n must be within [0, {self.used}], got {n}")
        self.used -= n
