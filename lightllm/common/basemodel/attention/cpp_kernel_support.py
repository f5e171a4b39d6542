"""Which models the C++ attention kernel has a variant for, known without building or loading it.

The launcher refuses ``--attention_backend cpp`` for a model outside this table before any process
starts (the rank's check after loading every weight took seconds to minutes); the rank still
asks the built library itself (``lightllm_slot_attention_supports``), and a test keeps the two
in step.  Torch-free.
"""

from __future__ import annotations

from typing import Optional

from lightllm.common.basemodel.kv_head_split import kv_heads_per_rank

# The head sizes the kernel is instantiated for (the head-dim list macro of cpp_kernel_vector.h).
CPP_KERNEL_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
# Query heads per KV head it unrolls for: 1 to 8, and 16 (cpp_slot_attention.cpp).
CPP_KERNEL_GROUPS = frozenset((*range(1, 9), 16))
# The KV cache element types it reads (the model's dtype).
CPP_KERNEL_DTYPES = ("float32", "bfloat16")


def cpp_kernel_supports(head_dim: int, group: int, dtype_name: str) -> bool:
    """Whether the kernel has a variant for ``head_dim``, ``group`` query heads per KV head and ``dtype_name``."""
    return head_dim in CPP_KERNEL_HEAD_DIMS and group in CPP_KERNEL_GROUPS and dtype_name in CPP_KERNEL_DTYPES


def cpp_kernel_problem(num_attention_heads: int, num_kv_heads: int, head_dim: int, tp: int,
                       dtype_name: str) -> Optional[str]:
    """Why ``--attention_backend cpp`` cannot run this model on ``tp`` ranks in ``dtype_name`` (one line), or None."""
    per_rank = max(1, num_attention_heads // tp)
    group = per_rank // kv_heads_per_rank(num_kv_heads, tp)
    if cpp_kernel_supports(head_dim, group, dtype_name):
        return None
    return (f"--attention_backend cpp: the kernel has no variant for head_dim {head_dim}, {group} query heads per "
            f"KV head, dtype {dtype_name} (it has head_dim {'/'.join(map(str, CPP_KERNEL_HEAD_DIMS))}, 1-8 or 16 "
            f"query heads per KV head, {' or '.join(CPP_KERNEL_DTYPES)}); use --attention_backend auto or torch")
