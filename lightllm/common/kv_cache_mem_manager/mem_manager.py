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
        shareable: bool = False,
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
        if shareable:
            self.share_buffers()

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

    # --- access for the PD KV transfer -----------------------------------------------------
    # Everything outside this class that reads or writes K/V of whole tokens goes through
    # export_slots/import_slots, so the buffer layout can change here alone.

    def export_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """K/V of ``slots`` in every layer as one contiguous ``[T, 2, num_layers, kv_heads, head_dim]`` tensor.

        Token-major so that any run of tokens (a transfer page) is a contiguous slice.
        """
        index = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        out = torch.empty(index.numel(), 2, self.num_layers, self.kv_heads, self.head_dim,
                          dtype=self.dtype, device=self.device)
        # Gathering layer by layer straight into place is ~3x faster than stack + permute.
        for layer in range(self.num_layers):
            out[:, 0, layer] = self.k_buffer[layer].index_select(0, index)
            out[:, 1, layer] = self.v_buffer[layer].index_select(0, index)
        return out

    def import_slots(self, slots: torch.Tensor, data: torch.Tensor) -> None:
        """Write ``data`` (the layout :meth:`export_slots` returns) into ``slots`` of every layer."""
        index = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        expected = (index.numel(), 2, self.num_layers, self.kv_heads, self.head_dim)
        if tuple(data.shape) != expected or data.dtype != self.dtype:
            raise ValueError(
                f"KV data of shape {tuple(data.shape)} and dtype {data.dtype} does not fit this cache "
                f"(expected {expected}, {self.dtype})"
            )
        data = data.to(self.device)
        self.k_buffer.index_copy_(1, index, data[:, 0].transpose(0, 1))
        self.v_buffer.index_copy_(1, index, data[:, 1].transpose(0, 1))

    def token_bytes(self) -> int:
        """Bytes one token's K/V takes in :meth:`export_slots`' layout."""
        return self.bytes_per_token(self.num_layers, self.kv_heads, self.head_dim, self.dtype)

    def share_buffers(self) -> None:
        """Make the K/V buffers shareable with a child process (off by default).

        CPU buffers move into shared memory; CUDA buffers already travel through CUDA IPC when
        pickled by ``torch.multiprocessing``, so nothing needs doing for them here.
        """
        if self.device.type == "cpu":
            self.k_buffer.share_memory_()
            self.v_buffer.share_memory_()

    def transfer_view(self) -> "KVCacheMemoryManager":
        """A picklable manager over the same (shared) buffers, without a slot allocator.

        Handed to a KV transfer process: it calls only :meth:`export_slots` and
        :meth:`import_slots`, while slot allocation stays with the owning rank process.
        """
        if self.device.type == "cpu" and not (self.k_buffer.is_shared() and self.v_buffer.is_shared()):
            raise RuntimeError("KV buffers are not shared: construct with shareable=True or call share_buffers()")
        view = object.__new__(KVCacheMemoryManager)
        view.size, view.num_layers, view.kv_heads = self.size, self.num_layers, self.kv_heads
        view.head_dim, view.dtype, view.device = self.head_dim, self.dtype, self.device
        view.allocator = None
        view.k_buffer, view.v_buffer = self.k_buffer, self.v_buffer
        return view
