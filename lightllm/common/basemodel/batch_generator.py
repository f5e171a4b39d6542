"""Offline batched generation on the token-slot KV cache.

The server's model backend drives the same pieces (request rows, slot allocation, ragged
forwards) under its scheduler; this class drives them directly for library use, tests and the
runtime benchmark.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Collection, List, Optional, Sequence

import torch

from lightllm.common.basemodel import generator_inputs
from lightllm.common.basemodel.forward_batch import ForwardBatch
from lightllm.common.kv_cache_mem_manager.token_allocator import KVCacheExhaustedError
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
    """Prefill (whole or chunked) and greedy decode of a batch on one model.

    Arguments are checked before a request row or KV slot is reserved, and a call that fails
    gives back what it took, so the generator stays usable after an error.  Not thread-safe:
    give each thread its own generator (generators may share one model).
    """

    def __init__(self, model: DecoderOnlyTransformer, kv_cache_size: int, max_request_num: int = 64,
                 max_sequence_length: Optional[int] = None):
        """``max_sequence_length`` (prompt + output) defaults to the model's context limit: its
        position range, or its sliding window when that is shorter.  As the server's
        ``--max_req_total_len``, it may pass the position range with a warning (positions the model
        was not trained for are computed all the same) but not a sliding window (ValueError): full
        attention computes a windowed model exactly only within the window."""
        kv_cache_size = generator_inputs.count("kv_cache_size", kv_cache_size)
        max_request_num = generator_inputs.count("max_request_num", max_request_num)
        if max_sequence_length is None:
            max_len = model.config.context_limit
        else:
            max_len = generator_inputs.count("max_sequence_length", max_sequence_length)
            window = model.config.sliding_window
            if window is not None and max_len > window:
                raise ValueError(f"max_sequence_length {max_len} exceeds the model's sliding window of {window} "
                                 "tokens: full attention matches the model only within the window")
            context = model.config.rope_context
            if max_len > context:
                warnings.warn(f"max_sequence_length {max_len} exceeds the model's context of {context} tokens: "
                              f"output past position {context} is outside what the model was trained or scaled for",
                              stacklevel=2)
        self.model = model
        self.kv_cache = model.new_kv_cache(kv_cache_size)
        self.req_manager = ReqManager(max_request_num, max_len, device=model.device)

    @property
    def max_sequence_length(self) -> int:
        """The longest sequence (prompt + output) this generator computes."""
        return self.req_manager.max_sequence_length

    def start(self, token_ids: Sequence[int]) -> CachedSequence:
        """Register a sequence (takes a request row; nothing is computed yet)."""
        ids = generator_inputs.token_list("token_ids", token_ids, self.model.vocab_size, self.max_sequence_length)
        return CachedSequence(self.req_manager.alloc_row(), ids)

    def forward(self, seqs: Sequence[CachedSequence], new_lens: Sequence[int], all_logits: bool = False) -> torch.Tensor:
        """Compute the next ``new_lens[i]`` uncached tokens of each sequence; returns logits."""
        new_lens = self._checked_new_lens(seqs, new_lens)
        chunks = [s.token_ids[s.cached_len : s.cached_len + n] for s, n in zip(seqs, new_lens)]
        # Callers append to token_ids directly (decode loops, benchmarks): the ids are checked
        # here, as start() checks a prompt's, before a slot is taken.
        generator_inputs.check_new_tokens(chunks, self.model.vocab_size)
        slots = self.kv_cache.alloc(sum(new_lens))
        added = 0
        try:
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
                added += 1
                offset += len(chunk)
            batch = ForwardBatch.build(
                chunks, [s.cached_len for s in seqs], [s.row for s in seqs], slots, self.model.device, all_logits,
                rope_lengths=[len(s.token_ids) for s in seqs],
            )
            logits = self.model.forward(batch, self.kv_cache, self.req_manager.req_to_token)
        except BaseException:
            # Nothing was computed: the sequences stay as they were and the slots go back, so a
            # failed forward (out of memory, an interrupt) can be retried or released cleanly.
            for seq in seqs[:added]:
                seq.slots.pop()
            self.kv_cache.free(slots)
            raise
        for seq, chunk in zip(seqs, chunks):
            seq.cached_len += len(chunk)
        return logits

    def _checked_new_lens(self, seqs: Sequence[CachedSequence], new_lens: Sequence[int]) -> List[int]:
        """``new_lens`` as ints, each within its sequence's uncached tokens and the length bound."""
        if len(seqs) != len(new_lens):
            raise ValueError(f"{len(seqs)} sequences but {len(new_lens)} new_lens")
        if not seqs:
            raise ValueError("forward needs at least one sequence")
        if len({id(seq) for seq in seqs}) != len(seqs):
            raise ValueError("a sequence appears twice in one forward")
        checked = []
        for index, (seq, new_len) in enumerate(zip(seqs, new_lens)):
            new_len = generator_inputs.count(f"new_lens[{index}]", new_len)
            uncached = len(seq.token_ids) - seq.cached_len
            if new_len > uncached:
                raise ValueError(f"new_lens[{index}] is {new_len}, but sequence {index} has {uncached} uncached tokens")
            if seq.cached_len + new_len > self.max_sequence_length:
                raise ValueError(f"sequence {index} would reach {seq.cached_len + new_len} tokens, more than "
                                 f"max_sequence_length {self.max_sequence_length}")
            checked.append(new_len)
        return checked

    def release(self, seq: CachedSequence) -> None:
        """Free the sequence's slots and row."""
        if seq.slots:
            self.kv_cache.free(torch.cat(seq.slots))
        seq.slots.clear()
        self.req_manager.free_row(seq.row)

    def greedy_generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                        stop_token_ids: Optional[Collection[int]] = None) -> List[List[int]]:
        """Greedy continuation of every prompt: one batched prefill, then batched decode steps.

        Each prompt gets ``max_new_tokens`` tokens; the model's EOS does not end it (as vLLM's
        ``ignore_eos``) unless ``stop_token_ids`` is given (``model.config.eos_token_ids``, say):
        then a continuation ends with the first of them it produces, kept as its last token.
        Every prompt and its ``max_new_tokens`` must fit in ``max_sequence_length``, and there
        must be a free request row for each and KV slots for all of them at their longest
        (``KVCacheExhaustedError`` before any forward otherwise).
        """
        max_new_tokens = generator_inputs.count("max_new_tokens", max_new_tokens)
        checked = generator_inputs.prompt_lists(prompts, self.model.vocab_size, self.max_sequence_length,
                                                max_new_tokens)
        stops = generator_inputs.stop_set(stop_token_ids, self.model.vocab_size)
        if len(checked) > self.req_manager.available:
            raise ValueError(f"{len(checked)} prompts but {self.req_manager.available} free request rows "
                             f"(max_request_num {self.req_manager.max_request_num})")
        # The last token is sampled, never computed: each prompt holds at most len + max_new_tokens - 1 slots.
        needed = sum(len(prompt) + max_new_tokens - 1 for prompt in checked)
        if needed > self.kv_cache.available:
            raise KVCacheExhaustedError(f"these prompts and max_new_tokens {max_new_tokens} need up to {needed} KV "
                                        f"slots, but {self.kv_cache.available} of {self.kv_cache.size} are free "
                                        "(kv_cache_size)")
        if not checked:
            return []
        seqs: List[CachedSequence] = []
        try:
            for prompt in checked:
                seqs.append(self.start(prompt))
            outputs: List[List[int]] = [[] for _ in checked]
            active = list(range(len(seqs)))
            logits = self.forward(seqs, [len(p) for p in checked])
            for step in range(max_new_tokens):
                next_ids = logits.argmax(dim=-1).tolist()
                for index, tok in zip(active, next_ids):
                    outputs[index].append(tok)
                    seqs[index].token_ids.append(tok)
                active = [index for index, tok in zip(active, next_ids) if tok not in stops]
                if not active or step + 1 == max_new_tokens:
                    break
                logits = self.forward([seqs[index] for index in active], [1] * len(active))
            return outputs
        finally:
            for seq in seqs:
                self.release(seq)
