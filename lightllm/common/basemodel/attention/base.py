"""The seam between model code and attention kernels."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from lightllm.common.basemodel.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Computes attention of new tokens over their request's cached context.

    ``prepare`` runs once per forward (index building shared by all layers); ``forward`` runs
    per layer after the layer's new K/V have been written to the cache.  A GPU backend (Triton
    kernels) implements the same two calls, so model code never changes.
    """

    def layer_kernels(self) -> str:
        """Which layer ops the model runs next to this backend: ``torch``, ``triton`` or ``cpp``.

        They cover each layer's residual add + RMSNorm, rotary embedding and SwiGLU (see
        ``layer_ops_select.build_layer_ops``); a backend picks the ones built for its device.
        """
        return "torch"

    def warmup(self, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Compile or otherwise prepare kernels for this head layout before the first forward."""

    @abstractmethod
    def prepare(self, batch: ForwardBatch, req_to_token: torch.Tensor) -> Any:
        """Build per-forward metadata for ``batch``."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
    ) -> torch.Tensor:
        """Attention output ``[T, q_heads, head_dim]`` for queries ``q`` ``[T, q_heads, head_dim]``.

        ``k_cache``/``v_cache`` are one layer's buffers ``[slots, kv_heads, head_dim]``.
        """
