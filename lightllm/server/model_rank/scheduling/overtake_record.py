"""What the overtaking bound remembers about one request.

It is a field of :class:`~lightllm.server.model_rank.scheduling.infer_req.InferReq` written only by
:class:`~lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound.OvertakeBound`;
it lives in its own module so that the request record does not import the strategy package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class OvertakeRecord:
    """What the bound keeps on one request (``InferReq.overtake``); written only by the bound.

    Attributes:
        seq: arrival sequence number on this rank (the second half of the default key), given
            when the backend takes the request in.
        ahead_tokens: the FCFS wait when first waiting for prefill: pending prompt tokens ahead
            in default's order (None until then).
        allowance: ``base_tokens + floor(fraction * ahead_tokens)`` (None until then).
        overtaken_tokens: tokens given to requests behind it in default's order in steps that
            gave it nothing, so far.
        protected: set once ``overtaken_tokens >= allowance``; never cleared.
    """

    seq: int
    ahead_tokens: Optional[int] = None
    allowance: Optional[int] = None
    overtaken_tokens: int = 0
    protected: bool = False
