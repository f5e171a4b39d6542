"""The elementwise parts of a decoder layer (residual add + RMSNorm, rotary, SwiGLU), per backend.

The model holds one layer-ops object, chosen by its attention backend's
:meth:`AttentionBackend.layer_kernels`: torch ops, the Triton kernels on CUDA, or the fused C++
kernels of ``cpp_layer_ops`` on CPU.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from lightllm.common.basemodel.rotary import RotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * RMSNorm(x)`` as transformers computes it: normalised in float32, cast to x's dtype, then weighted."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


class TorchLayerOps:
    """The elementwise parts of a decoder layer in torch ops: residual add + RMSNorm, rotary, SwiGLU.

    The model holds one of these (or a subclass running fused kernels, chosen by the attention
    backend's :meth:`AttentionBackend.layer_kernels`); the kernels are tested against this class
    and fall back to it for inputs they do not take.
    """

    def __init__(self, rotary: RotaryEmbedding) -> None:
        self.rotary = rotary

    def add_rms_norm(
        self, residual: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += delta`` in place (when given), then ``weight * RMSNorm(residual)`` as a new tensor."""
        if delta is not None:
            residual.add_(delta)
        return rms_norm(residual, weight, eps)

    def apply_rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, heads, head_dim]`` rotated by the ``[T, rot_dim]`` tables (a subclass may rotate x in place)."""
        return self.rotary.apply(x, cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` = ``[gate | up]``, written over the gate half and returned as a view."""
        gate, up = gate_up.chunk(2, dim=-1)
        # In place on the projection's own output: no [tokens, intermediate] temporaries.
        return F.silu(gate, inplace=True).mul_(up)


class TritonLayerOps(TorchLayerOps):
    """RMSNorm (fused with the residual add) and rotary through the Triton kernels; SwiGLU in torch."""

    def __init__(self, rotary: RotaryEmbedding) -> None:
        super().__init__(rotary)
        # Imported only for the Triton backend, so CPU installs never import triton here.
        from lightllm.common.basemodel.triton_kernel.rms_norm import add_rms_norm
        from lightllm.common.basemodel.triton_kernel.rotary_embedding import apply_rotary_

        self._add_rms_norm = add_rms_norm
        self._apply_rotary = apply_rotary_

    def add_rms_norm(
        self, residual: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """As the parent (``residual += delta`` in place, then the norm), in one Triton kernel."""
        if delta is None:
            return self._add_rms_norm(residual, None, weight, eps)
        return self._add_rms_norm(delta, residual, weight, eps)

    def apply_rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """As the parent, rotating ``x`` in place with the Triton kernel; returns ``x``."""
        return self._apply_rotary(x, cos, sin)
