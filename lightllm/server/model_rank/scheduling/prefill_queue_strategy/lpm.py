"""``lpm``: longest prefix match first, the cache-aware order.

A request whose prompt is largely in the radix prefix cache costs little prefill and, served
early, returns its cached prefix to the shared tree sooner (pinned nodes are released when it
finishes).  ``lpm`` therefore offers requests with the most cached prompt tokens first.
"""

from __future__ import annotations

from typing import List

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.base import (
    PrefillQueueStrategy,
    split_by_infer_priority,
)


class LongestPrefixMatchStrategy(PrefillQueueStrategy):
    """High-priority requests first (arrival order), then normal ones by cached prompt tokens.

    The cached length is ``prompt_cache_len``: the prompt tokens the radix prefix cache matched
    when the backend received the request, grown at each step by what the request adopts from
    prompts other requests have just computed (``share_prefixes``; fixed once a request pauses after
    computing part of its prompt), so a waiting request can move
    ahead of earlier arrivals as its prefix gets computed.  More cached tokens go first; equal ones keep their
    arrival order (first come, first served), as ``default`` would.  Like every strategy it runs
    under the overtaking bound, which matters here: a request that shares nothing with the cache
    would otherwise wait for as long as cache-hitting requests keep arriving.
    """

    name = "lpm"

    def order_prefill(self, prefill_reqs: List[InferReq], processed_prefill_tokens: int) -> List[InferReq]:
        """Return high-priority requests, then the others by descending cached prompt tokens."""
        high, normal = split_by_infer_priority(prefill_reqs)
        # sorted() is stable: equal cache hits stay in arrival order.
        return high + sorted(normal, key=lambda req: -req.prompt_cache_len)
