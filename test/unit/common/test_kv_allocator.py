"""The token-slot allocator, the request manager and the KV memory manager."""

from __future__ import annotations

import random

import pytest
import torch

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.common.kv_cache_mem_manager.token_allocator import (
    KVCacheExhaustedError,
    SlotFreeError,
    TokenSlotAllocator,
)
from lightllm.common.req_manager import ReqManager, RequestRowsExhaustedError


def test_alloc_and_free_return_to_full_count():
    alloc = TokenSlotAllocator(100)
    a = alloc.alloc(30)
    b = alloc.alloc(70)
    assert alloc.available == 0
    assert len(set(a.tolist()) | set(b.tolist())) == 100
    alloc.free(a)
    alloc.free(b)
    assert alloc.available == 100


def test_over_allocation_names_the_shortfall():
    alloc = TokenSlotAllocator(10)
    alloc.alloc(8)
    with pytest.raises(KVCacheExhaustedError, match="asked for 5 token slots, 2 of 10 free"):
        alloc.alloc(5)
    assert alloc.available == 2


def test_double_free_and_foreign_slots_are_rejected():
    alloc = TokenSlotAllocator(10)
    slots = alloc.alloc(3)
    alloc.free(slots)
    with pytest.raises(SlotFreeError, match="double free"):
        alloc.free(slots)
    with pytest.raises(SlotFreeError, match="out of range"):
        alloc.free(torch.tensor([10]))
    held = alloc.alloc(2)
    with pytest.raises(SlotFreeError, match="double free"):
        alloc.free(torch.cat([held, held[:1]]))
    assert alloc.available == 8  # the rejected free changed nothing


def test_random_rounds_leak_nothing():
    rng = random.Random(0)
    alloc = TokenSlotAllocator(256)
    held = []
    for _ in range(100):
        if held and rng.random() < 0.5:
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            num = rng.randint(0, min(40, alloc.available))
            held.append(alloc.alloc(num))
        owned = torch.cat(held).tolist() if held else []
        assert len(owned) == len(set(owned)) == 256 - alloc.available
    for slots in held:
        alloc.free(slots)
    assert alloc.available == 256


def test_memory_manager_writes_by_slot():
    mem = KVCacheMemoryManager(16, num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)
    slots = mem.alloc(3)
    k = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    mem.write(1, slots, k, v)
    assert torch.equal(mem.k_buffer[1][slots], k)
    assert torch.equal(mem.v_buffer[1][slots], v)
    assert KVCacheMemoryManager.bytes_per_token(2, 2, 4, torch.float32) == 2 * 2 * 2 * 4 * 4


def test_req_manager_rows():
    mgr = ReqManager(2, 8)
    row = mgr.alloc_row()
    mgr.alloc_row()
    with pytest.raises(RequestRowsExhaustedError):
        mgr.alloc_row()
    mgr.set_slots(row, 2, torch.tensor([5, 6]))
    assert mgr.slots(row, 2, 4).tolist() == [5, 6]
    with pytest.raises(ValueError, match="max_sequence_length"):
        mgr.set_slots(row, 7, torch.tensor([1, 2]))
    mgr.free_row(row)
    with pytest.raises(ValueError, match="not allocated"):
        mgr.free_row(row)
