"""A mixed attention workload over one token-slot cache, for comparing attention backends.

A ragged batch with fresh prompts, a long shared prefix used by several requests at token level
(their rows point at the same slots, as a radix-cache hit does), short and long chunked
continuations, decode steps with ragged contexts, and a request that is paused (its own slots
freed) and resumed by recomputing its tail.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from lightllm.common.basemodel.attention.torch_compiled import FUSED_MAX_QUERIES
from lightllm.common.basemodel.batch_generator import BatchGenerator, CachedSequence


def random_tokens(vocab: int, n: int, seed: int) -> List[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


class Recorder:
    """Runs forwards and keeps ``(request row, position, logits)`` for every returned row."""

    def __init__(self, gen: BatchGenerator):
        self.gen = gen
        self.rows: List[Tuple[int, int, torch.Tensor]] = []

    def forward(self, seqs: List[CachedSequence], new_lens: List[int], all_logits: bool = True) -> None:
        starts = [s.cached_len for s in seqs]
        logits = self.gen.forward(seqs, new_lens, all_logits=all_logits)
        row = 0
        for seq, start, new in zip(seqs, starts, new_lens):
            positions = range(start, start + new) if all_logits else [start + new - 1]
            for pos in positions:
                self.rows.append((seq.row, pos, logits[row]))
                row += 1


def run_scenario(model) -> Tuple[List[Tuple[int, int, torch.Tensor]], Dict[int, List[int]]]:
    """Logits rows ``(request row, position, logits)`` of a mixed workload and each row's final tokens."""
    vocab = model.config.vocab_size
    gen = BatchGenerator(model, kv_cache_size=4096, max_request_num=16)
    rec = Recorder(gen)
    base = random_tokens(vocab, 150, seed=1)
    owner = gen.start(base)
    rec.forward([owner], [150])

    def share_prefix(tail: List[int], shared: int) -> CachedSequence:
        # Token-level sharing, as on a radix-cache hit: the row points at the owner's slots.
        seq = gen.start(base[:shared] + tail)
        gen.req_manager.set_slots(seq.row, 0, gen.req_manager.slots(owner.row, 0, shared))
        seq.cached_len = shared
        return seq

    short_tail = share_prefix(random_tokens(vocab, 5, seed=2), 120)  # kernel path
    long_tail = share_prefix(random_tokens(vocab, 40, seed=3), 97)  # SDPA path
    fresh = gen.start(random_tokens(vocab, 9, seed=4))
    single = gen.start(random_tokens(vocab, 1, seed=5))  # a context of length 1
    rec.forward([short_tail, fresh, single], [5, 9, 1])
    rec.forward([long_tail], [40])
    chunked = gen.start(random_tokens(vocab, 100, seed=6))
    rec.forward([chunked], [70])
    rec.forward([chunked], [FUSED_MAX_QUERIES])
    rec.forward([chunked], [100 - 70 - FUSED_MAX_QUERIES])
    seqs = [owner, short_tail, long_tail, fresh, single, chunked]
    for step in range(4):
        for i, seq in enumerate(seqs):
            seq.token_ids.append(3 + (11 * i + 5 * step) % (vocab - 3))
        rec.forward(seqs, [1] * len(seqs), all_logits=False)
    # Pause ``long_tail`` (its own slots go back; the shared prefix stays), then resume by
    # recomputing its tail and decoded tokens: a long chunk (SDPA), then a short one (kernel)
    # batched with a one-request decode, then a batched decode step.
    gen.kv_cache.free(torch.cat(long_tail.slots))
    long_tail.slots, long_tail.cached_len = [], 97
    remaining = len(long_tail.token_ids) - 97
    rec.forward([long_tail], [remaining - 3])
    fresh.token_ids.append(7)
    rec.forward([long_tail, fresh], [3, 1])
    for seq in seqs:
        seq.token_ids.append(8)
    rec.forward(seqs, [1] * len(seqs), all_logits=False)
    tokens = {s.row: list(s.token_ids) for s in seqs}
    for seq in seqs:
        gen.release(seq)
    assert gen.kv_cache.available == 4096
    return rec.rows, tokens


def assert_matches_reference(model_dir: str, dtype: torch.dtype, backend: Any) -> None:
    """Run the scenario through ``backend`` and through gather + SDPA; the logits must agree.

    fp32 differs by summation order only; bf16 rounds K/V and outputs between layers on both
    sides, so its tolerance is relative to the logit scale.
    """
    from lightllm.common.basemodel.attention.torch_sdpa import TorchSdpaAttention
    from lightllm.models.registry import load_model

    expected, expected_tokens = run_scenario(load_model(model_dir, dtype=dtype, attention=TorchSdpaAttention()))
    got, got_tokens = run_scenario(load_model(model_dir, dtype=dtype, attention=backend))
    assert got_tokens == expected_tokens and len(got) == len(expected) > 300
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    worst = max((g[2] - e[2]).abs().max().item() for g, e in zip(got, expected))
    scale = max(e[2].abs().max().item() for e in expected)
    assert worst < tolerance * max(scale, 1.0), f"largest logit difference {worst} (logit scale {scale})"


def assert_matches_transformers(model_dir: str, backend: Any) -> None:
    """Every logits row of the scenario through ``backend`` (fp32) equals transformers' within 1e-4."""
    from transformers import AutoModelForCausalLM

    from lightllm.models.registry import load_model

    rows, final_tokens = run_scenario(load_model(model_dir, dtype=torch.float32, attention=backend))
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = {row: ref(torch.tensor([t])).logits[0] for row, t in final_tokens.items()}
    worst = max((row - expected[seq][pos]).abs().max().item() for seq, pos, row in rows)
    assert worst < 1e-4, f"largest logit difference from transformers {worst}"


def two_cached_requests(model: Any) -> Tuple[BatchGenerator, List[CachedSequence], torch.Tensor]:
    """A generator holding two prefilled requests (30 and 12 tokens) and its slot table."""
    gen = BatchGenerator(model, kv_cache_size=256, max_request_num=4)
    seqs = [gen.start(random_tokens(model.config.vocab_size, n, seed=n)) for n in (30, 12)]
    gen.forward(seqs, [30, 12])
    return gen, seqs, gen.req_manager.req_to_token
