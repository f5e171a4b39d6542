"""LightLLM's exponential_decay_length_penalty against transformers' ExponentialDecayLengthPenalty."""

from __future__ import annotations

import pytest
import torch
from sampling_test_support import build
from transformers.generation.logits_process import ExponentialDecayLengthPenalty

from lightllm.common.sampling import SamplingParamError, SamplingParams
from lightllm.common.sampling.logit_processors import apply_exponential_decay
from lightllm.common.sampling.sampler import Sampler

VOCAB = 11
EOS = [2, 7]


def _reference(logits: torch.Tensor, prompt_len: int, generated: int, start: int, factor: float) -> torch.Tensor:
    processor = ExponentialDecayLengthPenalty((start, factor), EOS, prompt_len)
    input_ids = torch.zeros(1, prompt_len + generated, dtype=torch.long)
    return processor(input_ids, logits[None].clone())[0]


@pytest.mark.parametrize("generated", [0, 3, 4, 5, 9, 30])
def test_decay_matches_transformers(generated):
    torch.manual_seed(generated)
    logits = torch.randn(3, VOCAB) * 4
    logits[1, 2] = -abs(logits[1, 2])  # a negative EOS logit is raised too
    logits[2, 7] = 0.0
    prompts = [[5, 6, 1], [5], [4, 4, 4, 4]]
    params = [
        SamplingParams(exponential_decay_start=4, exponential_decay_factor=1.5),
        SamplingParams(exponential_decay_start=0, exponential_decay_factor=1.05),
        SamplingParams(),  # no decay: untouched
    ]
    outputs = [[1] * generated for _ in params]
    got = apply_exponential_decay(logits, build(params, prompts, outputs, eos=EOS, vocab=VOCAB))
    for row, (prompt, param) in enumerate(zip(prompts, params)):
        if param.exponential_decay_start is None:
            assert torch.equal(got[row], logits[row])
            continue
        expected = _reference(logits[row], len(prompt), generated, param.exponential_decay_start,
                              param.exponential_decay_factor)
        assert torch.allclose(got[row], expected, rtol=1e-6, atol=1e-6)
        changed = generated > param.exponential_decay_start
        assert (got[row, EOS] > logits[row, EOS]).all().item() == changed
        assert torch.equal(got[row, [0, 1, 3]], logits[row, [0, 1, 3]])  # other tokens untouched


def test_decay_lets_greedy_end_and_shows_in_logprobs():
    logits = torch.tensor([[4.0, 0.0, 1.0, 0.0]])
    param = SamplingParams(temperature=0, exponential_decay_start=1, exponential_decay_factor=2.0, logprobs=2)
    sampler = Sampler()
    before = sampler.sample(logits, build([param], [[0]], [[3]], eos=[2], vocab=4))
    assert before.next_token_ids.tolist() == [0]  # 1 generated, start 1: no decay yet
    # 3 generated: EOS 1.0 -> 1.0 + 1.0 * (2**2 - 1) = 4.0 ties; 4 generated: 8.0 wins.
    after = sampler.sample(logits, build([param], [[0]], [[3, 3, 3, 3]], eos=[2], vocab=4))
    assert after.next_token_ids.tolist() == [2]
    expected = torch.log_softmax(torch.tensor([4.0, 0.0, 8.0, 0.0]), dim=-1)
    assert after.logprobs[0].item() == pytest.approx(expected[2].item(), abs=1e-6)


def test_huge_decay_stays_finite_and_masked_eos_stays_masked():
    logits = torch.tensor([[1.0, 0.0, 0.0, -float("inf")]])
    param = SamplingParams(exponential_decay_start=0, exponential_decay_factor=10.0)
    got = apply_exponential_decay(logits, build([param], [[0]], [[1] * 500], eos=[2, 3], vocab=4))
    assert got[0, 2].item() == 0.0  # |0| * huge: no NaN
    assert got[0, 3].item() == -float("inf")
    logits[0, 2] = -1.0
    got = apply_exponential_decay(logits, build([param], [[0]], [[1] * 500], eos=[2], vocab=4))
    assert torch.isfinite(got[0, :3]).all() and got[0, 2].item() == torch.finfo(torch.float32).max


def test_min_new_tokens_still_masks_a_decayed_eos():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    param = SamplingParams(temperature=0, min_new_tokens=5, exponential_decay_start=0, exponential_decay_factor=10.0)
    out = Sampler().sample(logits, build([param], [[0]], [[1, 1]], eos=[2], vocab=3))
    assert out.next_token_ids.tolist() == [1]


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"exponential_decay_start": -1}, "exponential_decay_start"),
        ({"exponential_decay_start": 1.5}, "exponential_decay_start"),
        ({"exponential_decay_factor": 0.9}, "exponential_decay_factor"),
        ({"exponential_decay_factor": 10.5}, "exponential_decay_factor"),
        ({"print_eos_token": 1}, "print_eos_token"),
    ],
)
def test_invalid_decay_and_print_eos_are_refused(fields, name):
    with pytest.raises(SamplingParamError, match=name):
        SamplingParams(**fields)
