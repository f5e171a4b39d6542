"""Chosen-token log-probabilities and the top alternatives each row asked for."""

from __future__ import annotations

import math

import torch
from sampling_test_support import build

from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.logit_processors import apply_penalties
from lightllm.common.sampling.sampler import Sampler


def test_logprobs_are_valid_and_consistent():
    torch.manual_seed(11)
    vocab = 8
    logits = torch.randn(4, vocab) * 2
    params = [SamplingParams(temperature=0.5, logprobs=vocab), SamplingParams(temperature=0, logprobs=2),
              SamplingParams(top_k=3, frequency_penalty=0.7), SamplingParams(temperature=2.0, top_p=0.5, logprobs=1)]
    outputs = [[], [], [1, 1, 2], []]
    batch = build(params, outputs=outputs, vocab=vocab)
    out = Sampler(3).sample(logits, batch)

    assert out.logprobs.shape == (4,) and out.logprobs.dtype == torch.float32
    assert (out.logprobs <= 0).all()
    temps = torch.tensor([0.5, 1.0, 1.0, 2.0])[:, None]
    reference = torch.log_softmax(apply_penalties(logits, batch) / temps, dim=-1)
    assert torch.allclose(out.logprobs, reference.gather(1, out.next_token_ids[:, None]).squeeze(1), atol=1e-6)

    assert out.top_logprobs.shape == (4, vocab) and out.top_logprob_ids.shape == (4, vocab)
    assert torch.allclose(out.top_logprobs.exp().sum(dim=-1), torch.ones(4), atol=1e-5)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert len(out.row_top_logprobs(0)) == vocab
    assert [token for token, _ in out.row_top_logprobs(1)] == reference[1].topk(2).indices.tolist()
    assert out.row_top_logprobs(2) == []
    assert len(out.row_top_logprobs(3)) == 1


def test_no_top_logprobs_when_none_requested():
    out = Sampler(0).sample(torch.randn(2, 5), build([SamplingParams()] * 2, vocab=5))
    assert out.top_logprobs is None and out.top_logprob_ids is None
    assert math.isfinite(out.logprobs.sum().item())


def test_all_greedy_batch_with_overflowed_and_masked_logits():
    # The all-greedy path clamps only +inf (no temperature division can overflow a finite logit):
    # an overflowed logit is picked with a finite logprob, a masked (-inf) one keeps -inf, and the
    # result equals the general path's clamp-and-restore.
    inf = float("inf")
    logits = torch.tensor([[0.5, inf, 1.0, -inf], [2.0, -inf, 1.0, 0.0]])
    params = [SamplingParams(temperature=0, logprobs=4)] * 2
    out = Sampler(0).sample(logits, build(params, vocab=4))
    assert out.next_token_ids.tolist() == [1, 0]
    assert torch.isfinite(out.logprobs).all() and out.logprobs[0].item() == 0.0
    bounded = logits.clamp(min=-torch.finfo(torch.float32).max, max=torch.finfo(torch.float32).max)
    reference = torch.log_softmax(bounded.masked_fill(torch.isneginf(logits), -inf), dim=-1)
    assert torch.equal(out.top_logprobs, reference.sort(dim=-1, descending=True).values)
    assert out.row_top_logprobs(1)[-1] == (1, -inf)
