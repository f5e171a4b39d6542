"""Helpers shared by the radix-cache tests: a checking slot pool and brute-force tree walks."""

from __future__ import annotations

from typing import List, Optional, Set, Tuple

import torch

from lightllm.server.model_rank.kv_cache.radix_cache import RadixCache
from lightllm.server.model_rank.kv_cache.radix_node import RadixNode


class SlotPool:
    """Test allocator: hands out slots and fails loudly on a double or foreign free."""

    def __init__(self, size: int, start_in_use: bool = False) -> None:
        self.size = size
        # Tests that hand-pick slot numbers start with every slot in use.
        self.free_set: Set[int] = set() if start_in_use else set(range(size))
        self.free_calls: List[List[int]] = []

    def allocate(self, count: int) -> torch.Tensor:
        assert count <= len(self.free_set), "test pool exhausted"
        picked = sorted(self.free_set)[:count]
        self.free_set.difference_update(picked)
        return torch.tensor(picked, dtype=torch.long)

    def free(self, slots: torch.Tensor) -> None:
        values = slots.tolist()
        assert slots.dtype == torch.long
        assert len(set(values)) == len(values), f"duplicate slots in one free: {values}"
        for slot in values:
            assert 0 <= slot < self.size, f"slot {slot} was never handed out"
            assert slot not in self.free_set, f"slot {slot} freed twice"
        self.free_set.update(values)
        self.free_calls.append(values)

    @property
    def freed_in_calls(self) -> List[int]:
        return [slot for call in self.free_calls for slot in call]


def make_cache(size: int = 256, start_in_use: bool = True) -> Tuple[RadixCache, SlotPool]:
    pool = SlotPool(size, start_in_use)
    return RadixCache(pool.free), pool


def walk(cache: RadixCache) -> List[Tuple[RadixNode, Tuple[int, ...]]]:
    """Every non-root node with the full token sequence it stands for."""
    out: List[Tuple[RadixNode, Tuple[int, ...]]] = []
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            full = prefix + child.token_ids
            out.append((child, full))
            stack.append((child, full))
    return out


def brute_force_stats(cache: RadixCache) -> Tuple[int, int]:
    nodes = walk(cache)
    total = sum(len(n) for n, _ in nodes)
    evictable = sum(len(n) for n, _ in nodes if n.ref_count == 0)
    return total, evictable


def check_invariants(cache: RadixCache, holds: Optional[List[RadixNode]] = None) -> None:
    total, evictable = brute_force_stats(cache)
    assert cache.total_token_num == total
    assert cache.evictable_token_num == evictable
    assert cache.referenced_token_num == total - evictable
    for node, full in walk(cache):
        assert len(node.token_ids) > 0 and node.slots.numel() == len(node.token_ids)
        assert node.parent is not None and node.parent.children[node.token_ids[0]] is node
        assert node.depth_tokens() == len(full)
        if node.parent is not cache.root:
            assert node.ref_count <= node.parent.ref_count
            assert node.last_access <= node.parent.last_access
        if holds is not None:
            expected = sum(1 for held in holds if _is_ancestor_or_self(node, held))
            assert node.ref_count == expected, (node, expected)


def _is_ancestor_or_self(node: RadixNode, descendant: RadixNode) -> bool:
    current: Optional[RadixNode] = descendant
    while current is not None:
        if current is node:
            return True
        current = current.parent
    return False


def slots_of(values: List[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)
