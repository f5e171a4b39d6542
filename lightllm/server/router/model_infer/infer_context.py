"""Per-rank inference state: live requests, their request rows, KV slots and the prefix cache."""

from __future__ import annotations

from typing import Dict, Optional

import torch

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.common.req_manager import ReqManager
from lightllm.server.router.dynamic_prompt.radix_cache import RadixCache
from lightllm.server.router.dynamic_prompt.radix_node import RadixNode
from lightllm.server.router.model_infer.infer_req import InferReq


class InferenceContext:
    """Owns the lifecycle of requests on one rank.

    Slot ownership: a request owns the slots of positions ``[matched_len, cur_kv_len)`` of its
    row; positions below ``matched_len`` belong to the prefix cache and are protected by the
    request's hold on ``match_node``.  On release the computed tokens go into the prefix cache
    (which keeps the slots) or, with the cache disabled, straight back to the allocator.
    """

    def __init__(self, kv_cache: KVCacheMemoryManager, req_manager: ReqManager, use_prefix_cache: bool = True):
        self.kv_cache = kv_cache
        self.req_manager = req_manager
        self.radix_cache: Optional[RadixCache] = RadixCache(kv_cache.free) if use_prefix_cache else None
        self.requests: Dict[int, InferReq] = {}
        self._match: Dict[int, tuple[Optional[RadixNode], int]] = {}

    # --- capacity -------------------------------------------------------------------------
    def allocatable_token_num(self) -> int:
        """Free slots plus slots the prefix cache could give back by eviction."""
        evictable = self.radix_cache.evictable_token_num if self.radix_cache else 0
        return self.kv_cache.available + evictable

    def alloc_slots(self, num: int) -> torch.Tensor:
        """Allocate ``num`` slots, evicting unreferenced prefix-cache entries when short."""
        short = num - self.kv_cache.available
        if short > 0 and self.radix_cache is not None:
            self.radix_cache.evict(short)
        return self.kv_cache.alloc(num)

    # --- lifecycle ------------------------------------------------------------------------
    def add(self, req: InferReq) -> None:
        """Register a request, give it a row and attach its cached prefix."""
        if req.request_id in self.requests:
            raise ValueError(f"request {req.request_id} is already running")
        req.req_row = self.req_manager.alloc_row()
        self.requests[req.request_id] = req
        self._attach_prefix(req)
        req.prompt_cache_len = req.cur_kv_len

    def _attach_prefix(self, req: InferReq) -> None:
        # The last token (and any position still owed a prompt logprob) is always computed, so
        # only ``cacheable_prefix_len`` tokens may match.
        node, matched = None, 0
        cacheable = req.cacheable_prefix_len
        if self.radix_cache is not None and cacheable > 0:
            tokens = req.token_slice(0, cacheable)
            node, matched, slots = self.radix_cache.match_prefix(tokens, update_refs=True)
            if matched:
                self.req_manager.set_slots(req.req_row, 0, slots.to(self.req_manager.req_to_token.device))
        req.cur_kv_len = matched
        self._match[req.request_id] = (node, matched)

    def _give_back_kv(self, req: InferReq) -> None:
        node, matched = self._match.pop(req.request_id, (None, 0))
        computed = req.cur_kv_len
        slots = self.req_manager.slots(req.req_row, 0, computed).cpu()
        if self.radix_cache is not None:
            shared = self.radix_cache.insert(req.token_slice(0, computed), slots) if computed else 0
            if shared > matched:
                self.kv_cache.free(slots[matched:shared])
            self.radix_cache.dec_ref(node)
        elif computed > matched:
            self.kv_cache.free(slots[matched:computed])
        req.cur_kv_len = 0

    def release(self, req: InferReq) -> None:
        """Drop a finished or aborted request and hand its KV to the cache or allocator."""
        self._give_back_kv(req)
        self.req_manager.free_row(req.req_row)
        req.req_row = -1
        del self.requests[req.request_id]

    def pause(self, req: InferReq) -> None:
        """Take a running request's KV away (KV ran out); it recomputes from the prefix cache later."""
        self._give_back_kv(req)
        req.paused = True

    def resume(self, req: InferReq) -> None:
        """Re-attach a paused request's cached prefix; its remaining tokens become prefill work."""
        self._attach_prefix(req)
        req.paused = False

    def record_chunk(self, req: InferReq, start: int, slots: torch.Tensor) -> None:
        """Note that positions ``[start, start + len(slots))`` of ``req`` now live at ``slots``."""
        self.req_manager.set_slots(req.req_row, start, slots)

    def clear_prefix_cache(self) -> int:
        """Evict everything unreferenced from the prefix cache; returns slots freed."""
        return self.radix_cache.clear() if self.radix_cache is not None else 0
