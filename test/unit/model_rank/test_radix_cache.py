"""Unit tests for the prefix (prompt) radix cache."""

from __future__ import annotations


import pytest
import torch

from lightllm.server.model_rank.kv_cache.radix_cache import RadixCache
from radix_test_support import make_cache, walk, check_invariants, slots_of


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


def test_continues_tells_whether_a_repeated_lookup_could_match_more() -> None:
    cache, _ = make_cache()
    query = [5, 6, 7, 8, 9]
    node, length, _ = cache.match_prefix(query, update_refs=True)
    assert node is None and length == 0
    assert not cache.continues(node, query[length])
    cache.insert([1, 2], slots_of([20, 21]))  # unrelated content
    assert not cache.continues(node, query[length])
    cache.insert([5, 6], slots_of([10, 11]))
    assert cache.continues(node, query[length])
    node, length, _ = cache.match_prefix(query, update_refs=True)
    assert length == 2 and not cache.continues(node, query[length])
    # A longer cached run diverging inside it splits below the held node: still no continuation
    # with 7, and one once a run continues with it.
    cache.insert([5, 6, 3, 3], slots_of([10, 11, 30, 31]))
    assert not cache.continues(node, query[length])
    cache.insert([5, 6, 7, 8, 4], slots_of([10, 11, 12, 13, 14]))
    assert cache.continues(node, query[length])
    assert cache.match_prefix(query, update_refs=False)[1] == 4
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
