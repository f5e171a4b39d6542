"""Unit tests for the prefix (prompt) radix cache."""

from __future__ import annotations

import random
from typing import Dict, List, Optional, Set, Tuple

import pytest
import torch

from lightllm.server.router.dynamic_prompt.radix_cache import RadixCache
from lightllm.server.router.dynamic_prompt.radix_node import RadixNode


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


# ---------------------------------------------------------------------- matching and inserting
def test_match_on_empty_cache_returns_nothing() -> None:
    cache, _ = make_cache()
    for query in ([1, 2, 3], []):
        node, length, slots = cache.match_prefix(query, update_refs=True)
        assert node is None and length == 0
        assert slots.dtype == torch.long and slots.numel() == 0
    assert cache.total_token_num == 0 and cache.evictable_token_num == 0


def test_insert_then_match_full_and_partial_prefix() -> None:
    cache, _ = make_cache()
    assert cache.insert([5, 6, 7, 8], slots_of([10, 11, 12, 13])) == 0
    assert cache.total_token_num == 4 and cache.evictable_token_num == 4

    node, length, slots = cache.match_prefix([5, 6, 7, 8, 9, 9], update_refs=False)
    assert length == 4 and slots.tolist() == [10, 11, 12, 13]
    assert node is not None and node.token_ids == (5, 6, 7, 8)

    node, length, slots = cache.match_prefix(torch.tensor([5, 6, 1]), update_refs=False)
    assert length == 2 and slots.tolist() == [10, 11]
    assert node is not None and node.depth_tokens() == 2

    assert cache.match_prefix([6, 5], update_refs=False)[1] == 0
    check_invariants(cache)


def test_match_split_keeps_slots_consistent() -> None:
    cache, _ = make_cache()
    cache.insert([1, 2, 3, 4, 5, 6], slots_of([20, 21, 22, 23, 24, 25]))
    upper, length, slots = cache.match_prefix([1, 2, 3], update_refs=False)
    assert length == 3 and slots.tolist() == [20, 21, 22]
    assert upper is not None and upper.token_ids == (1, 2, 3)
    assert upper.slots.tolist() == [20, 21, 22]
    (lower,) = upper.children.values()
    assert lower.token_ids == (4, 5, 6) and lower.slots.tolist() == [23, 24, 25]
    assert list(cache.root.children.values()) == [upper]
    assert cache.total_token_num == 6
    assert cache.match_prefix([1, 2, 3, 4, 5, 6], update_refs=False)[2].tolist() == [
        20, 21, 22, 23, 24, 25
    ]
    check_invariants(cache)


def test_long_runs_match_across_compare_chunks() -> None:
    cache, _ = make_cache(1024)
    base = list(range(300))
    cache.insert(base, slots_of(list(range(300))))
    for cut in (0, 1, 63, 64, 65, 128, 200, 299):
        query = base[:cut] + [-1] + base[cut + 1:]
        assert cache.match_prefix(query, update_refs=False)[1] == cut
    assert cache.match_prefix(base, update_refs=False)[1] == 300
    check_invariants(cache)


def test_shared_prefix_insert_returns_shared_length() -> None:
    cache, _ = make_cache()
    assert cache.insert([1, 2, 3, 4], slots_of([0, 1, 2, 3])) == 0
    assert cache.insert([1, 2, 3, 9, 9], slots_of([7, 7, 7, 8, 9])) == 3
    assert cache.total_token_num == 6
    # The cached prefix keeps its original slots; only the new tail was taken over.
    assert cache.match_prefix([1, 2, 3, 9, 9], update_refs=False)[2].tolist() == [0, 1, 2, 8, 9]
    assert cache.match_prefix([1, 2, 3, 4], update_refs=False)[2].tolist() == [0, 1, 2, 3]
    check_invariants(cache)


def test_insert_of_contained_sequence_adds_nothing_and_does_not_split() -> None:
    cache, _ = make_cache()
    cache.insert([1, 2, 3, 4], slots_of([0, 1, 2, 3]))
    assert cache.insert([1, 2], slots_of([8, 9])) == 2
    assert cache.insert([1, 2, 3, 4], slots_of([4, 5, 6, 7])) == 4
    assert cache.total_token_num == 4
    (only,) = cache.root.children.values()
    assert only.token_ids == (1, 2, 3, 4) and only.is_leaf


