"""CPU attention through C++ kernels that read the KV cache through the slot table (``--attention_backend cpp``).

Decode and short prefill chunks (chunked-prefill continuations, prefix-cache hits with a short
tail) go through ``cpp_slot_attention.cpp``: per request and query it walks the request's slot
table and reads each cached key and value row once, with an online softmax, so nothing of size
``context x heads x head_dim`` is copied or written.  Longer prefill chunks, where many queries
share each key and the work is arithmetic, go through ``cpp_prefill_attention.cpp``: tiles of
queries against blocks of keys with register-blocked products, causal blocks skipped (it
measured 1.3x torch's flash SDPA on one core at 2048 tokens, head_dim 32).  The kernels are
built for this machine on first use (see ``cpp_kernel_build.py``).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Optional, Union

import torch

from lightllm.common.basemodel.attention.cpp_kernel_build import load_kernel_library
from lightllm.common.basemodel.attention.backend_error import AttentionBackendError
from lightllm.common.basemodel.attention.torch_sdpa import TorchSdpaAttention, _SdpaMeta
from lightllm.common.basemodel.forward_batch import ForwardBatch

log = logging.getLogger("lightllm.attention")

# A prefill batch whose longest chunk has at most this many tokens runs in the slot kernel, which
# re-reads the context once per query; longer chunks share each key among many queries and run
# in the tiled prefill kernel.
MAX_KERNEL_QUERIES = 16

_KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass
class _KernelMeta:
    """Per-forward index tensors, built once and shared by every layer."""

    slots: torch.Tensor  # [B, L] int64, contiguous: slot of each context position
    q_pos: torch.Tensor  # [B, T] int64: position of each (padded) query
    q_index: Optional[torch.Tensor]  # [B * T] flattened token of each padded query; None: decode
    out_index: Optional[torch.Tensor]  # [tokens] padded query of each flattened token; None: decode
    queries: int  # T


@dataclass
class _PrefillKernelMeta:
    """Per-forward arguments of the long-chunk prefill kernel, shared by every layer."""

    slots: torch.Tensor  # [B, L] int64, contiguous: slot of each context position
    token_starts: torch.Tensor  # [B] int64: first flattened token of each request's chunk
    new_lens: torch.Tensor  # [B] int64
    cached_lens: torch.Tensor  # [B] int64: positions before the chunk


class CppSlotAttention(TorchSdpaAttention):
    """Decode and short-chunk prefill through the C++ slot kernel; longer chunks through the C++
    prefill kernel.

    The kernel handles float32 and bfloat16 caches, head_dim 16/32/64/80/96/128/256 and up to 8
    (or 16) query heads per KV head; a model outside that runs entirely on the parent's path,
    which :meth:`warmup` logs.
    """

    def __init__(self, compiler: str, strict: bool = False, tiled_prefill: bool = True) -> None:
        """Build (or load the cached build of) the kernel with ``compiler``.

        ``strict`` (``--attention_backend cpp`` asked for by name): a model the kernel has no
        variant for is refused at :meth:`warmup` instead of running on the fallback path.
        ``tiled_prefill``: whether chunks longer than :data:`MAX_KERNEL_QUERIES` run on the tiled
        prefill kernel (the server's choice on every build: its vectors and register blocks follow
        the build, and a -march=haswell build took 0.57-0.81x the time of gather + SDPA, one
        thread) or on gather + SDPA (False: a reference path for tests and benchmarks).
        """
        self._library = load_kernel_library(compiler)
        self._kernel_ok = True
        self._strict = strict
        self.tiled_prefill = tiled_prefill

    def layer_kernels(self) -> str:
        """The fused C++ layer ops (``cpp_layer_ops.cpp``), built into the same library as this kernel."""
        return "cpp"

    def warmup(self, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Check that this model's head layout and dtype are ones the kernel was built for."""
        group = q_heads // max(kv_heads, 1)
        supported = bool(self._library.lightllm_slot_attention_supports(head_dim, group))
        self._kernel_ok = supported and dtype in _KV_DTYPE_CODES and device.type == "cpu"
        if self._kernel_ok:
            if not self.tiled_prefill:
                log.info("attention backend cpp: prefill chunks over %d tokens run on gather + SDPA "
                         "(tiled_prefill=False)", MAX_KERNEL_QUERIES)
            return
        what = (f"the kernel has no variant for head_dim {head_dim}, {group} query heads per KV head, "
                f"dtype {str(dtype).removeprefix('torch.')} on {device.type}")
        if self._strict:
            # Asked for by name: running every forward on another path would ignore the flag.
            raise AttentionBackendError(f"--attention_backend cpp: {what}; use --attention_backend auto or torch")
        log.warning("attention backend cpp: %s; every forward uses gather + SDPA instead", what)

    def prepare(
        self, batch: ForwardBatch, req_to_token: torch.Tensor
    ) -> Union[_KernelMeta, _PrefillKernelMeta, _SdpaMeta]:
        """The kernel's slot table and query positions; the parent's gather + SDPA metadata when the kernel
        cannot run this model, and for chunks longer than :data:`MAX_KERNEL_QUERIES` the tiled prefill kernel
        (or the parent's path, without :attr:`tiled_prefill`)."""
        if not self._kernel_ok:
            return super().prepare(batch, req_to_token)
        longest_chunk = max(batch.new_lens)
        long_prefill = not batch.is_decode and longest_chunk > MAX_KERNEL_QUERIES
        if long_prefill and not self.tiled_prefill:
            return super().prepare(batch, req_to_token)
        length = max(batch.seq_lens)
        slots = req_to_token[batch.req_rows, :length].contiguous()
        if long_prefill:
            new_lens = torch.tensor(batch.new_lens, dtype=torch.int64)
            token_starts = torch.cumsum(new_lens, 0) - new_lens
            return _PrefillKernelMeta(slots, token_starts, new_lens, torch.tensor(batch.start_lens, dtype=torch.int64))
        if batch.is_decode:
            return _KernelMeta(slots, batch.positions.view(-1, 1).contiguous(), None, None, 1)
        queries = longest_chunk
        q_index, out_index = batch.padded_query_index(queries)
        q_index = q_index.reshape(-1)
        q_pos = batch.positions[q_index].view(-1, queries).contiguous()
        return _KernelMeta(slots, q_pos, q_index, out_index, queries)

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Union[_KernelMeta, _PrefillKernelMeta, _SdpaMeta],
    ) -> torch.Tensor:
        """Attention through the kernel :meth:`prepare` chose (the parent's path for its metadata).

        Raises:
            ValueError: a K or V cache layer is not contiguous.
            RuntimeError: the kernel refused its arguments.
        """
        if isinstance(meta, _SdpaMeta):
            return super().forward(q, k_cache, v_cache, meta)
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("attention backend cpp needs contiguous K/V cache layers")
        if isinstance(meta, _PrefillKernelMeta):
            return self._prefill(q, k_cache, v_cache, meta)
        tokens, q_heads, head_dim = q.shape
        kv_heads = k_cache.shape[1]
        batch, queries = meta.q_pos.shape
        padded = q if meta.q_index is None else q.index_select(0, meta.q_index)
        padded = padded.float().contiguous()
        out = torch.empty(batch * queries, q_heads, head_dim, dtype=torch.float32)
        code = self._library.lightllm_slot_attention(
            ctypes.c_void_p(padded.data_ptr()), ctypes.c_void_p(k_cache.data_ptr()), ctypes.c_void_p(v_cache.data_ptr()),
            ctypes.c_void_p(meta.slots.data_ptr()), 0, ctypes.c_void_p(meta.q_pos.data_ptr()),
            batch, queries, meta.slots.shape[1], kv_heads, q_heads // kv_heads, head_dim,
            _KV_DTYPE_CODES[k_cache.dtype], head_dim ** -0.5, torch.get_num_threads(), ctypes.c_void_p(out.data_ptr()),
        )
        if code != 0:
            raise RuntimeError(f"attention backend cpp: the kernel refused its arguments (code {code})")
        if meta.out_index is not None:
            out = out.index_select(0, meta.out_index)
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def _prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: _PrefillKernelMeta
    ) -> torch.Tensor:
        tokens, q_heads, head_dim = q.shape
        kv_heads = k_cache.shape[1]
        q32 = q.float().contiguous()
        out = torch.empty(tokens, q_heads, head_dim, dtype=torch.float32)
        code = self._library.lightllm_prefill_attention(
            ctypes.c_void_p(q32.data_ptr()), ctypes.c_void_p(k_cache.data_ptr()), ctypes.c_void_p(v_cache.data_ptr()),
            ctypes.c_void_p(meta.slots.data_ptr()), 0, meta.slots.shape[1],
            ctypes.c_void_p(meta.token_starts.data_ptr()), ctypes.c_void_p(meta.new_lens.data_ptr()),
            ctypes.c_void_p(meta.cached_lens.data_ptr()), meta.new_lens.shape[0], kv_heads, q_heads // kv_heads,
            head_dim, _KV_DTYPE_CODES[k_cache.dtype], head_dim ** -0.5, torch.get_num_threads(),
            ctypes.c_void_p(out.data_ptr()),
        )
        if code != 0:
            raise RuntimeError(f"attention backend cpp: the prefill kernel refused its arguments (code {code})")
        return out if q.dtype == torch.float32 else out.to(q.dtype)
