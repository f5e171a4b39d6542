"""Per-rank KV state: request rows, KV slots and the prefix cache (the server's KV view)."""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.common.req_manager import ReqManager
from lightllm.server.model_rank.kv_cache.radix_cache import RadixCache
from lightllm.server.model_rank.kv_cache.radix_node import RadixNode
from lightllm.server.model_rank.scheduling.infer_req import InferReq


class InferenceContext:
    """The token-slot KV cache as a :class:`~lightllm.server.model_rank.scheduling.kv_view.KvView`.

    Slot ownership: a request owns the slots of positions ``[matched_len, kv_slot_len)`` of its
    row; positions below ``matched_len`` belong to the prefix cache and are protected by the
    request's hold on ``match_node``.  When a request gives its KV back (release or pause) the
    computed positions ``[0, cur_kv_len)`` go into the prefix cache (which keeps the slots) or,
    with the cache disabled, straight back to the allocator; reserved but uncomputed positions
    ``[cur_kv_len, kv_slot_len)`` always go back to the allocator.
    """

    def __init__(self, kv_cache: KVCacheMemoryManager, req_manager: ReqManager, use_prefix_cache: bool = True):
        self.kv_cache = kv_cache
        self.req_manager = req_manager
        self.radix_cache: Optional[RadixCache] = RadixCache(kv_cache.free) if use_prefix_cache else None
        self._match: Dict[int, tuple[Optional[RadixNode], int]] = {}
        # (cache content version, cur_kv_len) at a request's last share_prefix: nothing to do
        # until one of them changes.
        self._shared_at: Dict[int, Tuple[int, int]] = {}

    # --- capacity -------------------------------------------------------------------------
    def allocatable_token_num(self) -> int:
        """Free slots plus slots the prefix cache could give back by eviction."""
        evictable = self.radix_cache.evictable_token_num if self.radix_cache else 0
        return self.kv_cache.available + evictable

    def capacity_token_num(self) -> int:
        """The KV cache's slots (``--max_total_token_num``)."""
        return self.kv_cache.size

    def max_requests(self) -> int:
        """The request manager's rows (``--running_max_req_size``)."""
        return self.req_manager.max_request_num

    def alloc_slots(self, num: int) -> torch.Tensor:
        """Allocate ``num`` slots, evicting unreferenced prefix-cache entries when short."""
        short = num - self.kv_cache.available
        if short > 0 and self.radix_cache is not None:
            self.radix_cache.evict(short)
        return self.kv_cache.alloc(num)

    # --- the KV view ----------------------------------------------------------------------
    def attach(self, req: InferReq) -> None:
        """Give a new request a row and attach its cached prefix."""
        req.req_row = self.req_manager.alloc_row()
        self._attach_prefix(req)
        req.prompt_cache_len = req.cur_kv_len

    def reserve(self, req: InferReq, num: int) -> None:
        """Slots for positions ``[kv_slot_len, kv_slot_len + num)`` of ``req``, recorded in its row."""
        if num <= 0:
            return
        slots = self.alloc_slots(num)
        self.req_manager.set_slots(req.req_row, req.kv_slot_len, slots)
        req.kv_slot_len += num

    def reserve_many(self, wants: Sequence[Tuple[InferReq, int]]) -> None:
        """:meth:`reserve` for each ``(request, num)`` pair, with one allocation for all of them."""
        total = sum(num for _, num in wants)
        if total <= 0:
            return
        slots = self.alloc_slots(total)
        if all(num == 1 for _, num in wants):
            # One token each (a decode step): one indexed write instead of one per request.
            self.req_manager.set_next_slots([r.req_row for r, _ in wants], [r.kv_slot_len for r, _ in wants], slots)
            for req, _ in wants:
                req.kv_slot_len += 1
            return
        offset = 0
        for req, num in wants:
            if num <= 0:
                continue
            self.req_manager.set_slots(req.req_row, req.kv_slot_len, slots[offset : offset + num])
            req.kv_slot_len += num
            offset += num

    def share_prefix(self, req: InferReq) -> int:
        """Publish ``req``'s computed tokens to the prefix cache and adopt a longer cached prefix.

        Called between steps for requests still prefilling, so that requests sharing a prompt
        prefix stop computing it once one of them has: without it the cache only learns a
        prompt when its request ends, and a burst of same-prefix prompts computes the prefix
        once per request.  The request's row is switched to the cache's slots for everything
        cached (its own duplicates are freed) and ``cur_kv_len`` moves to the end of the match.
        Returns the number of tokens gained from the cache.
        """
        cache = self.radix_cache
        if cache is None or req.req_row < 0 or req.kv_slot_len != req.cur_kv_len:
            return 0
        marker = (cache.content_version, req.cur_kv_len)
        if self._shared_at.get(req.request_id) == marker:
            return 0
        old_node, old_matched = self._match[req.request_id]
        computed = req.cur_kv_len
        limit = max(computed, req.cacheable_prefix_len)
        if computed <= old_matched and (
            old_matched >= limit or not cache.continues(old_node, req.token_at(old_matched))
        ):
            # Nothing of its own to publish and no cached run continues its match: a new lookup
            # would return what it holds.  Every request waiting for its first chunk takes this
            # path while other prompts fill the cache, so it must not walk the whole prompt
            # (10-20 us per request and step, 3-5 ms per step with 256 waiting, before).
            self._shared_at[req.request_id] = marker
            return 0
        # A copy: the row is rewritten below, and on CPU ``.cpu()`` would return a view of it.
        own_slots = self.req_manager.slots(req.req_row, 0, computed).to("cpu", copy=True)
        shared = cache.insert(req.token_slice(0, computed), own_slots) if computed > old_matched else old_matched
        node, matched, slots = cache.match_prefix(req.token_slice(0, limit), update_refs=True)
        # The cache now holds everything computed (inserted just now, or matched before), and
        # the request's held path protects it, so the match reaches at least ``computed``.
        self.req_manager.set_slots(req.req_row, 0, slots.to(self.req_manager.req_to_token.device))
        if shared > old_matched:
            self.kv_cache.free(own_slots[old_matched:shared])  # the cache had its own copies
        cache.dec_ref(old_node)
        self._match[req.request_id] = (node, matched)
        req.cur_kv_len = req.kv_slot_len = matched
        self._shared_at[req.request_id] = (cache.content_version, matched)
        return matched - computed

    def pause(self, req: InferReq) -> None:
        """Take a running request's KV away (KV ran out); it recomputes from the prefix cache later."""
        self._give_back_kv(req)

    def resume(self, req: InferReq) -> None:
        """Re-attach a paused request's cached prefix; its remaining tokens become prefill work."""
        self._attach_prefix(req)

    def release(self, req: InferReq) -> None:
        """Drop a request that left and hand its KV to the cache or allocator."""
        self._give_back_kv(req)
        if req.req_row >= 0:
            self.req_manager.free_row(req.req_row)
        req.req_row = -1

    # --- slots of the current step --------------------------------------------------------
    def slots(self, req: InferReq, start: int, end: int) -> torch.Tensor:
        """Slots of positions ``[start, end)`` of ``req`` (reserved earlier)."""
        return self.req_manager.slots(req.req_row, start, end)

    # --- internals ------------------------------------------------------------------------
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
        req.kv_slot_len = matched
        self._match[req.request_id] = (node, matched)

    def _give_back_kv(self, req: InferReq) -> None:
        self._shared_at.pop(req.request_id, None)
        node, matched = self._match.pop(req.request_id, (None, 0))
        computed = req.cur_kv_len
        held = req.kv_slot_len
        if req.req_row >= 0 and held > 0:
            slots = self.req_manager.slots(req.req_row, 0, held).cpu()
            if self.radix_cache is not None:
                shared = self.radix_cache.insert(req.token_slice(0, computed), slots[:computed]) if computed else 0
                if shared > matched:
                    self.kv_cache.free(slots[matched:shared])
                if held > computed:
                    self.kv_cache.free(slots[computed:held])
            elif held > matched:
                self.kv_cache.free(slots[matched:held])
        if self.radix_cache is not None:
            self.radix_cache.dec_ref(node)
        req.cur_kv_len = 0
        req.kv_slot_len = 0

    def clear_prefix_cache(self) -> int:
        """Evict everything unreferenced from the prefix cache; returns slots freed."""
        return self.radix_cache.clear() if self.radix_cache is not None else 0
