"""Per-layer K/V buffers addressed by token slot."""

from __future__ import annotations

import torch

from lightllm.common.kv_cache_mem_manager.token_allocator import TokenSlotAllocator


class KVCacheMemoryManager:
    """Owns the K and V buffers of every layer and the slot allocator over them.

    Buffers have shape ``[num_layers, size, kv_heads, head_dim]``; under tensor parallelism
    ``kv_heads`` is this rank's share of the key/value heads.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.size = size
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.allocator = TokenSlotAllocator(size)
        self.k_buffer = torch.zeros(num_layers, size, kv_heads, head_dim, dtype=dtype, device=self.device)
        self.v_buffer = torch.zeros(num_layers, size, kv_heads, head_dim, dtype=dtype, device=self.device)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one token slot takes across all layers (K and V)."""
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def alloc(self, num: int) -> torch.Tensor:
        """Allocate ``num`` token slots."""
        return self.allocator.alloc(num)

    def free(self, slots: torch.Tensor) -> None:
        """Free token slots."""
        self.allocator.free(slots)

    @property
    def available(self) -> int:
        """Free token slots."""
        return self.allocator.available

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of new tokens (``[T, kv_heads, head_dim]``) at ``slots`` of ``layer``."""
        self.k_buffer[layer].index_copy_(0, slots, k.to(self.dtype))
        self.v_buffer[layer].index_copy_(0, slots, v.to(self.dtype))
