"""Small helpers shared by the kernel launchers (no kernels here)."""

from __future__ import annotations

import os

import torch
import triton


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    knobs = getattr(triton, "knobs", None)  # triton < 3.4 has no knobs and reads the variable itself
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
