"""``InferenceContext.share_prefix`` skips the prefix-cache walk only when it could find nothing new.

Requests waiting for their first chunk are offered the prefix cache every step.  The cheap path
(no walk when no cached run continues the request's match) must give exactly what a full lookup
gives; these tests drive the real context and radix cache through random arrivals, chunks and
releases and compare every request with a fresh lookup after every step.
"""

from __future__ import annotations

import random
from typing import List

import pytest
import torch

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.common.req_manager import ReqManager
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.infer_req import InferReq

MAX_LEN = 400


def _context(kv_tokens: int = 50_000, rows: int = 64) -> InferenceContext:
    return InferenceContext(KVCacheMemoryManager(kv_tokens, 1, 1, 2, torch.float32), ReqManager(rows, MAX_LEN + 1))


def _request(request_id: int, prompt: List[int]) -> InferReq:
    return InferReq(request_id=request_id, prompt_ids=prompt, max_new_tokens=8, arrival_processed_prefill_tokens=0)


def _compute(context: InferenceContext, req: InferReq, tokens: int) -> None:
    """What a prefill forward leaves behind: slots reserved and ``tokens`` more positions computed."""
    tokens = min(tokens, req.total_len - req.cur_kv_len)
    context.reserve(req, tokens)
    req.cur_kv_len += tokens


def _longest_cached(context: InferenceContext, req: InferReq) -> int:
    limit = max(req.cur_kv_len, req.cacheable_prefix_len)
    _, matched, _ = context.radix_cache.match_prefix(req.token_slice(0, limit), update_refs=False)
    return matched


def test_a_waiting_request_adopts_a_prefix_computed_after_it_arrived():
    context = _context()
    prefix = list(range(100, 180))
    first, second = _request(0, prefix + [1, 2, 3]), _request(1, prefix + [4, 5])
    context.attach(first)
    context.attach(second)
    assert second.cur_kv_len == 0
    _compute(context, first, 48)
    assert context.share_prefix(first) == 0
    assert context.share_prefix(second) == 48
    assert second.cur_kv_len == second.kv_slot_len == 48
    # Its slots are now the cache's, the same ones the first request computed.
    assert torch.equal(context.slots(second, 0, 48), context.slots(first, 0, 48))
    _compute(context, first, 40)
    context.share_prefix(first)
    assert context.share_prefix(second) == 32  # up to the end of the common prefix
    assert second.cur_kv_len == 80


def test_unrelated_cache_content_does_not_walk_a_waiting_request_again():
    context = _context()
    waiting = _request(0, list(range(1000, 1300)))
    other = _request(1, list(range(2000, 2300)))
    context.attach(waiting)
    context.attach(other)
    _compute(context, other, 64)
    context.share_prefix(other)  # the cache's content changes
    root = context.radix_cache.root
    stamp = root.last_access
    assert context.share_prefix(waiting) == 0
    # A lookup stamps every node it walks, the root first; the cheap path walked nothing.
    assert root.last_access == stamp
    # A run that continues the request's (empty) match is found, and then it does walk.
    sharer = _request(2, list(range(1000, 1040)) + [7])
    context.attach(sharer)
    _compute(context, sharer, 40)
    context.share_prefix(sharer)
    assert context.share_prefix(waiting) == 40
    assert root.last_access > stamp


@pytest.mark.parametrize("seed", range(12))
def test_every_request_holds_the_longest_cached_prefix_after_every_step(seed):
    rng = random.Random(seed)
    context = _context()
    families = [[rng.randrange(50, 90) for _ in range(rng.randint(1, 120))] for _ in range(3)]
    live: List[InferReq] = []
    next_id = 0
    adopted = 0
    for _step in range(120):
        # Arrivals: a family's prefix (or part of it) and a tail; a burst every 30 steps, so
        # requests wait while others of their family compute the prefix.
        for _ in range(12 if _step % 30 == 0 else rng.choice([0, 0, 1, 2])):
            if len(live) >= 40:
                break
            family = rng.choice(families)
            cut = rng.randint(len(family) // 2, len(family))
            tail = [rng.randrange(50, 90) for _ in range(rng.randint(1, 60))]
            req = _request(next_id, (family[:cut] + tail)[: MAX_LEN - 8])
            next_id += 1
            context.attach(req)
            live.append(req)
        if not live:
            continue
        # A prefill step: the oldest one to three requests compute a chunk (first come, first
        # served, so younger requests of the same family wait while their prefix is computed).
        for req in live[: rng.randint(1, 3)]:
            if req.cur_kv_len < req.input_len:
                _compute(context, req, rng.choice([1, 7, 32, 64]))
        # Some requests end; their computed tokens enter the cache.
        for req in [r for r in live if r.cur_kv_len >= r.input_len or rng.random() < 0.03]:
            context.release(req)
            live.remove(req)
        # Between steps every request still prefilling is offered the cache, in admission order;
        # each one then holds the longest prefix cached at that moment (a later request's
        # publishing may extend an earlier one's match, which the next step picks up).
        for req in live:
            adopted += context.share_prefix(req) > 0
            assert req.cur_kv_len == req.kv_slot_len
            assert req.cur_kv_len == _longest_cached(context, req), f"request {req.request_id}"
    assert adopted > 0  # the stream did exercise adoption, not only the cheap path
    for req in live:
        context.release(req)
    assert context.clear_prefix_cache() >= 0
    assert context.kv_cache.available == context.kv_cache.size
