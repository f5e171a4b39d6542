"""Attention through the Triton kernels, reading K/V in place from the token-slot cache (CUDA)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import torch

from lightllm.common.basemodel.attention.base import AttentionBackend
from lightllm.common.basemodel.forward_batch import ForwardBatch
from lightllm.common.basemodel.triton_kernel.context_attention import context_attention
from lightllm.common.basemodel.triton_kernel.decode_attention import decode_attention


@dataclass
class _TritonMeta:
    """Per-forward index tensors shared by every layer (built once, on the model's device)."""

    is_decode: bool
    req_to_token: torch.Tensor
    req_rows: torch.Tensor
    seq_lens: torch.Tensor  # decode: context length of each request
    start_lens: torch.Tensor  # prefill: cached tokens before this chunk
    new_lens: torch.Tensor  # prefill: tokens in this chunk
    q_starts: torch.Tensor  # prefill: first row of each request in the flattened batch
    max_new_len: int


class TritonAttention(AttentionBackend):
    """Decode and prefill attention with the kernels of ``triton_kernel/``.

    Unlike :class:`TorchSdpaAttention` nothing is gathered: the kernels follow ``req_to_token``
    to each key's slot.  The model also switches its RMSNorm (+ residual add) and rotary
    embedding to the Triton kernels when this backend is chosen (:meth:`layer_kernels`).
    """

    def layer_kernels(self) -> str:
        """RMSNorm (+ residual add) and rotary through the Triton kernels of ``triton_kernel/``."""
        return "triton"

    def prepare(self, batch: ForwardBatch, req_to_token: torch.Tensor) -> _TritonMeta:
        """The index tensors the kernels read, on the model's device, built once per forward."""
        device = batch.input_ids.device

        def ints(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        if batch.is_decode:
            empty = ints([])
            return _TritonMeta(True, req_to_token, batch.req_rows, ints(batch.seq_lens), empty, empty, empty, 1)
        new_lens = batch.new_lens
        q_starts = list(accumulate(new_lens[:-1], initial=0))  # a prefill batch is never empty
        return _TritonMeta(
            False, req_to_token, batch.req_rows, ints(batch.seq_lens), ints(batch.start_lens), ints(new_lens),
            ints(q_starts), max(new_lens),
        )

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: _TritonMeta) -> torch.Tensor:
        """The decode or the context attention kernel, reading K/V in place through ``req_to_token``."""
        if meta.is_decode:
            return decode_attention(q, k_cache, v_cache, meta.req_to_token, meta.req_rows, meta.seq_lens)
        return context_attention(
            q, k_cache, v_cache, meta.req_to_token, meta.req_rows, meta.start_lens, meta.new_lens, meta.q_starts,
            meta.max_new_len,
        )