def test_insert_copies_slots_so_caller_mutation_cannot_corrupt_cache() -> None:
    cache, _ = make_cache()
    slots = slots_of([3, 4, 5])
    cache.insert([1, 2, 3], slots)
    slots.fill_(0)
    assert cache.match_prefix([1, 2, 3], update_refs=False)[2].tolist() == [3, 4, 5]


def test_request_flow_caller_frees_only_duplicate_slots() -> None:
    cache, pool = make_cache(32, start_in_use=False)
    first = [1, 2, 3, 4, 5]
    first_slots = pool.allocate(5)
    assert cache.insert(first, first_slots) == 0

    # Request B matches 2 cached tokens, computes the rest itself (including tokens 3..5,
    # which request A inserts meanwhile).
    prompt_b = [1, 2, 3, 4, 5, 6]
    node_b, matched, cached = cache.match_prefix(prompt_b[:2], update_refs=True)
    own = pool.allocate(len(prompt_b) - matched)
    slots_b = torch.cat([cached, own])
    shared = cache.insert(prompt_b, slots_b)
    assert shared == 5
    duplicates = slots_b[matched:shared]
    pool.free(duplicates)
    cache.dec_ref(node_b)

    assert cache.total_token_num == 6
    assert cache.clear() == 6
    assert pool.free_set == set(range(32))
    check_invariants(cache)


# ---------------------------------------------------------------------- references
def test_refs_protect_from_eviction_until_released() -> None:
    cache, pool = make_cache()
    cache.insert([1, 2, 3, 4], slots_of([0, 1, 2, 3]))
    cache.insert([7, 8], slots_of([4, 5]))
    node, length, _ = cache.match_prefix([1, 2, 3, 4, 5], update_refs=True)
    assert length == 4 and node is not None and node.ref_count == 1
    assert cache.evictable_token_num == 2 and cache.referenced_token_num == 4

    assert cache.evict(100) == 2
    assert pool.freed_in_calls == [4, 5]
    assert cache.total_token_num == 4
    assert cache.evict(1) == 0

    cache.dec_ref(node)
    assert cache.evictable_token_num == 4 and cache.referenced_token_num == 0
    assert cache.evict(1) == 4
    assert sorted(pool.freed_in_calls) == list(range(6))
    check_invariants(cache)


def test_split_of_held_node_keeps_ref_counts() -> None:
    cache, _ = make_cache()
    cache.insert([1, 2, 3, 4, 5, 6], slots_of(list(range(6))))
    held, _, _ = cache.match_prefix([1, 2, 3, 4, 5, 6], update_refs=True)
    upper, length, _ = cache.match_prefix([1, 2, 9], update_refs=True)
    assert length == 2 and upper is not None
    assert upper.ref_count == 2 and held is not None and held.ref_count == 1
    assert held.parent is upper and held.token_ids == (3, 4, 5, 6)
    check_invariants(cache, holds=[held, upper])

    cache.dec_ref(held)
    check_invariants(cache, holds=[upper])
    assert cache.evictable_token_num == 4
    cache.dec_ref(upper)
    check_invariants(cache, holds=[])
    assert cache.evictable_token_num == 6


def test_dec_ref_rejects_bad_releases() -> None:
    cache, _ = make_cache()
    cache.dec_ref(None)
    cache.insert([1, 2], slots_of([0, 1]))
    node, _, _ = cache.match_prefix([1, 2], update_refs=True)
    cache.dec_ref(node)
    with pytest.raises(ValueError, match="node"):
        cache.dec_ref(node)
    with pytest.raises(ValueError, match="node"):
        cache.dec_ref(cache.root)
    with pytest.raises(ValueError, match="node"):
        cache.dec_ref("not a node")  # type: ignore[arg-type]
    other, _ = make_cache()
    other.insert([1, 2], slots_of([0, 1]))
    foreign, _, _ = other.match_prefix([1, 2], update_refs=True)
    with pytest.raises(ValueError, match="node"):
        cache.dec_ref(foreign)
    assert foreign is not None and foreign.ref_count == 1
    assert cache.root.is_root and not foreign.is_root
    cache.evict(2)
    assert node is not None and not node.attached and not node.is_root
    with pytest.raises(ValueError, match="node"):
        cache.dec_ref(node)


