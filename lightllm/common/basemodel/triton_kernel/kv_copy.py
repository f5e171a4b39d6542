"""Copy token slots of a per-layer KV buffer to and from a packed buffer (the PD transfer).

A prefill node packs the slots of a finished prompt (all layers) into one contiguous tensor to
send; the decode node unpacks the received tensor into the slots it reserved.  Both directions
are the same row copy with the slot index on one side, so one kernel serves both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The copy moves bits, not numbers: viewing every dtype as a same-width integer keeps it exact
# for any float format (and for NaN payloads) and lets one compiled kernel serve several dtypes.
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_slot_rows_kernel(
    Src, Dst, SrcIndex, DstIndex,
    stride_src_layer, stride_src_row, stride_dst_layer, stride_dst_row,
    ROW_SIZE,
    BLOCK: tl.constexpr, SRC_INDEXED: tl.constexpr, DST_INDEXED: tl.constexpr,
):
    # One program per (token, layer, BLOCK-sized piece of the token's row of kv_heads * head_dim).
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    piece = tl.program_id(2)
    if SRC_INDEXED:
        src_row = tl.load(SrcIndex + i).to(tl.int64)
    else:
        src_row = i.to(tl.int64)
    if DST_INDEXED:
        dst_row = tl.load(DstIndex + i).to(tl.int64)
    else:
        dst_row = i.to(tl.int64)
    offs = piece * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW_SIZE
    x = tl.load(Src + layer * stride_src_layer + src_row * stride_src_row + offs, mask=mask)
    tl.store(Dst + layer * stride_dst_layer + dst_row * stride_dst_row + offs, x, mask=mask)


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS_DTYPE[t.element_size()])


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 4 or not t[0, 0].is_contiguous() or t.stride(1) != t[0, 0].numel():
        raise ValueError(f"{name} must be [layers, rows, kv_heads, head_dim] with contiguous rows")


def _launch(src: torch.Tensor, dst: torch.Tensor, src_index, dst_index, count: int, block: int) -> None:
    row_size = src.shape[2] * src.shape[3]
    block = min(block, triton.next_power_of_2(row_size))
    grid = (count, src.shape[0], triton.cdiv(row_size, block))
    s, d = _as_bits(src), _as_bits(dst)
    # An unindexed side's pointer is never read, but the launch needs a tensor there: pass the other index.
    _copy_slot_rows_kernel[grid](
        s, d, src_index if src_index is not None else dst_index, dst_index if dst_index is not None else src_index,
        s.stride(0), s.stride(1), d.stride(0), d.stride(1), row_size,
        BLOCK=block, SRC_INDEXED=src_index is not None, DST_INDEXED=dst_index is not None,
    )


def pack_kv_slots(kv_buffer: torch.Tensor, slots: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Rows ``slots`` of every layer of ``kv_buffer`` ``[layers, size, kv_heads, D]``, packed
    as ``[layers, len(slots), kv_heads, D]``."""
    _check_rows("kv_buffer", kv_buffer)
    layers, _, kv_heads, head_dim = kv_buffer.shape
    packed = torch.empty(layers, slots.numel(), kv_heads, head_dim, dtype=kv_buffer.dtype, device=kv_buffer.device)
    if slots.numel():
        _launch(kv_buffer, packed, slots, None, slots.numel(), block)
    return packed


def unpack_kv_slots(packed: torch.Tensor, kv_buffer: torch.Tensor, slots: torch.Tensor, block: int = 1024) -> None:
    """Write ``packed`` ``[layers, len(slots), kv_heads, D]`` into rows ``slots`` of ``kv_buffer``."""
    _check_rows("kv_buffer", kv_buffer)
    _check_rows("packed", packed)
    if packed.dtype != kv_buffer.dtype or packed.shape[0] != kv_buffer.shape[0] or packed.shape[2:] != kv_buffer.shape[2:]:
        raise ValueError(
            f"packed {tuple(packed.shape)} {packed.dtype} does not fit kv_buffer {tuple(kv_buffer.shape)} {kv_buffer.dtype}"
        )
    if packed.shape[1] != slots.numel():
        raise ValueError(f"packed holds {packed.shape[1]} tokens but {slots.numel()} slots were given")
    if slots.numel():
        _launch(packed, kv_buffer, None, slots, slots.numel(), block)


def pack_kv_slots_reference(kv_buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The same as :func:`pack_kv_slots` with torch indexing."""
    return kv_buffer[:, slots.long()].contiguous()


def unpack_kv_slots_reference(packed: torch.Tensor, kv_buffer: torch.Tensor, slots: torch.Tensor) -> None:
    """The same as :func:`unpack_kv_slots` with torch indexing."""
    kv_buffer[:, slots.long()] = packed
