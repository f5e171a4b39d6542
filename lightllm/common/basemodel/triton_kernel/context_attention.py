"""Prefill (context) attention for a ragged batch whose requests may already have cached tokens.

Request ``i`` has ``start_lens[i]`` tokens cached (a prefix-cache hit or earlier chunks) and
``new_lens[i]`` new tokens whose K/V the model has just written to the cache.  Every new token
attends to the whole cached prefix and causally to the new tokens up to itself; keys and values
are read in place through ``req_to_token``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightllm.common.basemodel.triton_kernel.launch_utils import (
    block_for,
    check_attention_inputs,
    dot_in_fp32,
    gather_context_reference,
)


@triton.jit
def _context_attention_kernel(
    Q, K, V, Out, ReqToToken, ReqRows, StartLens, NewLens, QStarts,
    stride_q_t, stride_q_h, stride_k_s, stride_k_h, stride_v_s, stride_v_h, stride_o_t, stride_o_h, stride_r_row,
    sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # One program per (request, query head, block of BLOCK_M new tokens): flash attention with
    # the causal limit shifted by the cached prefix length.
    req = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    new_len = tl.load(NewLens + req)
    if m_block * BLOCK_M >= new_len:
        return
    kv_head = head // GROUP
    start_len = tl.load(StartLens + req)
    q_start = tl.load(QStarts + req).to(tl.int64)
    row = tl.load(ReqRows + req).to(tl.int64)
    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < new_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(
        Q + (q_start + m)[:, None] * stride_q_t + head * stride_q_h + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = start_len + m
    # Keys past the last query of this block are masked for every row: stop the loop there.
    key_end = start_len + tl.minimum(new_len, (m_block + 1) * BLOCK_M)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n_start in range(0, key_end, BLOCK_N):
        n = n_start + tl.arange(0, BLOCK_N)
        n_mask = n < key_end
        slots = tl.load(ReqToToken + row * stride_r_row + n, mask=n_mask, other=0).to(tl.int64)
        kt = tl.load(
            K + slots[None, :] * stride_k_s + kv_head * stride_k_h + d[:, None],
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        )
        if DOT_FP32:
            kt = kt.to(tl.float32)
        scores = tl.dot(q, kt, input_precision=DOT_PRECISION) * sm_scale
        visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        # Every row sees key 0, so m_new is finite from the first block on.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        v = tl.load(
            V + slots[:, None] * stride_v_s + kv_head * stride_v_h + d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        Out + (q_start + m)[:, None] * stride_o_t + head * stride_o_h + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def context_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    start_lens: torch.Tensor,
    new_lens: torch.Tensor,
    q_starts: torch.Tensor,
    max_new_len: int,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Attention of the new tokens ``q`` ``[T, q_heads, D]`` of a ragged batch.

    Request ``i``'s new tokens are rows ``q_starts[i] .. q_starts[i] + new_lens[i] - 1`` of
    ``q`` at positions ``start_lens[i] ..``; its keys are positions ``0 .. start_lens[i] +
    new_lens[i] - 1`` of ``req_to_token[req_rows[i]]``.  ``max_new_len`` (a host int, so that no
    device sync is needed) sizes the launch grid.  Returns ``[T, q_heads, D]`` in q's dtype.
    """
    total, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    check_attention_inputs(q, k_cache, v_cache)
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    out = torch.empty_like(q) if out is None else out
    batch = req_rows.shape[0]
    if batch == 0 or total == 0:
        return out
    grid = (batch, q_heads, triton.cdiv(max_new_len, block_m))
    _context_attention_kernel[grid](
        q, k_cache, v_cache, out, req_to_token, req_rows, start_lens, new_lens, q_starts,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        head_dim ** -0.5,
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_for(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_FP32=dot_in_fp32(k_cache.dtype),
        # float32 products would otherwise round their inputs to tf32 on the GPU; the torch
        # reference path computes them in full float32.
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
    )
    return out


def context_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    start_lens: torch.Tensor,
    new_lens: torch.Tensor,
    q_starts: torch.Tensor,
) -> torch.Tensor:
    """The same result in plain torch (float32 math, one request at a time, explicit mask)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for i in range(req_rows.shape[0]):
        start, new, first = int(start_lens[i]), int(new_lens[i]), int(q_starts[i])
        k, v = gather_context_reference(k_cache, v_cache, req_to_token, int(req_rows[i]), start + new, group)
        qi = q[first : first + new].float()  # [new, q_heads, D]
        scores = torch.einsum("thd,lhd->htl", qi, k) * q.shape[-1] ** -0.5
        visible = torch.arange(start + new)[None, :] <= torch.arange(start, start + new)[:, None]
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        out[first : first + new] = torch.einsum("htl,lhd->thd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
