"""Decode attention: one query token per request over its cached context, read in place.

Each request's keys and values stay where the token-slot KV cache put them; the kernel follows
``req_to_token[row, position] -> slot`` instead of gathering a contiguous copy first, which is
what the torch backend does and what costs a GPU a copy of every context per layer per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.common.basemodel.triton_kernel.launch_utils import block_for, check_attention_inputs, gather_context_reference


@triton.jit
def _decode_attention_kernel(
    Q, K, V, Out, ReqToToken, ReqRows, SeqLens,
    stride_q_t, stride_q_h, stride_k_s, stride_k_h, stride_v_s, stride_v_h, stride_o_t, stride_o_h, stride_r_row,
    sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per (request, query head): an online softmax over blocks of BLOCK_N keys.
    req = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    row = tl.load(ReqRows + req).to(tl.int64)
    seq_len = tl.load(SeqLens + req)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(Q + req * stride_q_t + head * stride_q_h + d, mask=d_mask, other=0.0).to(tl.float32) * sm_scale
    m_i = tl.zeros([], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < seq_len
        slots = tl.load(ReqToToken + row * stride_r_row + n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + slots[:, None] * stride_k_s + kv_head * stride_k_h + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.sum(q[None, :] * k.to(tl.float32), axis=1)
        scores = tl.where(n_mask, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(V + slots[:, None] * stride_v_s + kv_head * stride_v_h + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(Out + req * stride_o_t + head * stride_o_h + d, out.to(Out.dtype.element_ty), mask=d_mask)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, q_heads, D]`` (request ``i``'s one new token) over its context.

    Request ``i``'s context is positions ``0 .. seq_lens[i]-1`` of ``req_to_token[req_rows[i]]``,
    each naming a slot of ``k_cache``/``v_cache`` ``[slots, kv_heads, D]``; ``q_heads`` must be a
    multiple of ``kv_heads`` (grouped-query attention).  Returns ``[B, q_heads, D]`` in q's dtype.
    """
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    check_attention_inputs(q, k_cache, v_cache)
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    _decode_attention_kernel[(batch, q_heads)](
        q, k_cache, v_cache, out, req_to_token, req_rows, seq_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        head_dim ** -0.5,
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_for(head_dim), BLOCK_N=block_n,
    )
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    """The same result in plain torch (float32 math, one request at a time)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for i in range(q.shape[0]):
        k, v = gather_context_reference(k_cache, v_cache, req_to_token, int(req_rows[i]), int(seq_lens[i]), group)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), k) * q.shape[-1] ** -0.5
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
