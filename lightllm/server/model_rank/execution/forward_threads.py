"""Intra-op torch threads of a CPU model rank, decided per forward from what the forward costs.

On a CPU server the model ranks share the machine's cores with the HTTP, router and
detokenization processes, which stream every decode step's tokens. A rank's standing thread count
(``narrow``) keeps a core free for them; a forward may borrow that core (``wide``) when the
time it saves is larger than the time it takes from them. The front end's work grows with the
tokens a forward streams (one per decode row, one per prompt a prefill finishes), the saving
with the forward's parallelisable work, so the rule is a ratio:

    wide  iff  estimated work (seconds at the narrow count)  >=  T  x  tokens streamed

The work is counted from the model's shapes and priced with rates measured at start-up on this
machine (:mod:`forward_cost`), so the same ``T`` holds on every model width: a small model's decode
row is a fraction of a millisecond of matrix products and stays narrow until its contexts are long
enough for the KV scan to dominate; a ~100M-parameter model's row is milliseconds and runs wide at
any context. ``T`` (``LIGHTLLM_WIDE_FORWARD_MS_PER_TOKEN``, default 0.15 ms) lies between the
server measurements of the two regimes on the small demo model (docs/EN/results.md, "Threads per
forward"): 128 decode rows of ~160 positions (0.08-0.12 ms of estimated work per row) lost 3-16%
wide; 64 rows of ~1100 positions gained: 18-20 ms per decode step wide against 23-26 ms narrow in
the server.  That second forward's estimate is 0.26-0.42 ms per row, depending on the KV scan rate
start-up measures (12-22 GB/s on the development VM: the measurement is noisy), so the threshold
sits where neither regime's estimate crosses it under that noise (at 0.3 ms the 64 x 1100 decode
flipped between wide and narrow from one start to the next).  On the ~100M-parameter model (over
2 ms per row) wide won by a third at 64 rows of ~160 positions.  Read as cost, T is about the
front end's CPU time per streamed token (0.13 ms measured on a whole run: HTTP, detokenizer and
router processes): with two threads the forward's work about halves, so borrowing the core pays
once that half is larger than what it delays.  When other programs hold the cores, wide forwards
run slower than narrow ones whatever the rule says: :mod:`wide_forward_backoff` finds it out from
the forwards' own times and pauses them.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import ContextManager, Iterator, Optional

import torch

from lightllm.server.model_rank.execution.forward_cost import ForwardCostModel
from lightllm.server.model_rank.execution.wide_forward_backoff import WideForwardBackoff
from lightllm.utils.envs_utils import DEFAULT_WIDE_FORWARD_MS_PER_TOKEN  # defined beside its variable


@dataclass(frozen=True)
class WideForwardRule:
    """Decides wide or narrow from a forward's estimated work per streamed token."""

    cost: ForwardCostModel
    min_seconds_per_streamed_token: float = DEFAULT_WIDE_FORWARD_MS_PER_TOKEN / 1000

    def __post_init__(self) -> None:
        if not self.min_seconds_per_streamed_token >= 0:
            raise ValueError(f"min_seconds_per_streamed_token must be >= 0, got {self.min_seconds_per_streamed_token}")

    def decode_is_wide(self, rows: int, context_positions: int) -> bool:
        """A decode forward streams one token per row."""
        return self.cost.decode_seconds(rows, context_positions) >= self.min_seconds_per_streamed_token * max(1, rows)

    def prefill_is_wide(self, new_tokens: int, attended_positions: int, finished_prompts: int) -> bool:
        """A prefill forward streams one token per prompt it finishes; one that finishes none runs wide."""
        if finished_prompts == 0:
            return True
        seconds = self.cost.prefill_seconds(new_tokens, attended_positions, finished_prompts)
        return seconds >= self.min_seconds_per_streamed_token * finished_prompts

    def decode_wide_from_positions(self) -> Optional[int]:
        """Context positions per decode row from which decode runs wide: 0 means always, None never."""
        per_row = self.cost.decode_seconds(1, 0)
        if per_row >= self.min_seconds_per_streamed_token:
            return 0
        scan_per_position = self.cost.decode_seconds(1, 1) - per_row
        if scan_per_position <= 0:
            return None
        needed = (self.min_seconds_per_streamed_token - per_row) / scan_per_position
        # A threshold of inf (documented: no decode forward wide) or one too large for any context
        # gives an infinite count; it ended the rank's start with "cannot convert float NaN to integer".
        return math.ceil(needed) if math.isfinite(needed) else None

    def describe(self) -> str:
        """One line for the start-up log: the rule, the measured rates and where decode turns wide."""
        rates = self.cost.rates
        shape = self.cost.shape
        start = self.decode_wide_from_positions()
        where = ("every decode forward" if start == 0 else "no decode forward" if start is None
                 else f"decode from {start} context positions per row")
        return (
            f"wide forward when estimated work >= {self.min_seconds_per_streamed_token * 1e3:g} ms per streamed token "
            f"(measured here: {rates.matmul_flops_per_s / 1e9:.1f} GFLOP/s, KV scan {rates.kv_scan_bytes_per_s / 1e9:.1f} GB/s; "
            f"a decode row is {shape.matmul_flops_per_token() / 1e6:.1f} MFLOP = "
            f"{self.cost.decode_seconds(1, 0) * 1e3:.2f} ms + {shape.kv_bytes_per_position()} B per context position): "
            f"{where}, prefill unless it streams more than it computes"
        )


