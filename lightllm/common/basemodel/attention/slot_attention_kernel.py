"""Attention that reads K/V straight from the token-slot cache, compiled by torch inductor on CPU.

Written as plain tensor code (gather through the slot table, scores, masked softmax, weighted
sum of values) so that inductor fuses the gathers into the reduction loops: the kernel it
generates loads each key and value row from its slot while reducing, and nothing of size
``context x heads x head_dim`` is ever written.  The eager gather + SDPA path copies every
request's context out of the cache in every layer of every step; at long contexts that copy
costs as much as the attention itself (docs/EN/results.md has the measurements).

The kernel has no tiling for matrix units, so it re-reads keys per query: it is the right tool
for a few queries per request over a long context (decode, short prefill continuations), not
for a long fresh prompt, where SDPA's GEMMs win and the gather is paid once for many queries.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch
import torch.fx.experimental._config  # noqa: F401 - the duck-shape switch below


def slot_attention_eager(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    slot_base: torch.Tensor,
    q_pos: torch.Tensor,
) -> torch.Tensor:
    """Attention of padded queries over their request's cached keys, in float32.

    Args:
        q: ``[B, T, kv_heads, group, head_dim]`` queries (``group`` query heads share a KV head).
        k_cache, v_cache: ``[rows, kv_heads, head_dim]`` buffers holding the layer's cache at
            rows ``slot_base + slot`` (callers pass every layer's buffer with storage offset 0,
            because compiled code specialises on a zero storage offset and would recompile).
        slots: ``[B, L]`` slot of each context position of each request (contiguous).
        slot_base: 0-d int64 tensor, the layer's first row (a tensor: an int would be a constant).
        q_pos: ``[B, T]`` position of each query; it sees keys at positions ``<= q_pos``.

    Returns:
        ``[B, T, kv_heads, group, head_dim]`` float32.
    """
    length = slots.shape[1]
    scale = q.shape[-1] ** -0.5
    rows = slots + slot_base
    k = k_cache[rows].float()  # [B, L, Hkv, D]; fused into the reduction by inductor
    scores = (q.float()[:, :, None] * k[:, None, :, :, None, :]).sum(-1) * scale  # [B, T, L, Hkv, g]
    visible = torch.arange(length, device=slots.device)[None, None, :] <= q_pos[:, :, None]
    scores = scores.masked_fill(~visible[..., None, None], float("-inf"))
    probs = torch.softmax(scores, dim=2)
    v = v_cache[rows].float()
    return (probs[..., None] * v[:, None, :, :, None, :]).sum(2)


_compiled: Optional[Callable[..., torch.Tensor]] = None
_compile_lock = threading.Lock()


def compiled_slot_attention() -> Callable[..., torch.Tensor]:
    """The inductor-compiled :func:`slot_attention_eager` (one compiled function per process).

    Shapes follow torch's automatic dynamic: the first call compiles for its exact shapes, and
    a dim that later changes (batch, queries, context length, cache size) becomes symbolic in
    the one recompile that follows; head counts and head_dim never change, so they stay
    constants and the inner loops are fully vectorised without tails (``dynamic=True`` made
    them symbolic too and measured slower).  Callers warm it up with two shapes per query
    count (see ``TorchCompiledAttention.warmup``).
    """
    global _compiled
    with _compile_lock:
        if _compiled is None:
            # Duck shaping would give equal-sized dims one symbol (a batch of 2 and a GQA group
            # of 2, say) and recompile when they part; the kernel is this process's only
            # compiled code, so switching it off costs nothing elsewhere.
            torch.fx.experimental._config.use_duck_shape = False
            _compiled = torch.compile(slot_attention_eager, fullgraph=True)
        return _compiled
