"""What the overtaking bound remembers about one request.

It is a field of :class:`~lightllm.server.model_rank.scheduling.infer_req.InferReq` written only by
:class:`~lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound.OvertakeBound`;
it lives in its own module so that the request record does not import the strategy package.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Union


@dataclass
class OvertakeRecord:
    """What the bound keeps on one request (``InferReq.overtake``); written only by the bound.

    Attributes:
        seq: arrival sequence number on this rank (the second half of the default key); a
            fraction between its neighbours' for a request first ordered after later arrivals.
        ahead_tokens: the FCFS wait when first seen: pending prompt tokens ahead in default's order.
        allowance: ``base_tokens + floor(fraction * ahead_tokens)``.
        overtaken_tokens: tokens given to requests behind it in default's order in steps that
            gave it nothing, so far.
        protected: set once ``overtaken_tokens >= allowance``; never cleared.
    """

    seq: Union[int, Fraction]
    ahead_tokens: int
    allowance: int
    overtaken_tokens: int = 0
    protected: bool = False
