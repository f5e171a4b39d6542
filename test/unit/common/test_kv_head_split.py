"""Which KV heads each tensor-parallel rank holds: a share, or a replica of the one its query heads
read when ``--tp`` exceeds the KV heads (vLLM's rule)."""

from __future__ import annotations

import pytest

from lightllm.common.basemodel.kv_head_split import kv_head_slice, kv_head_split_problem, kv_heads_per_rank


@pytest.mark.parametrize("kv_heads, tp, expected", [
    (8, 1, [(0, 8)]),
    (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
    (2, 2, [(0, 1), (1, 2)]),
    (1, 2, [(0, 1), (0, 1)]),
    (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),
    (2, 8, [(0, 1)] * 4 + [(1, 2)] * 4),
])
def test_each_rank_holds_a_share_or_a_replica(kv_heads, tp, expected):
    slices = [kv_head_slice(kv_heads, rank, tp) for rank in range(tp)]
    assert [(s.start, s.stop) for s in slices] == expected
    assert kv_heads_per_rank(kv_heads, tp) == expected[0][1] - expected[0][0]


@pytest.mark.parametrize("q_heads, kv_heads, tp", [(4, 1, 2), (4, 2, 4), (8, 2, 8), (16, 4, 8), (6, 2, 6)])
def test_every_query_head_of_a_rank_reads_the_kv_head_that_rank_holds(q_heads, kv_heads, tp):
    group = q_heads // kv_heads  # query heads per KV head, as grouped-query attention pairs them
    per_rank = q_heads // tp
    for rank in range(tp):
        held = kv_head_slice(kv_heads, rank, tp)
        for q in range(rank * per_rank, (rank + 1) * per_rank):
            assert held.start <= q // group < held.stop


@pytest.mark.parametrize("kv_heads, tp", [(3, 2), (2, 3), (4, 6), (6, 4)])
def test_a_tp_that_neither_divides_nor_is_a_multiple_is_refused(kv_heads, tp):
    problem = kv_head_split_problem(kv_heads, tp)
    assert problem is not None and f"--tp {tp}" in problem and f"({kv_heads})" in problem
    with pytest.raises(ValueError, match="must divide one another"):
        kv_heads_per_rank(kv_heads, tp)
    with pytest.raises(ValueError, match="outside a tensor-parallel group"):
        kv_head_slice(2, 2, 2)
