"""The overtaking bound every prefill-queue strategy runs under.

Starvation is not waiting; it is being overtaken, again and again, by work that arrived later.
So the bound limits what a strategy may do *compared with* ``default`` (first come, first served
within each inference priority), not how long a request waits behind a backlog that ``default``
would have made it wait behind too.

Every request ``r`` gets, when the strategy first sees it, an allowance

    allowance(r) = base_tokens + floor(fraction * ahead(r))

where ``ahead(r)`` is the prefill work ``default`` puts in front of it at that moment (the pending
prompt tokens of every waiting request with a smaller default key ``(infer_high_priority,
arrival)``): its first-come-first-served wait.  Each step, a request that got no chunk is charged
the tokens the step gave to requests behind it in ``default``'s order (its *overtaken* tokens).
Once its overtaken tokens reach its allowance, the request is *protected*: from then on the order
puts it in front of every request that ``default`` would put behind it.  Nothing else moves: the
strategy's order is kept except that each protected request is pulled forward just far enough.

So under a backlog a request may lose at most a ``fraction`` of what FCFS would make it wait
anyway, a long prompt facing a stream of later short ones with little ahead of it is protected
after ``base_tokens``, and ``default`` is never changed (its order already puts every request in
front of everything behind it).  High-priority work (PD continuation segments) is ahead of normal
requests in ``default``'s order, so a protected normal request never overtakes it.  The formula
and its proof are in ``docs/EN/prefill_queue_strategy.md`` ("The overtaking bound").

Everything is measured on the processed-prefill-token clock and decided from the order in which
the backend received the requests, so every TP rank protects the same requests at the same step.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property
from fractions import Fraction
from typing import Dict, List, Optional, Sequence, Tuple

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.overtake_record import OvertakeRecord

# Chosen with the simulator (docs/EN/results.md, "Choosing the overtaking bound"): the seed's
# headline cells keep their short-TTFT gain, and long prompts behind a stream of short ones lose
# little compared with default.
DEFAULT_PREFILL_MAX_OVERTAKE_TOKENS = 2048
DEFAULT_PREFILL_OVERTAKE_FRACTION = 0.15
# Upper limits of the bound's values (the server's flags and the simulator's take the same).
# Rank 0 publishes both to the int64 shared stats block (the fraction in millionths), and beyond
# these a bound no longer limits anything a server could do: 10**12 tokens is months of prefill
# work; a request allowed to lose 1000 times its FCFS wait is as good as unbounded, which
# --disable_prefill_overtake_bound says plainly.
MAX_PREFILL_OVERTAKE_TOKENS = 10**12
MAX_PREFILL_OVERTAKE_FRACTION = 1000.0



@dataclass(frozen=True)
class OvertakeBoundSpec:
    """The bound's two parameters (``--prefill_max_overtake_tokens``, ``--prefill_overtake_fraction``).

    ``enabled=False`` (``--disable_prefill_overtake_bound``) lets strategies overtake without
    limit, as the seed's strategies did.
    """

    base_tokens: int = DEFAULT_PREFILL_MAX_OVERTAKE_TOKENS
    fraction: float = DEFAULT_PREFILL_OVERTAKE_FRACTION
    enabled: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.base_tokens, bool) or not isinstance(self.base_tokens, int) or self.base_tokens < 0:
            raise ValueError(f"prefill_max_overtake_tokens must be an int >= 0, got {self.base_tokens!r}")
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)):
            raise ValueError(f"prefill_overtake_fraction must be a number, got {self.fraction!r}")
        if not (math.isfinite(self.fraction) and self.fraction >= 0):
            raise ValueError(f"prefill_overtake_fraction must be a finite number >= 0, got {self.fraction!r}")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be a bool, got {self.enabled!r}")

    @classmethod
    def off(cls) -> "OvertakeBoundSpec":
        """The bound disabled (strategies may overtake without limit)."""
        return cls(enabled=False)

    @cached_property
    def _exact_fraction(self) -> Fraction:
        # The fraction as the decimal it was written as (0.29 is 29/100), so that floor(fraction
        # x ahead) is exact: in binary floating point 0.29 x 100 is 28.999..., one token short.
        # Not a field: the spec's fields are its parameters, which reports write out as they are.
        return Fraction(repr(float(self.fraction)))

    def allowance(self, ahead_tokens: int) -> int:
        """Tokens of later work a request with ``ahead_tokens`` of FCFS wait may be overtaken by."""
        return self.base_tokens + math.floor(self._exact_fraction * ahead_tokens)

    def describe(self) -> str:
        """One line for logs: the formula with its numbers."""
        if not self.enabled:
            return "off"
        return f"{self.base_tokens} + {self.fraction:g} x FCFS wait"


def default_key(req: InferReq) -> Tuple[int, int]:
    """The request's place in ``default``'s order: inference priority, then arrival."""
    return (req.infer_high_priority, req.overtake.seq)


class OvertakeBound:
    """Binds allowances, charges overtaken tokens and pulls protected requests forward.

    One instance per strategy (per rank): its arrival counter numbers requests in the order the
    backend received them, which every TP rank shares.
    """

    def __init__(self, spec: Optional[OvertakeBoundSpec] = None) -> None:
        self.spec = spec if spec is not None else OvertakeBoundSpec()
        if not isinstance(self.spec, OvertakeBoundSpec):
            raise ValueError(f"overtake bound must be an OvertakeBoundSpec, got {self.spec!r}")
        self._next_seq = 0

    @property
    def enabled(self) -> bool:
        """Whether the bound reorders anything."""
        return self.spec.enabled

    def number(self, req: InferReq) -> None:
        """Give ``req`` the next arrival number, once: the step engine calls this as the backend
        takes the request in, so requests are numbered in the order every TP rank received them,
        also one that starts as a decode (a prefix hit left it one token) and reaches the prefill
        list only later, after a pause."""
        if req.overtake is None:
            req.overtake = OvertakeRecord(self._next_seq)
            self._next_seq += 1

    def bind(self, arrival_order: Sequence[InferReq]) -> None:
        """Give every request waiting for prefill for the first time its allowance.

        ``arrival_order`` is the waiting prefill requests in the order the backend received them.
        A newcomer's FCFS wait counts every waiting request ahead of it in default's order: the
        same-priority ones received before it and every one of a higher priority.  A request not
        numbered yet (no engine took it in: a direct caller) is numbered here, in that order.
        """
        if all(req.overtake is not None and req.overtake.allowance is not None for req in arrival_order):
            return
        class_totals: Dict[int, int] = {}
        for req in arrival_order:
            prio = req.infer_high_priority
            class_totals[prio] = class_totals.get(prio, 0) + req.pending_token_num
        running: Dict[int, int] = {}
        for req in arrival_order:
            prio = req.infer_high_priority
            before = running.get(prio, 0)
            self.number(req)
            record = req.overtake
            if record.allowance is None:
                record.ahead_tokens = before + sum(total for p, total in class_totals.items() if p < prio)
                record.allowance = self.spec.allowance(record.ahead_tokens)
                record.protected = self.enabled and record.allowance == 0
            running[prio] = before + req.pending_token_num

    def apply(self, strategy_order: Sequence[InferReq]) -> List[InferReq]:
        """Return ``strategy_order`` with each protected request pulled in front of everything
        default puts behind it; the rest keep the strategy's order.  Nothing is modified."""
        if not self.enabled:
            return list(strategy_order)
        protected = [req for req in strategy_order if req.overtake.protected]
        if not protected:
            return list(strategy_order)
        protected.sort(key=default_key)
        emitted = set()
        result: List[InferReq] = []
        next_protected = 0
        for index, req in enumerate(strategy_order):
            if next_protected == len(protected):
                # Every protected request is placed; the rest keep the strategy's order.
                result.extend(r for r in strategy_order[index:] if id(r) not in emitted)
                break
            if id(req) in emitted:
                continue
            # Protected requests come out in default's order, each no later than the first request
            # default puts behind it (or than its own place in the strategy's order).
            limit = default_key(req)
            while next_protected < len(protected) and default_key(protected[next_protected]) <= limit:
                head = protected[next_protected]
                next_protected += 1
                if id(head) not in emitted:
                    emitted.add(id(head))
                    result.append(head)
            if id(req) not in emitted:
                emitted.add(id(req))
                result.append(req)
        return result

    def charge(self, served: Sequence[Tuple[InferReq, int]], unserved: Sequence[InferReq],
               deferred: Sequence[Tuple[InferReq, InferReq]] = ()) -> None:
        """Charge each unserved waiting request the tokens ``served`` gave to requests behind it.

        Call once per submitted prefill step with its chunks (request, tokens), the prefill
        requests it skipped, and ``deferred``: (request, owner) for each request that waits to
        take the owner's chunk from the prefix cache.  A request that got a chunk is not charged:
        it advanced by as much as a step gives one request, so the others' tokens did not delay
        it.  Nor is one deferred for the chunk of a request ahead of it in default's order, which
        default defers the same way (its chunk fit; it takes at least half of it from the cache
        next step); one deferred for later work is charged as skipped, or a strategy ordering
        later arrivals that repeat its chunks first could defer it step after step unprotected.
        With the bound disabled the tokens are still counted (for /metrics) but nobody is protected.
        """
        if deferred:
            unserved = [*unserved, *(req for req, owner in deferred if default_key(owner) > default_key(req))]
        if not served or not unserved:
            return
        keyed = sorted((default_key(req), tokens) for req, tokens in served)
        keys = [key for key, _ in keyed]
        # behind[i]: tokens served to keys[i:] (the suffix sums).
        behind = [0] * (len(keyed) + 1)
        for i in range(len(keyed) - 1, -1, -1):
            behind[i] = behind[i + 1] + keyed[i][1]
        for req in unserved:
            record = req.overtake
            tokens = behind[bisect_right(keys, default_key(req))]
            if tokens:
                record.overtaken_tokens += tokens
                if self.enabled and record.overtaken_tokens >= record.allowance:
                    record.protected = True

    def __repr__(self) -> str:
        return f"OvertakeBound({self.spec.describe()})"

