"""Prefix (prompt) cache: a radix tree from token-id sequences to KV-cache token slots.

The KV cache is token-level: the K/V of one token lives in one *slot* (an int index into the
per-layer buffers).  When a request finishes prefill (or finishes outright) its tokens and slots
are inserted here; a later request whose prompt starts with the same tokens matches them and
reuses those slots instead of recomputing them.

Ownership of slots
------------------
* Slots inside the tree belong to the cache.  They return to the allocator only through
  :meth:`RadixCache.evict` (or :meth:`RadixCache.clear`), which hands them to the injected
  ``free_slots`` callable, each slot exactly once.
* :meth:`RadixCache.insert` frees nothing.  It returns ``shared``, the length of the prefix that
  was already cached; for that range the tree keeps its own slots and the caller's
  ``slots[:shared]`` are *not* taken over.  The caller must free those of its slots in that range
  that differ from the cached ones (typically ``slots[matched_len:shared]``, where
  ``matched_len`` is what the request matched when it started; its first ``matched_len`` slots
  are the cached slots themselves and must not be freed).
* A hold from ``match_prefix(..., update_refs=True)`` protects the matched path from eviction
  until :meth:`RadixCache.dec_ref` releases it.

Every match or insert ticks a logical clock and stamps the nodes it walks, so eviction order
(least recently used first, ties by node creation order) is deterministic and identical on all
tensor-parallel ranks that perform the same operations.
"""

from __future__ import annotations

import heapq
from typing import Callable, List, Optional, Sequence, Set, Tuple

import torch

from lightllm.server.model_rank.kv_cache.radix_node import RadixNode

# Token runs are compared slice by slice so that the common "whole run matches" case costs a few
# C-level tuple comparisons instead of one Python step per token.
_COMPARE_CHUNK = 64


def _check_integer_vector(values: torch.Tensor, name: str) -> None:
    """Raise ValueError unless ``values`` is a 1-D tensor of an integer dtype."""
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(values).__name__}")
    if values.dim() != 1 or values.dtype.is_floating_point or values.dtype.is_complex \
            or values.dtype == torch.bool:
        raise ValueError(
            f"{name}: expected a 1-D integer tensor, got {values.dtype} "
            f"with shape {tuple(values.shape)}"
        )


def _as_token_tuple(token_ids: Sequence[int], name: str) -> Tuple[int, ...]:
    """Turn a list/tuple/1-D tensor/array of token ids into a tuple."""
    kind = type(token_ids).__name__
    if isinstance(token_ids, (str, bytes)):
        raise ValueError(f"{name}: expected a sequence of token ids, got {kind}")
    if isinstance(token_ids, torch.Tensor):
        _check_integer_vector(token_ids, name)
        return tuple(token_ids.tolist())
    if hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()
    try:
        return tuple(token_ids)
    except TypeError as exc:
        raise ValueError(f"{name}: expected a sequence of token ids, got {kind}") from exc


def _common_prefix_len(run: Tuple[int, ...], query: Tuple[int, ...], start: int) -> int:
    """Length of the common prefix of ``run`` and ``query[start:]``."""
    limit = min(len(run), len(query) - start)
    pos = 0
    while pos < limit:
        end = min(pos + _COMPARE_CHUNK, limit)
        if run[pos:end] != query[start + pos:start + end]:
            while run[pos] == query[start + pos]:
                pos += 1
            return pos
        pos = end
    return limit


