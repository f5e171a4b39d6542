"""Small helpers shared by the kernel launchers and their torch references (no kernels here)."""

from __future__ import annotations

import torch
import triton

from lightllm.utils.triton_interpret import triton_interpret_requested


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    The launcher's rule (:mod:`lightllm.utils.triton_interpret`), so that a start it let through
    with ``--attention_backend triton`` on CPU runs the kernels in the interpreter here.
    """
    return triton_interpret_requested()


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether matrix products must upcast their inputs to float32.

    The interpreter computes with numpy, which has no bfloat16: a bfloat16 ``tl.dot`` there
    returns garbage, while an elementwise load followed by a cast is exact.  On a GPU the native
    half-precision product (tensor cores) is kept.
    """
    return interpreting() and dtype == torch.bfloat16


def block_for(size: int, minimum: int = 16) -> int:
    """The power-of-two block that covers ``size`` (``tl.arange`` needs a power of two)."""
    return max(minimum, triton.next_power_of_2(size))


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Refuse what the attention kernels cannot index: a head count that does not group, or a strided last dim."""
    q_heads, kv_heads = q.shape[1], k_cache.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"q_heads {q_heads} is not a multiple of kv_heads {kv_heads}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")


def gather_context_reference(
    k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor, row: int, length: int, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the torch references: positions ``0 .. length-1`` of ``row`` as float32 K and V ``[length, q_heads, D]``.

    Each key/value head is repeated ``group`` times so that it lines up with its query heads.
    """
    slots = req_to_token[row, :length]
    k = k_cache[slots].float().repeat_interleave(group, dim=1)
    v = v_cache[slots].float().repeat_interleave(group, dim=1)
    return k, v