@dataclass(frozen=True)
class ForwardThreads:
    """Torch threads: ``narrow`` is the rank's standing count, ``wide`` the count a forward borrows
    when ``rule`` says its work pays for the front end's core. Without a rule prefill runs wide and
    decode narrow."""

    narrow: int
    wide: int
    rule: Optional[WideForwardRule] = None
    # Pauses wide forwards while another program keeps the borrowed core busy.
    backoff: Optional[WideForwardBackoff] = None

    def __post_init__(self) -> None:
        if self.narrow < 1 or self.wide < 1:
            raise ValueError(f"thread counts must be positive, got narrow={self.narrow} wide={self.wide}")

    def apply(self) -> None:
        """Make the narrow count the process's standing setting (called once at start-up)."""
        torch.set_num_threads(self.narrow)

    def prefill_forward(self, new_tokens: int, attended_positions: int, finished_prompts: int) -> ContextManager[None]:
        """Context of a prefill forward (see :meth:`WideForwardRule.prefill_is_wide`)."""
        if self.rule is None:
            return self._wide(None)
        if self.rule.prefill_is_wide(new_tokens, attended_positions, finished_prompts):
            return self._wide(self.rule.cost.prefill_seconds(new_tokens, attended_positions, finished_prompts),
                              "prefill")
        return nullcontext()

    def decode_forward(self, rows: int, context_positions: int) -> ContextManager[None]:
        """Context of a decode forward of ``rows`` requests over ``context_positions`` positions in all."""
        if self.rule is not None and self.rule.decode_is_wide(rows, context_positions):
            return self._wide(self.rule.cost.decode_seconds(rows, context_positions), "decode")
        return nullcontext()

    @contextmanager
    def _wide(self, estimated_s: Optional[float], kind: str = "prefill") -> Iterator[None]:
        """A forward the rule wants wide; the backoff may keep it narrow (``estimated_s``: its work at the
        narrow count, None when there is no rule to price it)."""
        if self.wide == self.narrow:
            yield
            return
        backoff = self.backoff if estimated_s is not None else None
        wide = backoff is None or backoff.runs_wide()
        if wide:
            torch.set_num_threads(self.wide)
        started = time.perf_counter()
        try:
            yield
        finally:
            if wide:
                torch.set_num_threads(self.narrow)
            if backoff is not None:
                backoff.record(kind, wide, time.perf_counter() - started, estimated_s)
