"""RMSNorm fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    X, Residual, W, Out,
    stride_x, stride_r, stride_o,
    N, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    # One program per row; the whole hidden vector fits one block.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
        # Round the sum to the stream's dtype before normalising, as the unfused model does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(Residual.dtype.element_ty)
        tl.store(Residual + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (xf * inv_rms * w).to(Out.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` in place (when given), then RMSNorm of ``residual`` (else of ``x``).

    ``x`` and ``residual`` are ``[T, hidden]`` with contiguous rows; returns the normalised
    ``[T, hidden]`` times ``weight`` in x's dtype.
    """
    if x.dim() != 2 or x.stride(1) != 1 or (residual is not None and (residual.shape != x.shape or residual.stride(1) != 1)):
        raise ValueError("add_rms_norm takes [T, hidden] tensors with contiguous rows")
    out = torch.empty_like(x)
    rows, hidden = x.shape
    if rows == 0:
        return out
    _add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        hidden, eps,
        BLOCK=triton.next_power_of_2(hidden), HAS_RESIDUAL=residual is not None,
    )
    return out


def add_rms_norm_reference(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """The same as :func:`add_rms_norm` in torch (float32 math)."""
    if residual is not None:
        residual.copy_((residual.float() + x.float()).to(residual.dtype))
        x = residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)