# ---------------------------------------------------------------------- eviction
def test_lru_evicts_least_recently_accessed_first() -> None:
    cache, pool = make_cache()
    cache.insert([1, 1], slots_of([0, 1]))
    cache.insert([2, 2], slots_of([2, 3]))
    cache.insert([3, 3], slots_of([4, 5]))
    cache.match_prefix([1, 1], update_refs=False)  # [1, 1] is now the most recent

    assert cache.evict(1) == 2
    assert pool.free_calls[-1] == [2, 3]
    assert cache.evict(2) == 2
    assert pool.free_calls[-1] == [4, 5]
    assert cache.evict(2) == 2
    assert pool.free_calls[-1] == [0, 1]
    assert cache.total_token_num == 0


def test_cascading_eviction_removes_parents_that_become_leaves() -> None:
    cache, pool = make_cache()
    cache.insert([1, 2, 3, 4], slots_of([0, 1, 2, 3]))
    cache.insert([1, 2, 5, 6], slots_of([0, 1, 4, 5]))  # shares [1, 2]
    cache.insert([9], slots_of([6]))  # newest leaf

    # The two old leaves go first; their parent [1, 2] then becomes a leaf older than [9].
    assert cache.evict(5) == 6
    assert pool.freed_in_calls == [2, 3, 4, 5, 0, 1]
    assert [n.token_ids for n, _ in walk(cache)] == [(9,)]
    assert cache.evict(10) == 1
    assert cache.total_token_num == 0 and cache.root.is_leaf
    check_invariants(cache)


def test_evict_overshoots_by_whole_nodes_and_validates_argument() -> None:
    cache, _ = make_cache()
    cache.insert([1, 2, 3], slots_of([0, 1, 2]))
    assert cache.evict(0) == 0
    with pytest.raises(ValueError, match="num_tokens"):
        cache.evict(-1)
    with pytest.raises(ValueError, match="num_tokens"):
        cache.evict(1.5)  # type: ignore[arg-type]
    assert cache.evict(1) == 3


def test_clear_frees_unreferenced_and_keeps_held_paths() -> None:
    cache, pool = make_cache(16)
    cache.insert([1, 2, 3], slots_of([0, 1, 2]))
    cache.insert([1, 2, 4, 5], slots_of([0, 1, 3, 4]))
    cache.insert([6], slots_of([5]))
    node, _, _ = cache.match_prefix([1, 2, 3], update_refs=True)
    assert cache.clear() == 3
    assert sorted(pool.freed_in_calls) == [3, 4, 5]
    assert cache.total_token_num == 3 and cache.evictable_token_num == 0
    cache.dec_ref(node)
    assert cache.clear() == 3
    assert sorted(pool.freed_in_calls) == [0, 1, 2, 3, 4, 5]
    assert cache.total_token_num == 0


# ---------------------------------------------------------------------- input validation
def test_bad_inputs_raise_value_error_naming_the_parameter() -> None:
    cache, _ = make_cache()
    with pytest.raises(ValueError, match="free_slots"):
        RadixCache(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slots"):
        cache.insert([1, 2], slots_of([0]))
    with pytest.raises(ValueError, match="slots"):
        cache.insert([1, 2], [0, 1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slots"):
        cache.insert([1, 2], torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="token_ids"):
        cache.insert([1.0, 2.0], slots_of([0, 1]))  # type: ignore[list-item]
    with pytest.raises(ValueError, match="token_ids"):
        cache.match_prefix("abc", update_refs=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token_ids"):
        cache.match_prefix(torch.zeros(2, 2, dtype=torch.long), update_refs=False)
    with pytest.raises(ValueError, match="token_ids"):
        cache.match_prefix(7, update_refs=False)  # type: ignore[arg-type]
    assert cache.total_token_num == 0


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
