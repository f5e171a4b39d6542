"""One node of the prefix-cache radix tree.

A node owns a run of token ids (``token_ids``) together with the KV-cache token slots that hold
the K/V of exactly those tokens (``slots``, same length).  The full sequence a node stands for is
the concatenation of the runs on the path from the root down to it.

Reference counts follow the path: a hold taken on a node is also taken on every ancestor, so a
node's count is never larger than its parent's.  A node whose count is zero is *evictable*; if it
also has no children it can be removed right away.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch


class RadixNode:
    """A radix-tree node: a token run, its KV slots, a reference count and an access stamp.

    Attributes:
        token_ids: the token ids of this node's run (empty only for the root).
        slots: 1-D int64 CPU tensor of KV token slots, one per entry of ``token_ids``.
        parent: the parent node, ``None`` for the root and for nodes removed from the tree.
        children: child nodes keyed by the first token id of their run.
        ref_count: number of holds on this node (a hold on a descendant counts here too).
        last_access: logical clock value of the last match or insert that walked through it.
        node_id: creation number, unique within one cache; breaks LRU ties deterministically.
        attached: ``False`` once the node has been evicted from the tree.
    """

    __slots__ = (
        "token_ids",
        "slots",
        "parent",
        "children",
        "ref_count",
        "last_access",
        "node_id",
        "attached",
    )

    def __init__(
        self,
        token_ids: Tuple[int, ...],
        slots: torch.Tensor,
        parent: Optional["RadixNode"],
        node_id: int,
        last_access: int,
    ) -> None:
        if len(token_ids) != slots.numel():
            raise ValueError(
                f"slots: expected {len(token_ids)} slots for {len(token_ids)} tokens, "
                f"got {slots.numel()}"
            )
        self.token_ids: Tuple[int, ...] = token_ids
        self.slots: torch.Tensor = slots
        self.parent: Optional[RadixNode] = parent
        self.children: Dict[int, RadixNode] = {}
        self.ref_count: int = 0
        self.last_access: int = last_access
        self.node_id: int = node_id
        self.attached: bool = True

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_root(self) -> bool:
        """True for the tree's root, the only node with an empty run."""
        return self.parent is None and self.attached

    @property
    def is_leaf(self) -> bool:
        """True when the node has no children."""
        return not self.children

    def depth_tokens(self) -> int:
        """Length of the full token sequence this node stands for (walks to the root)."""
        total = 0
        node: Optional[RadixNode] = self
        while node is not None:
            total += len(node.token_ids)
            node = node.parent
        return total

    def __repr__(self) -> str:
        preview = self.token_ids[:8]
        more = "..." if len(self.token_ids) > 8 else ""
        return (
            f"RadixNode(id={self.node_id}, tokens={preview}{more}, len={len(self.token_ids)}, "
            f"ref={self.ref_count}, last_access={self.last_access})"
        )
