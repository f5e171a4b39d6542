"""One forward as large as the step budget, run while the rank starts, before it serves.

Why: the first large forward a process runs grows its heap to the activations' peak, page by page
(on the medium demo model a 1024-token prefill faulted ~22 thousand pages in, ~46 thousand over
the first burst of eight 1024-token prompts), and the first burst after start-up ran up to a tenth
slower than the same burst later (docs/EN/memory.md, "glibc malloc settings"). Running
the largest forward the planner can build once at start-up moves that cost out of the first
requests' latency, as vLLM's start-up profiling run does; it also makes a budget that does not fit
in memory fail at start-up instead of at the first long prompt. The KV slots and request rows it
borrows are given back before the rank serves.
"""

from __future__ import annotations

import time
from typing import List, Optional

import torch

from lightllm.common.basemodel.forward_batch import ForwardBatch
from lightllm.common.basemodel.transformer_model import DecoderOnlyTransformer
from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.common.req_manager import ReqManager
from lightllm.server.model_rank.execution.forward_cost import attended_positions
from lightllm.server.model_rank.execution.forward_threads import ForwardThreads


def startup_forward_lengths(batch_max_tokens: int, chunk_tokens: Optional[int], max_sequence_tokens: int,
                            max_rows: int, free_slots: int) -> List[int]:
    """The prompt lengths of the largest prefill forward the planner can build: ``batch_max_tokens``
    new tokens in all, each request's chunk at most ``chunk_tokens`` (None: no chunking) and at most
    ``max_sequence_tokens``, over at most ``max_rows`` requests and ``free_slots`` KV slots."""
    per_request = min(chunk_tokens or max_sequence_tokens, max_sequence_tokens)
    total = min(batch_max_tokens, free_slots, per_request * max_rows)
    if total <= 0 or per_request <= 0:
        return []
    full, rest = divmod(total, per_request)
    return [per_request] * full + ([rest] if rest else [])


def run_startup_forward(model: DecoderOnlyTransformer, kv_cache: KVCacheMemoryManager, req_manager: ReqManager, lengths: List[int],
                        threads: Optional[ForwardThreads] = None) -> float:
    """Prefill ``lengths`` throwaway prompts in one forward (every TP rank calls it alike, as the
    forward's collectives need); returns its seconds. Slots and rows are freed even if it fails."""
    if not lengths:
        return 0.0
    rows: List[int] = []
    slots: List[torch.Tensor] = []
    try:
        for length in lengths:
            rows.append(req_manager.alloc_row())
            slots.append(kv_cache.alloc(length))
            req_manager.set_slots(rows[-1], 0, slots[-1])
        vocab = model.config.vocab_size
        token_ids = [[(row * 7919 + position) % vocab for position in range(length)] for row, length in zip(rows, lengths)]
        batch = ForwardBatch.build(token_ids, [0] * len(lengths), rows, torch.cat(slots), device=kv_cache.device)
        attended = sum(attended_positions(0, length) for length in lengths)
        started = time.perf_counter()
        if threads is None:
            model.forward(batch, kv_cache, req_manager.req_to_token)
        else:
            with threads.prefill_forward(sum(lengths), attended, len(lengths)):
                model.forward(batch, kv_cache, req_manager.req_to_token)
        return time.perf_counter() - started
    finally:
        for tensor in slots:
            kv_cache.free(tensor)
        for row in rows:
            req_manager.free_row(row)
