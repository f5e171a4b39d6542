"""Intra-op torch threads of a CPU model rank, per kind of forward.

On a CPU server the model ranks share the machine's cores with the HTTP, router and
detokenization processes, which stream every decode step's tokens.  A decode step over short
contexts is small matrix products: there a thread pool that competes with the front end for its
core stalls at every parallel region, so it keeps a core free (the ``narrow`` count).  A prefill
forward is compute-bound and streams at most one token per finished prompt, and a decode step over
long contexts is dominated by the attention scan of the KV cache, split over requests in long
parallel regions: both borrow that core (the ``wide`` count).  Measured on a 2-core VM with the
small demo model and ``vllm bench serve`` (docs/EN/results.md): this split beat one thread
everywhere by 5-71% and two threads everywhere on the short-context streaming case.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import ContextManager, Iterator

import torch

# A decode forward whose requests' contexts add up to at least this many positions runs wide
# (LIGHTLLM_LONG_DECODE_POSITIONS). Measured: 64 requests at ~1100 positions (70k) gained 27% wide;
# 128 requests at ~160 (20k) lost 3-16%.
DEFAULT_LONG_DECODE_POSITIONS = 32768


@dataclass(frozen=True)
class ForwardThreads:
    """Torch threads: ``narrow`` is the rank's standing count (short-context decode and everything
    else), ``wide`` the count of prefill forwards and of decode forwards over at least
    ``long_decode_positions`` context positions in total (0: decode never runs wide)."""

    narrow: int
    wide: int
    long_decode_positions: int = DEFAULT_LONG_DECODE_POSITIONS

    def __post_init__(self) -> None:
        if self.narrow < 1 or self.wide < 1:
            raise ValueError(f"thread counts must be positive, got narrow={self.narrow} wide={self.wide}")
        if self.long_decode_positions < 0:
            raise ValueError(f"long_decode_positions must be >= 0, got {self.long_decode_positions}")

    def apply(self) -> None:
        """Make the narrow count the process's standing setting (called once at start-up)."""
        torch.set_num_threads(self.narrow)

    def prefill_forward(self) -> ContextManager[None]:
        """Context of a prefill forward: the wide count."""
        return self._wide()

    def decode_forward(self, context_positions: int) -> ContextManager[None]:
        """Context of a decode forward over ``context_positions`` positions summed over its requests."""
        if self.long_decode_positions and context_positions >= self.long_decode_positions:
            return self._wide()
        return nullcontext()

    @contextmanager
    def _wide(self) -> Iterator[None]:
        if self.wide == self.narrow:
            yield
            return
        torch.set_num_threads(self.wide)
        try:
            yield
        finally:
            torch.set_num_threads(self.narrow)
