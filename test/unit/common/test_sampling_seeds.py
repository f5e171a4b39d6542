"""Seeds: a seeded request reproduces its tokens alone or batched; unseeded rows follow the sampler seed."""

from __future__ import annotations

import torch
from sampling_test_support import build

from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.common.sampling.sampling_batch import SamplingBatch, derive_step_seed


def _generate(sampler: Sampler, logits_for_step, params, prompts, steps: int) -> list[list[int]]:
    outputs: list[list[int]] = [[] for _ in params]
    for step in range(steps):
        batch = SamplingBatch.build(params, prompts, outputs, [0], logits_for_step(step).shape[1])
        token_ids = sampler.sample(logits_for_step(step), batch).next_token_ids.tolist()
        for row, token in enumerate(token_ids):
            outputs[row].append(token)
    return outputs


def test_seeded_request_reproduces_alone_or_batched():
    vocab, steps = 64, 12
    torch.manual_seed(7)
    row_logits = [torch.randn(vocab) for _ in range(steps)]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42, repetition_penalty=1.1)

    alone = _generate(Sampler(0), lambda s: row_logits[s][None], [seeded], [[1, 2, 3]], steps)[0]

    others = [SamplingParams(temperature=0.9), SamplingParams(temperature=0, presence_penalty=1.0),
              SamplingParams(seed=7, top_k=5)]
    prompts = [[5] * 30, [4, 4], [1, 2, 3], [9]]
    noise = torch.randn(steps, 3, vocab)

    def mixed_logits(step: int) -> torch.Tensor:
        return torch.cat([noise[step, :2], row_logits[step][None], noise[step, 2:]])

    batched = _generate(Sampler(12345), mixed_logits, others[:2] + [seeded] + others[2:], prompts, steps)
    assert batched[2] == alone

    different_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=43, repetition_penalty=1.1)
    other = _generate(Sampler(0), lambda s: row_logits[s][None], [different_seed], [[1, 2, 3]], steps)[0]
    assert other != alone


def test_seeded_request_draws_fresh_noise_each_step():
    # Identical logits every step: a request that reused one step's noise would repeat a token.
    vocab, steps = 1000, 8
    uniform = torch.zeros(1, vocab)
    tokens = _generate(Sampler(0), lambda s: uniform, [SamplingParams(seed=3)], [[1]], steps)[0]
    assert len(set(tokens)) > 1


def test_unseeded_rows_follow_the_sampler_seed():
    torch.manual_seed(8)
    logits = torch.randn(32, 100)
    batch = build([SamplingParams(temperature=1.0)] * 32, vocab=100)
    first = Sampler(5).sample(logits, batch).next_token_ids
    assert torch.equal(first, Sampler(5).sample(logits, batch).next_token_ids)
    assert not torch.equal(first, Sampler(6).sample(logits, batch).next_token_ids)


def test_step_seed_differs_by_seed_and_step():
    values = {derive_step_seed(seed, step) for seed in range(20) for step in range(20)}
    assert len(values) == 400
    assert all(0 <= value < 2**64 for value in values)
