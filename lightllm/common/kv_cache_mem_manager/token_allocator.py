"""Allocation of KV-cache token slots.

A slot is one token's K/V position in every layer's buffer.  The allocator hands out slot
indexes and takes them back; it never touches the buffers themselves.
"""

from __future__ import annotations

import torch


class KVCacheExhaustedError(RuntimeError):
    """More slots were requested than are free."""


class SlotFreeError(RuntimeError):
    """A slot was freed that is not currently allocated (double free or foreign index)."""


class TokenSlotAllocator:
    """Free-list allocator over ``size`` token slots.

    The free list is a stack held in a tensor so that allocating ``n`` slots is one slice, and
    an ``allocated`` mask catches double frees and frees of slots never handed out.
    """

    def __init__(self, size: int):
        if size <= 0:
            raise ValueError(f"KV cache size must be positive, got {size}")
        self.size = size
        self._free_stack = torch.arange(size - 1, -1, -1, dtype=torch.int64)
        self._free_top = size  # slots _free_stack[:_free_top] are free
        self._allocated = torch.zeros(size, dtype=torch.bool)

    @property
    def available(self) -> int:
        """Number of free slots."""
        return self._free_top

    @property
    def used(self) -> int:
        """Number of allocated slots."""
        return self.size - self._free_top

    def alloc(self, num: int) -> torch.Tensor:
        """Take ``num`` free slots; raises :class:`KVCacheExhaustedError` if there are fewer."""
        if num < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({num})")
        if num > self._free_top:
            raise KVCacheExhaustedError(
                f"KV cache exhausted: asked for {num} token slots, {self._free_top} of {self.size} free"
            )
        start = self._free_top - num
        slots = self._free_stack[start : self._free_top].clone()
        self._free_top = start
        self._allocated[slots] = True
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Return ``slots`` to the free list; rejects double frees and out-of-range indexes."""
        slots = torch.as_tensor(slots, dtype=torch.int64).reshape(-1)
        num = slots.numel()
        if num == 0:
            return
        if int(slots.min()) < 0 or int(slots.max()) >= self.size:
            raise SlotFreeError(f"slot index out of range [0, {self.size}) in free()")
        if not bool(self._allocated[slots].all()) or torch.unique(slots).numel() != num:
            raise SlotFreeError("double free: some slots passed to free() are not allocated")
        self._allocated[slots] = False
        self._free_stack[self._free_top : self._free_top + num] = slots
        self._free_top += num
