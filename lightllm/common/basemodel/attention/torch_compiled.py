"""CPU attention that reads the KV cache in place (``--attention_backend torch_compiled``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch

from lightllm.common.basemodel.attention.slot_attention_kernel import compiled_slot_attention
from lightllm.common.basemodel.attention.torch_sdpa import TorchSdpaAttention, _SdpaMeta, context_slots
from lightllm.common.basemodel.forward_batch import ForwardBatch

# Prefill batches whose longest chunk has at most this many tokens go through the in-place
# kernel too (chunked continuations and prefix-cache hits with a short tail).  Longer chunks
# run SDPA: its GEMMs beat the kernel's per-query loops, and the one gather of the context is
# shared by every query of the chunk (measured at under 3% of SDPA time from 64 queries up).
FUSED_MAX_QUERIES = 16

# Below this many (request x context position) pairs per forward the gather is small enough
# to stay in cache and the eager path's lower per-call cost wins; above it the kernel does
# (bench_decode_attention --clock cpu --min-fused-context 0: equal at 16 x 128, 1.1x faster at
# 64 x 128, 1.3-1.5x from 16 x 1024 up).  A single request always takes the eager path: the
# kernel pads the batch to two rows (one compiled graph for all sizes), doubling its work,
# and measured 0.73-0.86x there.
MIN_FUSED_CONTEXT = 4096
MIN_FUSED_REQUESTS = 2

# The kernel keeps float32 scores and probabilities of shape [rows, queries, context, q_heads];
# larger batches run in row chunks so that each of the two stays under 32 MiB, about what the
# torch path's 16-request gather of K and V takes at 4K context.
MAX_SCORE_ELEMENTS = 1 << 23


@dataclass
class _SlotMeta:
    """Per-forward index tensors, built once and shared by every layer."""

    slots: torch.Tensor  # [B, L] slot of each context position (padding reads slot of position 0)
    q_pos: torch.Tensor  # [B, T] position of each padded query
    q_index: Optional[torch.Tensor]  # [B * T] flattened token of each padded query; None: decode
    out_index: Optional[torch.Tensor]  # [tokens] padded row of each flattened token; None: decode
    queries: int  # T


def _at_least_two(n: int) -> int:
    # Sizes 0 and 1 get their own compiled specialisation; padding to 2 keeps one graph.
    return max(n, 2)


def _row_chunks(rows: int, per_row: int) -> List[Tuple[int, int]]:
    """Row ranges with at most :data:`MAX_SCORE_ELEMENTS` scores each, none of a single row
    (a one-row chunk would compile a size-1 specialisation)."""
    step = max(2, MAX_SCORE_ELEMENTS // max(per_row, 1))
    starts = list(range(0, rows, step))
    if len(starts) > 1 and rows - starts[-1] < 2:
        starts.pop()
    return [(a, b) for a, b in zip(starts, starts[1:] + [rows])]


def _whole_buffer(cache: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """``cache`` (one layer, a view into all layers' buffer) as rows of the whole buffer, and its first row."""
    row = cache.stride(0)
    if cache.storage_offset() % row or not cache.is_contiguous():
        raise ValueError("a KV cache layer must be a contiguous view starting on a slot boundary")
    rows = cache.untyped_storage().nbytes() // (row * cache.element_size())
    whole = cache.as_strided((rows, *cache.shape[1:]), cache.stride(), 0)
    return whole, cache.storage_offset() // row


class TorchCompiledAttention(TorchSdpaAttention):
    """Decode and short-chunk prefill through an inductor-compiled kernel over the slot table.

    Per forward, :meth:`prepare` builds one ``[B, L]`` slot matrix (a copy of the index table
    rows, ``8 x L`` bytes per request) that every layer reuses; per layer the kernel reads each
    key/value row from its slot once per query.  Long prefill chunks fall back to the parent's
    gather + SDPA path (see :data:`FUSED_MAX_QUERIES`).  The first call per shape class compiles
    (seconds; inductor caches the result on disk), so the server warms it up at load.
    """

    def __init__(self, min_fused_context: int = MIN_FUSED_CONTEXT, min_fused_requests: int = MIN_FUSED_REQUESTS) -> None:
        """A forward takes the kernel from ``min_fused_requests`` requests and ``requests x longest context >= min_fused_context``."""
        self._kernel = compiled_slot_attention()
        self.min_fused_context = min_fused_context
        self.min_fused_requests = min_fused_requests

    def prepare(self, batch: ForwardBatch, req_to_token: torch.Tensor) -> Union[_SlotMeta, _SdpaMeta]:
        """Slot-table metadata for the compiled kernel; the parent's gather + SDPA metadata for a batch too small
        to gain from it or a prefill chunk longer than :data:`FUSED_MAX_QUERIES`."""
        new_lens = batch.new_lens
        longest_chunk = max(new_lens)
        size = len(new_lens)
        length = _at_least_two(max(batch.seq_lens))
        too_small = size < self.min_fused_requests or size * length < self.min_fused_context
        if too_small or (not batch.is_decode and longest_chunk > FUSED_MAX_QUERIES):
            return super().prepare(batch, req_to_token)
        device = batch.input_ids.device
        rows = batch.req_rows
        lens = batch.seq_lens
        if size < 2:
            rows = rows.expand(2)  # a duplicate row; its output is dropped
            lens = [lens[0], lens[0]]
        slots, _ = context_slots(req_to_token, rows, lens, length)  # the kernel masks by position
        if batch.is_decode:
            # A fresh tensor, as in the prefill branch: compiled code guards on whether an
            # input is a view, and a mismatch would recompile.
            q_pos = batch.positions.view(-1, 1).expand(rows.shape[0], 1).clone()
            return _SlotMeta(slots, q_pos, None, None, 1)
        queries = _at_least_two(longest_chunk)
        q_index, out_index = batch.padded_query_index(queries)
        if size < 2:
            q_index = q_index.expand(2, queries)
        q_index = q_index.reshape(-1).to(device)
        q_pos = batch.positions[q_index].view(-1, queries)
        return _SlotMeta(slots, q_pos, q_index, out_index.to(device), queries)

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Union[_SlotMeta, _SdpaMeta]
    ) -> torch.Tensor:
        """Attention through the compiled kernel, or the parent's path for metadata :meth:`prepare` left to it."""
        if isinstance(meta, _SdpaMeta):
            return super().forward(q, k_cache, v_cache, meta)
        tokens, q_heads, head_dim = q.shape
        kv_heads = k_cache.shape[1]
        rows = meta.slots.shape[0]
        if meta.q_index is None:
            padded = q if tokens == rows else q.expand(rows, q_heads, head_dim)
        else:
            padded = q.index_select(0, meta.q_index)
        # contiguous(): an expanded single row would otherwise reach the kernel with stride 0.
        padded = padded.reshape(rows, meta.queries, kv_heads, q_heads // kv_heads, head_dim).contiguous()
        bounds = _row_chunks(rows, meta.queries * meta.slots.shape[1] * q_heads)
        if len(bounds) == 1:
            parts = [self.forward_padded(padded, k_cache, v_cache, meta.slots, meta.q_pos)]
        else:
            # Copies, not views: a view past row 0 has a storage offset, on which compiled code
            # specialises; these inputs are small next to the K/V rows the kernel reads.
            parts = [
                self.forward_padded(padded[a:b].clone(), k_cache, v_cache, meta.slots[a:b].clone(), meta.q_pos[a:b].clone())
                for a, b in bounds
            ]
        out = (parts[0] if len(parts) == 1 else torch.cat(parts)).view(rows * meta.queries, q_heads, head_dim)
        if meta.out_index is None:
            return out[:tokens].to(q.dtype)
        return out.index_select(0, meta.out_index).to(q.dtype)

    def warmup(self, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Compile the decode and the short-prefill kernels for this model's head layout.

        Two calls per query count with different batch, context and cache sizes make those
        dims symbolic (automatic dynamic), so no forward compiles again.  Inputs are made the
        way a forward makes them (cache layers are views of a buffer allocated outside
        inference mode, the rest is created inside it) so that the compiled guards match.
        """
        group = q_heads // kv_heads
        for queries in (1, 3):
            for size in (2, 3):
                buffer = torch.zeros(2, 8 + size, kv_heads, head_dim, dtype=dtype, device=device)
                with torch.inference_mode():
                    q_count = queries if queries == 1 else queries + size
                    q = torch.zeros(size, q_count, kv_heads, group, head_dim, dtype=dtype, device=device)
                    slots = torch.zeros(size, 4 + 2 * size, dtype=torch.int64, device=device)
                    q_pos = torch.full((size, q_count), 3, dtype=torch.int64, device=device)
                    self.forward_padded(q, buffer[size - 2], buffer[size - 2], slots, q_pos)

    def forward_padded(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, q_pos: torch.Tensor
    ) -> torch.Tensor:
        """The kernel on padded queries ``[B, T, kv_heads, group, head_dim]`` (float32 result)."""
        k_all, base = _whole_buffer(k_cache)
        v_all, v_base = _whole_buffer(v_cache)
        if v_base != base:
            raise ValueError("the K and V caches of a layer must sit at the same offset in their buffers")
        return self._kernel(q, k_all, v_all, slots, torch.tensor(base, dtype=torch.int64), q_pos)
