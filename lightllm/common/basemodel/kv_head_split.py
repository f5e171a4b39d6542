"""Which KV heads each tensor-parallel rank holds: a share of them, or a replica of one.

Torch-free, so the launcher sizes the KV cache with the same rule the model rank loads weights by.

When ``--tp`` divides ``num_key_value_heads`` each rank holds ``num_key_value_heads / tp`` of
them.  When ``--tp`` is a multiple of ``num_key_value_heads`` (a model with fewer KV heads than
ranks, e.g. one KV head under ``--tp 2``) each rank holds a copy of one KV head, the one its
query heads read: rank ``r`` of ``tp`` holds KV head ``r // (tp / num_key_value_heads)``.  Query
heads stay split ``tp`` ways, and rank ``r``'s query heads all belong to that KV head's group
because ``tp / num_key_value_heads`` ranks share one group of ``num_attention_heads /
num_key_value_heads`` query heads evenly.  Every replica computes the same K and V, so no rank's
attention needs another rank's KV; the cost is that the KV cache is stored ``tp /
num_key_value_heads`` times over.
"""

from __future__ import annotations

from typing import Optional


def kv_head_split_problem(num_kv_heads: int, tp: int) -> Optional[str]:
    """Why ``tp`` ranks cannot split ``num_kv_heads`` KV heads, or ``None`` when they can."""
    if num_kv_heads % tp == 0 or tp % num_kv_heads == 0:
        return None
    return (f"--tp {tp} and num_key_value_heads ({num_kv_heads}) must divide one another (each rank holds a share "
            f"of the KV heads, or a replica of one when --tp is a multiple of num_key_value_heads)")


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """How many KV heads one of ``tp`` ranks holds (1 when they are replicated)."""
    problem = kv_head_split_problem(num_kv_heads, tp)
    if problem is not None:
        raise ValueError(problem)
    return max(1, num_kv_heads // tp)


def kv_head_slice(num_kv_heads: int, rank: int, tp: int) -> slice:
    """The KV heads rank ``rank`` of ``tp`` holds, as a slice of the checkpoint's KV heads."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {tp}")
    per_rank = kv_heads_per_rank(num_kv_heads, tp)
    if num_kv_heads >= tp:
        return slice(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (tp // num_kv_heads)
    return slice(head, head + 1)