class RadixCache:
    """Radix tree of cached token prefixes and the KV slots that hold them.

    Args:
        free_slots: called with a 1-D int64 CPU tensor of slots the cache gives back to the
            allocator (only from :meth:`evict` and :meth:`clear`).
    """

    def __init__(self, free_slots: Callable[[torch.Tensor], None]) -> None:
        if not callable(free_slots):
            raise ValueError("free_slots: expected a callable taking a tensor of slots")
        self._free_slots = free_slots
        self._clock = 0
        # Bumped whenever an insert adds tokens: a lookup that found nothing more before cannot
        # find more until it changes.
        self._content_version = 0
        self._next_node_id = 1
        self._root = RadixNode((), torch.empty(0, dtype=torch.long), None, node_id=0, last_access=0)
        # Referenced nodes can never be evicted, so the root is given a permanent hold.
        self._root.ref_count = 1
        self._total_tokens = 0
        self._evictable_tokens = 0
        # Nodes that eviction may remove right now: unreferenced leaves other than the root.
        self._evictable_leaves: Set[RadixNode] = set()

    # ------------------------------------------------------------------ statistics
    @property
    def root(self) -> RadixNode:
        """The root node (empty run); read-only access for inspection."""
        return self._root

    @property
    def content_version(self) -> int:
        """Changes whenever :meth:`insert` adds tokens (lookups may then match more)."""
        return self._content_version

    @property
    def total_token_num(self) -> int:
        """Number of tokens (and slots) held in the tree."""
        return self._total_tokens

    @property
    def evictable_token_num(self) -> int:
        """Tokens in nodes nobody holds; all of them can be freed by :meth:`evict`."""
        return self._evictable_tokens

    @property
    def referenced_token_num(self) -> int:
        """Tokens in nodes protected by at least one hold."""
        return self._total_tokens - self._evictable_tokens

    # ------------------------------------------------------------------ public operations
    def match_prefix(
        self, token_ids: Sequence[int], update_refs: bool
    ) -> Tuple[Optional[RadixNode], int, torch.Tensor]:
        """Find the longest cached prefix of ``token_ids``.

        When the match ends inside a node, that node is split so the returned node ends exactly
        at the match.  Every node on the path counts as accessed.

        Args:
            token_ids: the tokens to look up (list, tuple or 1-D integer tensor).
            update_refs: when True the matched path is held (protected from eviction) until
                :meth:`dec_ref` is called with the returned node.

        Returns:
            ``(node, length, slots)``: the deepest matched node (``None`` when nothing matched),
            the matched length, and the cached slots of those tokens (int64 CPU tensor of
            ``length`` entries).
        """
        query = _as_token_tuple(token_ids, "token_ids")
        self._clock += 1
        node, matched, path = self._walk(query, split_at_query_end=True)
        if matched == 0:
            return None, 0, torch.empty(0, dtype=torch.long)
        if update_refs:
            self._add_ref(node)
        slots = torch.cat([n.slots for n in path]) if len(path) > 1 else path[0].slots.clone()
        return node, matched, slots

    def continues(self, node: Optional[RadixNode], next_token: int) -> bool:
        """Whether a cached run continues a match that ended at ``node`` with ``next_token``.

        ``node`` is what :meth:`match_prefix` returned (``None``: nothing matched) and must still
        be held.  A match ends where the tree has no child for the next query token, so it can
        only grow once an insert adds one: while this returns False, repeating the lookup would
        return the same match (an O(1) test instead of a walk over the whole query).
        """
        parent = self._root if node is None else node
        return next_token in parent.children

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Cache ``token_ids`` whose K/V live in ``slots``.

        Only the part beyond the already cached prefix is stored (with the matching part of
        ``slots``).  Nothing is freed here: see the module docstring for which of the caller's
        slots in ``[:shared]`` it must free itself.

        Args:
            token_ids: the full token sequence (list, tuple or 1-D integer tensor of ints).
            slots: 1-D integer tensor with one KV slot per token.

        Returns:
            ``shared``: the length of the prefix of ``token_ids`` that was already cached.
        """
        query = _as_token_tuple(token_ids, "token_ids")
        if not all(type(token) is int for token in query):
            raise ValueError("token_ids: every token id must be a Python int")
        _check_integer_vector(slots, "slots")
        if slots.numel() != len(query):
            raise ValueError(
                f"slots: expected {len(query)} slots (one per token), got {slots.numel()}"
            )
        self._clock += 1
        # A sequence that ends inside a cached run adds nothing, so that run is left whole.
        node, shared, _ = self._walk(query, split_at_query_end=False)
        if shared < len(query):
            self._add_child(node, query[shared:], slots[shared:])
            self._content_version += 1
        return shared

    def dec_ref(self, node: Optional[RadixNode]) -> None:
        """Release one hold taken by ``match_prefix(..., update_refs=True)`` on ``node``.

        ``None`` (what an empty match returns) is accepted and does nothing.
        """
        if node is None:
            return
        if not isinstance(node, RadixNode):
            raise ValueError(f"node: expected a RadixNode, got {type(node).__name__}")
        if node is self._root or not node.attached:
            raise ValueError("node: not a node currently held in this cache")
        if node.ref_count <= 0:
            raise ValueError(f"node: released more often than held ({node!r})")
        top = node
        while top.parent is not None:
            top = top.parent
        if top is not self._root:
            raise ValueError("node: belongs to a different RadixCache")
        current: Optional[RadixNode] = node
        while current is not None and current is not self._root:
            current.ref_count -= 1
            if current.ref_count == 0:
                self._evictable_tokens += len(current)
                self._refresh_leaf_status(current)
            current = current.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots, if that many are evictable.

        Unreferenced leaves go first, least recently accessed first (ties: older node first); a
        parent that becomes an unreferenced leaf joins the candidates.  All freed slots are
        handed to ``free_slots`` in one call.

        Returns:
            The number of slots freed (may exceed ``num_tokens`` since whole nodes are removed,
            or fall short when not enough tokens are evictable).
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens: expected a non-negative int, got {num_tokens!r}")
        if num_tokens == 0 or not self._evictable_leaves:
            return 0
        heap = [(n.last_access, n.node_id, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        freed = 0
        freed_parts: List[torch.Tensor] = []
        while freed < num_tokens and heap:
            _, _, victim = heapq.heappop(heap)
            parent = victim.parent
            freed += len(victim)
            freed_parts.append(victim.slots)
            self._remove_leaf(victim)
            if parent is not None and parent in self._evictable_leaves:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        if freed_parts:
            self._free_slots(torch.cat(freed_parts))
        return freed

    def clear(self) -> int:
        """Evict every unreferenced node; held paths stay.  Returns the number of slots freed."""
        # A node's holds are also counted on all its ancestors, so every unreferenced node lies in
        # an unreferenced subtree that cascading leaf eviction removes completely.
        return self.evict(self._evictable_tokens)

    # ------------------------------------------------------------------ tree internals
    def _walk(
        self, query: Tuple[int, ...], split_at_query_end: bool
    ) -> Tuple[RadixNode, int, List[RadixNode]]:
        """Descend along ``query``; return (deepest node, matched length, path without the root).

        Stamps every visited node with the current clock.  A node in which the tokens diverge
        from ``query`` is split there, so the returned node ends exactly at the match.  When
        ``query`` simply runs out inside a node, that node is split only if
        ``split_at_query_end``; otherwise it is left whole, counted in the matched length, and
        the returned node (and path) stop at its parent.
        """
        node = self._root
        node.last_access = self._clock
        matched = 0
        path: List[RadixNode] = []
        while matched < len(query):
            child = node.children.get(query[matched])
            if child is None:
                break
            common = _common_prefix_len(child.token_ids, query, matched)
            if common < len(child):
                if not split_at_query_end and matched + common == len(query):
                    child.last_access = self._clock
                    matched += common
                    break
                child = self._split(child, common)
            child.last_access = self._clock
            path.append(child)
            matched += common
            node = child
        return node, matched, path

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut ``node`` after ``at`` tokens; return the new upper node.

        The original object keeps the lower part, so a caller holding ``node`` still holds a node
        that stands for the same full sequence.  The upper node inherits the reference count
        (every hold on ``node`` is a hold on its prefix), so the evictable total is unchanged.
        """
        parent = node.parent
        assert parent is not None and 0 < at < len(node)
        upper = RadixNode(
            node.token_ids[:at],
            node.slots[:at].clone(),
            parent,
            node_id=self._new_node_id(),
            last_access=node.last_access,
        )
        upper.ref_count = node.ref_count
        node.token_ids = node.token_ids[at:]
        node.slots = node.slots[at:].clone()
        node.parent = upper
        upper.children[node.token_ids[0]] = node
        parent.children[upper.token_ids[0]] = upper
        return upper

    def _add_child(
        self, parent: RadixNode, token_ids: Tuple[int, ...], slots: torch.Tensor
    ) -> RadixNode:
        """Attach a new unreferenced leaf under ``parent``."""
        child = RadixNode(
            token_ids,
            slots.detach().to(device="cpu", dtype=torch.long).clone(),
            parent,
            node_id=self._new_node_id(),
            last_access=self._clock,
        )
        parent.children[token_ids[0]] = child
        self._total_tokens += len(child)
        self._evictable_tokens += len(child)
        self._refresh_leaf_status(child)
        self._refresh_leaf_status(parent)
        return child

    def _remove_leaf(self, leaf: RadixNode) -> None:
        """Detach an unreferenced leaf from the tree (its slots are freed by the caller)."""
        parent = leaf.parent
        assert parent is not None and leaf.ref_count == 0 and not leaf.children
        del parent.children[leaf.token_ids[0]]
        self._evictable_leaves.discard(leaf)
        self._total_tokens -= len(leaf)
        self._evictable_tokens -= len(leaf)
        leaf.parent = None
        leaf.attached = False
        self._refresh_leaf_status(parent)

    def _add_ref(self, node: RadixNode) -> None:
        """Take one hold on ``node`` and every ancestor below the root."""
        current: Optional[RadixNode] = node
        while current is not None and current is not self._root:
            if current.ref_count == 0:
                self._evictable_tokens -= len(current)
                self._evictable_leaves.discard(current)
            current.ref_count += 1
            current = current.parent

    def _refresh_leaf_status(self, node: RadixNode) -> None:
        """Keep ``_evictable_leaves`` in sync after ``node``'s holds or children changed."""
        if node is not self._root and node.ref_count == 0 and not node.children:
            self._evictable_leaves.add(node)
        else:
            self._evictable_leaves.discard(node)

    def _new_node_id(self) -> int:
        node_id = self._next_node_id
        self._next_node_id += 1
        return node_id
