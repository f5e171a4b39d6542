"""Offline batched generation on the token-slot KV cache.

The server's model backend drives the same pieces (request rows, slot allocation, ragged
forwards) under its scheduler; this class drives them directly for library use, tests and the
runtime benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

from lightllm.common.basemodel.forward_batch import ForwardBatch
from lightllm.common.basemodel.transformer_model import DecoderOnlyTransformer
from lightllm.common.req_manager import ReqManager


@dataclass
class CachedSequence:
    """A sequence whose K/V live in the cache: its row, its tokens, and how many are cached."""

    row: int
    token_ids: List[int]
    cached_len: int = 0
    slots: List[torch.Tensor] = field(default_factory=list)


class BatchGenerator:
    """Prefill (whole or chunked) and greedy decode of a batch on one model."""

    def __init__(self, model: DecoderOnlyTransformer, kv_cache_size: int, max_request_num: int = 64, max_sequence_length: Optional[int] = None):
        self.model = model
        self.kv_cache = model.new_kv_cache(kv_cache_size)
        max_len = max_sequence_length or model.config.context_limit
        self.req_manager = ReqManager(max_request_num, max_len, device=model.device)

    def start(self, token_ids: Sequence[int]) -> CachedSequence:
        """Register a sequence (takes a request row; nothing is computed yet)."""
        return CachedSequence(self.req_manager.alloc_row(), list(token_ids))

    def forward(self, seqs: Sequence[CachedSequence], new_lens: Sequence[int], all_logits: bool = False) -> torch.Tensor:
        """Compute the next ``new_lens[i]`` uncached tokens of each sequence; returns logits."""
        chunks = [s.token_ids[s.cached_len : s.cached_len + n] for s, n in zip(seqs, new_lens)]
        slots = self.kv_cache.alloc(sum(len(c) for c in chunks))
        decode_step = all(len(c) == 1 for c in chunks)
        if decode_step:
            # One indexed write instead of one slice write per sequence.
            self.req_manager.set_next_slots([s.row for s in seqs], [s.cached_len for s in seqs], slots)
        offset = 0
        for seq, chunk in zip(seqs, chunks):
            part = slots[offset : offset + len(chunk)]
            if not decode_step:
                self.req_manager.set_slots(seq.row, seq.cached_len, part)
            seq.slots.append(part)
            offset += len(chunk)
        batch = ForwardBatch.build(
            chunks, [s.cached_len for s in seqs], [s.row for s in seqs], slots, self.model.device, all_logits,
            rope_lengths=[len(s.token_ids) for s in seqs],
        )
        logits = self.model.forward(batch, self.kv_cache, self.req_manager.req_to_token)
        for seq, chunk in zip(seqs, chunks):
            seq.cached_len += len(chunk)
        return logits

    def release(self, seq: CachedSequence) -> None:
        """Free the sequence's slots and row."""
        if seq.slots:
            self.kv_cache.free(torch.cat(seq.slots))
        seq.slots.clear()
        self.req_manager.free_row(seq.row)

    def greedy_generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> List[List[int]]:
        """Greedy continuation of every prompt: one batched prefill, then batched decode steps."""
        seqs = [self.start(p) for p in prompts]
        try:
            logits = self.forward(seqs, [len(p) for p in prompts])
            outputs: List[List[int]] = [[] for _ in prompts]
            for step in range(max_new_tokens):
                next_ids = logits.argmax(dim=-1).tolist()
                for seq, out, tok in zip(seqs, outputs, next_ids):
                    out.append(tok)
                    seq.token_ids.append(tok)
                if step + 1 < max_new_tokens:
                    logits = self.forward(seqs, [1] * len(seqs))
            return outputs
        finally:
            for seq in seqs:
                self.release(seq)
