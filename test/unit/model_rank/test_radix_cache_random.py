"""Randomized model check of the prefix (prompt) radix cache against brute force."""

from __future__ import annotations

import random
from typing import Dict, List, Optional, Set, Tuple

import torch

from lightllm.server.model_rank.kv_cache.radix_cache import RadixCache
from lightllm.server.model_rank.kv_cache.radix_node import RadixNode
from radix_test_support import SlotPool, walk, check_invariants


# ---------------------------------------------------------------------- randomized model check
def cached_sequences(cache: RadixCache) -> Set[Tuple[int, ...]]:
    """Every prefix present in the tree (brute force)."""
    present: Set[Tuple[int, ...]] = set()
    for node, full in walk(cache):
        start = len(full) - len(node)
        for end in range(start + 1, len(full) + 1):
            present.add(full[:end])
    return present


def test_random_operations_keep_counts_and_slots_consistent() -> None:
    rng = random.Random(1234)
    pool = SlotPool(300)
    # The K/V in a slot depends on the whole prefix up to its token; matches must agree.
    slot_prefix: Dict[int, Tuple[int, ...]] = {}
    # Make sure the run really exercised hits, duplicate frees and eviction.
    coverage = {"hits": 0, "duplicates": 0, "evicted": 0}

    def free_and_forget(slots: torch.Tensor) -> None:
        pool.free(slots)
        coverage["evicted"] += slots.numel()
        for slot in slots.tolist():
            del slot_prefix[slot]

    cache = RadixCache(free_and_forget)
    # Active requests: (prompt, node held, matched length, all slots).
    active: List[Tuple[Tuple[int, ...], Optional[RadixNode], int, torch.Tensor]] = []
    known: List[Tuple[int, ...]] = [()]

    for _ in range(200):
        op = rng.random()
        if op < 0.45:
            base = rng.choice(known)[: rng.randint(0, 12)]
            prompt = base + tuple(rng.randint(0, 2) for _ in range(rng.randint(1, 8)))
            node, matched, cached = cache.match_prefix(prompt, update_refs=True)
            coverage["hits"] += matched > 0
            present = cached_sequences(cache)
            assert matched == 0 or prompt[:matched] in present
            assert matched == len(prompt) or prompt[: matched + 1] not in present
            for i, slot in enumerate(cached.tolist()):
                assert slot_prefix[slot] == prompt[: i + 1]
            need = len(prompt) - matched
            if need > len(pool.free_set):
                cache.evict(need - len(pool.free_set))
            if need > len(pool.free_set):
                cache.dec_ref(node)
                continue
            own = pool.allocate(need)
            for i, slot in enumerate(own.tolist()):
                slot_prefix[slot] = prompt[: matched + i + 1]
            active.append((prompt, node, matched, torch.cat([cached, own])))
            known.append(prompt)
        elif op < 0.8 and active:
            prompt, node, matched, slots = active.pop(rng.randrange(len(active)))
            shared = cache.insert(prompt, slots)
            assert matched <= shared <= len(prompt)
            pool.free(slots[matched:shared])
            coverage["duplicates"] += shared - matched
            for slot in slots[matched:shared].tolist():
                del slot_prefix[slot]
            cache.dec_ref(node)
        elif op < 0.9:
            before = cache.evictable_token_num
            freed = cache.evict(rng.randint(1, 20))
            assert freed <= before
            assert cache.evictable_token_num == before - freed
        else:
            query = rng.choice(known)
            node, matched, cached = cache.match_prefix(query, update_refs=False)
            assert (node is None) == (matched == 0)
            for i, slot in enumerate(cached.tolist()):
                assert slot_prefix[slot] == query[: i + 1]
        check_invariants(cache, holds=[n for _, n, _, _ in active if n is not None])
        in_tree = [s for n, _ in walk(cache) for s in n.slots.tolist()]
        assert len(in_tree) == len(set(in_tree)), "a slot is cached twice"
        assert not set(in_tree) & pool.free_set, "a cached slot is also free"

    for prompt, node, matched, slots in active:
        pool.free(slots[matched:])
        for slot in slots[matched:].tolist():
            del slot_prefix[slot]
        cache.dec_ref(node)
    cache.clear()
    assert cache.total_token_num == 0 and cache.evictable_token_num == 0
    assert pool.free_set == set(range(300))
    assert not slot_prefix
    assert all(count > 0 for count in coverage.values()), coverage
