"""Attention on top of ``torch.nn.functional.scaled_dot_product_attention`` (CPU and CUDA)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from lightllm.common.basemodel.attention.base import AttentionBackend
from lightllm.common.basemodel.forward_batch import ForwardBatch


def context_slots(
    req_to_token: torch.Tensor, rows: torch.Tensor, lens: List[int], length: int
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``[len(rows), length]`` KV slots of each request's context, its padding past ``lens`` pointing
    at the request's own first slot, and the ``[len(rows), length]`` mask of the positions inside
    the context (None when no request is padded).

    A row's entries past its length still name the slots of the row's earlier occupants, freed or
    reused since, holding whatever was written last.  Masked attention weighs them 0, but 0 x inf
    is NaN: an overflowed value left there by another request turned a short request's output into
    NaN whenever it was batched with a longer one.  Its own first slot is part of its context.
    """
    slots = req_to_token[rows, :length]
    if min(lens) >= length:
        return slots, None
    lens_t = torch.tensor(lens, dtype=torch.int64, device=slots.device)
    inside = torch.arange(length, device=slots.device)[None, :] < lens_t[:, None]
    return torch.where(inside, slots, slots[:, :1]), inside


@dataclass
class _PrefillGroup:
    """Requests whose chunks have the same cached length and new length: one SDPA call."""

    token_index: torch.Tensor  # [G, new] positions in the flattened batch
    context_slots: torch.Tensor  # [G * ctx] KV slots, request after request
    context_len: int
    mask: Optional[torch.Tensor]  # [new, ctx]; None: plain causal over a fresh prompt


@dataclass
class _DecodeChunk:
    """A slice of the decode batch whose gathered K/V stay small enough to be reused from cache."""

    rows: slice
    slots: torch.Tensor  # [n * L] KV slots, request after request
    length: int
    mask: Optional[torch.Tensor]  # [n, 1, 1, L]; None when every context has length L


@dataclass
class _SdpaMeta:
    is_decode: bool
    prefill: List[_PrefillGroup]
    decode: List[_DecodeChunk]


# Requests per decode attention call: gathering a few requests' context and consuming it at once
# keeps it in the CPU cache; gathering the whole batch first measured 3x slower.
DECODE_CHUNK_REQUESTS = 16


class TorchSdpaAttention(AttentionBackend):
    """Gathers each request's K/V from the token-slot cache and calls SDPA.

    Decode batches run in chunks of a few requests, each padded to its longest context with a key
    mask (no mask when the lengths agree).
    Prefill chunks are grouped by (cached length, new length) so that equal-shaped prompts run
    as one batched call; a group with cached tokens is causal with an offset.
    """

    def prepare(self, batch: ForwardBatch, req_to_token: torch.Tensor) -> _SdpaMeta:
        """Slot indices (and key masks) per decode chunk of :data:`DECODE_CHUNK_REQUESTS` requests, or per prefill
        group of equal (cached, new) lengths."""
        device = batch.input_ids.device
        seq_lens = batch.seq_lens
        if batch.is_decode:
            chunks: List[_DecodeChunk] = []
            for first in range(0, len(seq_lens), DECODE_CHUNK_REQUESTS):
                rows = slice(first, first + DECODE_CHUNK_REQUESTS)
                lens = seq_lens[rows]
                length = max(lens)
                # index_select on flat slots is several times faster than 2-D advanced indexing.
                slots, inside = context_slots(req_to_token, batch.req_rows[rows], lens, length)
                mask = None if inside is None else inside[:, None, None, :]
                chunks.append(_DecodeChunk(rows, slots.reshape(-1), length, mask))
            return _SdpaMeta(True, [], chunks)
        shapes: Dict[Tuple[int, int], List[Tuple[int, int]]] = defaultdict(list)
        token_start = 0
        for row, start, new in zip(batch.req_rows.tolist(), batch.start_lens, batch.new_lens):
            shapes[(start, new)].append((row, token_start))
            token_start += new
        groups: List[_PrefillGroup] = []
        for (start, new), members in shapes.items():
            ctx = start + new
            rows = torch.tensor([row for row, _ in members], dtype=torch.int64, device=device)
            firsts = torch.tensor([first for _, first in members], dtype=torch.int64, device=device)
            token_index = firsts[:, None] + torch.arange(new, device=device)[None, :]
            mask = None
            if start > 0:
                q_pos = torch.arange(start, ctx, device=device)[:, None]
                mask = torch.arange(ctx, device=device)[None, :] <= q_pos
            groups.append(_PrefillGroup(token_index, req_to_token[rows, :ctx].reshape(-1), ctx, mask))
        return _SdpaMeta(False, groups, [])

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: _SdpaMeta) -> torch.Tensor:
        """Gather each chunk's or group's K/V from the cache and run SDPA on it."""
        gqa = q.shape[1] != k_cache.shape[1]
        kv_shape = k_cache.shape[1:]
        if meta.is_decode:
            out = torch.empty_like(q)
            for chunk in meta.decode:
                q_c = q[chunk.rows]
                size = q_c.shape[0]
                k = k_cache.index_select(0, chunk.slots).view(size, chunk.length, *kv_shape).transpose(1, 2)
                v = v_cache.index_select(0, chunk.slots).view(size, chunk.length, *kv_shape).transpose(1, 2)
                o_c = F.scaled_dot_product_attention(q_c[:, :, None, :].to(k.dtype), k, v, attn_mask=chunk.mask, enable_gqa=gqa)
                out[chunk.rows] = o_c[:, :, 0, :].to(q.dtype)
            return out
        if len(meta.prefill) == 1 and meta.prefill[0].token_index.shape[0] == 1:
            out = None  # a single request covers every token: no scatter needed
        else:
            out = torch.empty_like(q)
        for group in meta.prefill:
            size = group.token_index.shape[0]
            q_g = q[group.token_index].transpose(1, 2) if out is not None else q[None].transpose(1, 2)
            k_g = k_cache.index_select(0, group.context_slots).view(size, group.context_len, *kv_shape).transpose(1, 2)
            v_g = v_cache.index_select(0, group.context_slots).view(size, group.context_len, *kv_shape).transpose(1, 2)
            o_g = F.scaled_dot_product_attention(
                q_g.to(k_g.dtype), k_g, v_g, attn_mask=group.mask, is_causal=group.mask is None, enable_gqa=gqa
            ).transpose(1, 2)
            if out is None:
                return o_g[0].to(q.dtype)
            out[group.token_index] = o_g.to(q.dtype)
        return out
