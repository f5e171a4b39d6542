"""Repetition, frequency and presence penalties (with and without input_penalty)."""

from __future__ import annotations

import pytest
import torch
from sampling_test_support import build

from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.logit_processors import apply_penalties
from lightllm.common.sampling.sampler import Sampler


def test_penalties_follow_the_formulas_exactly():
    vocab = 6
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]] * 3)
    prompts = [[0, 1], [0, 1], [0, 1]]
    outputs = [[2, 2, 3], [2, 2, 3], [2, 2, 3]]
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(repetition_penalty=1.5, frequency_penalty=-1.0, presence_penalty=1.0),
    ]
    got = apply_penalties(logits, build(params, prompts, outputs, vocab=vocab))

    expected = logits.clone().tolist()
    for row, param in enumerate(params):
        seen = set(prompts[row]) | set(outputs[row])
        for token in range(vocab):
            value = expected[row][token]
            if token in seen:
                rp = param.repetition_penalty
                value = value / rp if value > 0 else value * rp
            count = outputs[row].count(token)
            value -= param.frequency_penalty * count + param.presence_penalty * (1 if count else 0)
            expected[row][token] = value
    assert torch.allclose(got, torch.tensor(expected), atol=1e-6, rtol=0)
    # Spot-check by hand: row 2, token 2 is seen (0.5 / 1.5), count 2 -> + 2.0 - 1.0.
    assert got[2, 2].item() == pytest.approx(0.5 / 1.5 + 2.0 - 1.0)
    assert got[0, 1].item() == pytest.approx(-2.0)  # negative logit multiplied
    assert torch.equal(got[:, 5], logits[:, 5])  # unseen token untouched
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0, 0.0]))  # input intact


def test_presence_penalty_ignores_prompt_tokens():
    logits = torch.zeros(1, 4)
    got = apply_penalties(logits, build([SamplingParams(presence_penalty=1.0)], [[0, 1]], [[2]], vocab=4))
    assert got.tolist() == [[0.0, 0.0, -1.0, 0.0]]


def test_greedy_uses_penalised_logits():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    batch = build([SamplingParams(temperature=0, repetition_penalty=2.0)], [[0]], [[]], vocab=3)
    assert Sampler().sample(logits, batch).next_token_ids.tolist() == [1]


def test_input_penalty_counts_prompt_tokens_in_presence_and_frequency():
    logits = torch.zeros(2, 6)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, input_penalty=True),
              SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)]
    batch = build(params, prompts=[[1, 1, 2], [1, 1, 2]], outputs=[[2], [2]], vocab=6)
    out = apply_penalties(logits, batch)
    # Row 0 counts the prompt: token 1 twice, token 2 twice (prompt + output).
    assert out[0].tolist() == [0.0, -1.0, -1.0, 0.0, 0.0, 0.0]
    assert out[1].tolist() == [0.0, 0.0, -0.75, 0.0, 0.0, 0.0]


def test_a_masked_token_stays_masked_under_a_repetition_penalty():
    """A structured-output mask (-inf) reached the logprobs as the lowest float32 (-3.4e38, where
    the OpenAI layer shows -inf as -9999.0) whenever a repetition penalty applied."""
    logits = torch.tensor([[2.0, float("-inf"), 0.5, float("-inf")]] * 2)
    params = [SamplingParams(repetition_penalty=1.05, logprobs=4),
              SamplingParams(repetition_penalty=1.05, temperature=0.7, logprobs=4)]
    batch = build(params, [[0, 1], [0, 1]], [[2], [2]], vocab=4)
    penalised = apply_penalties(logits, batch)
    assert torch.isneginf(penalised[:, [1, 3]]).all()
    out = Sampler(3).sample(logits, batch)
    # The two masked tokens are the last two of every row's four alternatives.
    assert torch.isneginf(out.top_logprobs[:, 2:]).all() and torch.isfinite(out.top_logprobs[:, :2]).all()
