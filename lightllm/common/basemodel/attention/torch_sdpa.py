"""Attention on top of ``torch.nn.functional.scaled_dot_product_attention`` (CPU and CUDA)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F

from lightllm.common.basemodel.attention.base import AttentionBackend
from lightllm.common.basemodel.forward_batch import ForwardBatch


@dataclass
class _PrefillItem:
    token_start: int
    token_end: int
    context_slots: torch.Tensor
    mask: Optional[torch.Tensor]  # None: plain causal over a fresh prompt


@dataclass
class _SdpaMeta:
    is_decode: bool
    prefill: List[_PrefillItem]
    decode_slots: Optional[torch.Tensor] = None  # [B, L]
    decode_mask: Optional[torch.Tensor] = None  # [B, 1, 1, L]


class TorchSdpaAttention(AttentionBackend):
    """Gathers each request's K/V from the token-slot cache and calls SDPA.

    Decode batches are padded to the longest context with a key mask and run as one call;
    prefill runs one call per request, causal with an offset for tokens already cached.
    """

    def prepare(self, batch: ForwardBatch, req_to_token: torch.Tensor) -> _SdpaMeta:
        device = batch.input_ids.device
        seq_lens = batch.seq_lens
        if batch.is_decode:
            max_len = max(seq_lens)
            slots = req_to_token[batch.req_rows, :max_len]
            lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
            mask = torch.arange(max_len, device=device)[None, :] < lens[:, None]
            return _SdpaMeta(True, [], slots, mask[:, None, None, :])
        items: List[_PrefillItem] = []
        token_start = 0
        rows = batch.req_rows.tolist()
        for row, start, new in zip(rows, batch.start_lens, batch.new_lens):
            ctx = start + new
            mask = None
            if start > 0:
                q_pos = torch.arange(start, ctx, device=device)[:, None]
                mask = torch.arange(ctx, device=device)[None, :] <= q_pos
            items.append(_PrefillItem(token_start, token_start + new, req_to_token[row, :ctx], mask))
            token_start += new
        return _SdpaMeta(False, items)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: _SdpaMeta) -> torch.Tensor:
        gqa = q.shape[1] != k_cache.shape[1]
        if meta.is_decode:
            # index_select on flat slots is several times faster than 2-D advanced indexing.
            batch, length = meta.decode_slots.shape
            flat = meta.decode_slots.reshape(-1)
            k = k_cache.index_select(0, flat).view(batch, length, *k_cache.shape[1:]).transpose(1, 2)
            v = v_cache.index_select(0, flat).view(batch, length, *v_cache.shape[1:]).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q[:, :, None, :].to(k.dtype), k, v, attn_mask=meta.decode_mask, enable_gqa=gqa
            )
            return out[:, :, 0, :].to(q.dtype)
        out = torch.empty_like(q)
        for item in meta.prefill:
            q_i = q[item.token_start : item.token_end].transpose(0, 1)  # [H, n, D]
            k_i = k_cache.index_select(0, item.context_slots).transpose(0, 1)  # [kv_heads, ctx, D]
            v_i = v_cache.index_select(0, item.context_slots).transpose(0, 1)
            o_i = F.scaled_dot_product_attention(
                q_i.to(k_i.dtype),
                k_i,
                v_i,
                attn_mask=item.mask,
                is_causal=item.mask is None,
                enable_gqa=gqa,
            )
            out[item.token_start : item.token_end] = o_i.transpose(0, 1).to(q.dtype)
        return out
