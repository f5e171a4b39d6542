"""Rotary position embedding (half-rotation form of Llama/Qwen2) applied in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    X, Cos, Sin,
    stride_x_t, stride_x_h, stride_c_t, stride_s_t,
    HEADS, HALF,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program per token, all its heads at once: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < HEADS) & (i[None, :] < HALF)
    first = X + t * stride_x_t + h[:, None] * stride_x_h + i[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    # The tables repeat their first half ([freqs, freqs]), so the first half is enough.
    cos = tl.load(Cos + t * stride_c_t + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + t * stride_s_t + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    tl.store(first, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=mask)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of every head of ``x`` ``[T, heads, D]`` in place.

    ``cos``/``sin`` are ``[T, rot_dim]`` tables as :class:`RotaryEmbedding.cos_sin` returns them;
    dims past ``rot_dim`` (partial rotary) are left alone.  Returns ``x``.
    """
    tokens, heads, head_dim = x.shape
    rot_dim = cos.shape[-1]
    if rot_dim % 2 or rot_dim > head_dim or x.stride(2) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"cannot rotate [T, {heads}, {head_dim}] with a {rot_dim}-wide table")
    if tokens == 0:
        return x
    _rotary_kernel[(tokens,)](
        x, cos, sin,
        x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        heads, rot_dim // 2,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_HALF=triton.next_power_of_2(rot_dim // 2),
    )
    return x


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotated copy of ``x`` in torch (float32 math), same contract as :func:`apply_rotary_`."""
    half = cos.shape[-1] // 2
    x1 = x[..., :half].float()
    x2 = x[..., half : 2 * half].float()
    c, s = cos[:, None, :half].float(), sin[:, None, :half].float()
    out = x.clone()
    out[..., :half] = (x1 * c - x2 * s).to(x.dtype)
    out[..., half : 2 * half] = (x2 * c + x1 * s).to(x.dtype)
    return out
