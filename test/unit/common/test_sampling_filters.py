"""Greedy, temperature, top-k / top-p / min-p and min_new_tokens: the kept sets and the sampled distributions."""

from __future__ import annotations

import pytest
import torch
from sampling_test_support import build

from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.logit_processors import apply_min_tokens_mask, apply_top_k_top_p
from lightllm.common.sampling.sampler import Sampler

# Draws per distribution test, and a skewed distribution whose filtered shares they check.
DRAWS = 20_000
SKEWED_PROBS = torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03])
SKEWED_LOGITS = SKEWED_PROBS.log().expand(DRAWS, 5)


# ---------------------------------------------------------------- greedy, top-k, top-p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(6, 50) * 3).to(dtype)
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(do_sample=False, temperature=0.9)] * 3
    out = Sampler(1).sample(logits, build(params, vocab=50))
    assert out.next_token_ids.dtype == torch.long
    assert torch.equal(out.next_token_ids, logits.float().argmax(dim=-1))


def test_mixed_batch_greedy_rows_still_take_argmax():
    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5), SamplingParams(temperature=0),
              SamplingParams(top_p=0.9)]
    out = Sampler(2).sample(logits, build(params, vocab=30))
    assert out.next_token_ids[0] == logits[0].argmax() and out.next_token_ids[2] == logits[2].argmax()


@pytest.mark.parametrize("extra", [{"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "top_p": 0.3}])
def test_top_k_one_and_tiny_top_p_equal_greedy(extra):
    torch.manual_seed(3)
    logits = torch.randn(16, 40) * 2
    params = [SamplingParams(temperature=1.3, seed=row, **extra) for row in range(8)]
    params += [SamplingParams(temperature=0.8, **extra) for _ in range(8)]
    sampler = Sampler(5)
    for _ in range(5):
        out = sampler.sample(logits, build(params, vocab=40))
        assert torch.equal(out.next_token_ids, logits.argmax(dim=-1))


def test_top_k_top_p_filter_keeps_expected_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]] * 4))
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.75), SamplingParams(top_p=0.85),
              SamplingParams(top_k=-1, top_p=1.0)]
    filtered = apply_top_k_top_p(logits, build(params, vocab=5))
    kept = torch.isfinite(filtered)
    assert kept.tolist() == [
        [True, True, False, False, False],
        [True, True, False, False, False],
        [True, True, True, False, False],
        [True] * 5,
    ]
    assert torch.equal(filtered[kept], logits[kept])


# ---------------------------------------------------------------- distributions


def _frequencies(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(token_ids, minlength=vocab).float() / token_ids.numel()


def test_temperature_sampling_matches_softmax():
    temperature = 0.7
    row = torch.tensor([1.0, 2.0, 0.0, 0.5, -1.0])
    batch = build([SamplingParams(temperature=temperature)] * DRAWS, vocab=5)
    out = Sampler(1234).sample(row.expand(DRAWS, 5), batch)
    expected = torch.softmax(row / temperature, dim=-1)
    assert (_frequencies(out.next_token_ids, 5) - expected).abs().max() < 0.03
    # The untempered distribution differs by more than the tolerance, so temperature matters.
    assert (torch.softmax(row, dim=-1) - expected).abs().max() > 0.05


def test_top_k_and_top_p_sampling_renormalise():
    sampler = Sampler(99)
    out = sampler.sample(SKEWED_LOGITS, build([SamplingParams(top_k=2)] * DRAWS, vocab=5))
    expected = torch.tensor([0.4, 0.3, 0.0, 0.0, 0.0]) / 0.7
    assert (_frequencies(out.next_token_ids, 5) - expected).abs().max() < 0.03
    out = sampler.sample(SKEWED_LOGITS, build([SamplingParams(top_p=0.85)] * DRAWS, vocab=5))
    expected = torch.tensor([0.4, 0.3, 0.2, 0.0, 0.0]) / 0.9
    assert (_frequencies(out.next_token_ids, 5) - expected).abs().max() < 0.03


# ---------------------------------------------------------------- min_p


def test_min_p_drops_tokens_below_its_share_of_the_best():
    sampler = Sampler(7)
    # 0.4 * 0.6 = 0.24: only the first two survive, renormalised.
    out = sampler.sample(SKEWED_LOGITS, build([SamplingParams(min_p=0.6)] * DRAWS, vocab=5))
    expected = torch.tensor([0.4, 0.3, 0.0, 0.0, 0.0]) / 0.7
    assert (_frequencies(out.next_token_ids, 5) - expected).abs().max() < 0.03
    # Rows without min_p in the same batch keep the full distribution.
    mixed = [SamplingParams(min_p=1.0), SamplingParams()] * (DRAWS // 2)
    out = sampler.sample(SKEWED_LOGITS, build(mixed, vocab=5))
    assert (out.next_token_ids[0::2] == 0).all()
    assert (_frequencies(out.next_token_ids[1::2], 5) - SKEWED_PROBS).abs().max() < 0.03


def test_min_p_applies_before_top_p_as_in_vllm():
    """vLLM takes min-p first and top-p's nucleus from what it left, renormalised.

    min_p 0.5 keeps 0.4 and 0.3 (>= 0.2), renormalised to 0.571 and 0.429; top_p 0.55 then keeps
    only the first.  Top-p first (transformers' order) keeps 0.4 and 0.3 (0.4 < 0.55), and min-p
    leaves both.  The second case keeps the same set in either order: a check of the shares.
    """
    sampler = Sampler(11)
    out = sampler.sample(SKEWED_LOGITS, build([SamplingParams(min_p=0.5, top_p=0.55)] * DRAWS, vocab=5))
    assert (out.next_token_ids == 0).all()
    out = sampler.sample(SKEWED_LOGITS, build([SamplingParams(min_p=0.2, top_p=0.5)] * DRAWS, vocab=5))
    expected = torch.tensor([0.4, 0.3, 0.0, 0.0, 0.0]) / 0.7
    assert (_frequencies(out.next_token_ids, 5) - expected).abs().max() < 0.03


@pytest.mark.parametrize("temperature", [1.2e-38, 1e-30, 1e-6])
def test_a_tiny_temperature_samples_the_largest_logit(temperature):
    """Logits above T * 3.4e38 used to overflow, clamp to the same float32 and tie: at 1.2e-38
    the three largest here were drawn about evenly."""
    logits = torch.tensor([[4.9, 5.0, 4.8, 1.0, -3.0]]).expand(512, 5)
    out = Sampler(3).sample(logits, build([SamplingParams(temperature=temperature)] * 512, vocab=5))
    assert (out.next_token_ids == 1).all()
    assert (out.logprobs == 0).all()


# ---------------------------------------------------------------- min_new_tokens


def test_min_new_tokens_masks_eos_and_stop_ids():
    vocab, eos, stop = 6, 0, 4
    logits = torch.tensor([[50.0, 1.0, 0.0, 0.0, 49.0, 0.0]] * 4)
    params = [
        SamplingParams(temperature=0, min_new_tokens=3, stop_token_ids=[stop]),
        SamplingParams(temperature=0, min_new_tokens=3, stop_token_ids=[stop]),
        SamplingParams(temperature=0, min_new_tokens=3, stop_token_ids=[stop], ignore_eos=True),
        SamplingParams(temperature=1.0, min_new_tokens=3, stop_token_ids=[stop], seed=1),
    ]
    outputs = [[1, 1], [1, 1, 1], [1], []]
    batch = build(params, outputs=outputs, eos=[eos], vocab=vocab)
    masked = apply_min_tokens_mask(logits, batch)
    assert torch.isinf(masked[0, [eos, stop]]).all() and torch.isfinite(masked[1]).all()
    # ignore_eos does not lift the minimum (vLLM masks EOS for min_tokens either way).
    assert torch.isinf(masked[2, [eos, stop]]).all()

    out = Sampler(0).sample(logits, batch)
    assert out.next_token_ids.tolist()[:3] == [1, eos, 1]
    assert out.next_token_ids[3].item() not in (eos, stop)


def test_min_new_tokens_never_leaves_a_row_with_nothing_to_sample():
    """A grammar that allows only a stop id (here: every other logit is -inf) keeps it: the
    grammar decides; rows that have other tokens left are still held back."""
    inf = float("-inf")
    eos, stop = 0, 4
    logits = torch.tensor([[inf, inf, inf, inf, 3.0, inf], [1.0, inf, 2.0, inf, 3.0, inf]])
    params = [SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=[stop])] * 2
    batch = build(params, outputs=[[], []], eos=[eos], vocab=6)
    masked = apply_min_tokens_mask(logits, batch)
    assert masked[0, stop] == 3.0 and torch.isneginf(masked[1, [eos, stop]]).all()
    assert Sampler(0).sample(logits, batch).next_token_ids.tolist() == [stop, 2]
    seeded = build([SamplingParams(temperature=1.0, seed=3, min_new_tokens=2, stop_token_ids=[stop])], outputs=[[]],
                   eos=[eos], vocab=6)
    assert Sampler(0).sample(logits[:1], seeded).next_token_ids.tolist() == [stop]


# ---------------------------------------------------------------- --logprobs_mode


def test_raw_logprobs_are_the_logits_own_and_the_draw_is_unchanged():
    torch.manual_seed(4)
    logits = torch.randn(6, 40) * 2
    params = [SamplingParams(temperature=0.5, seed=row, logprobs=4, logit_bias={3: 5.0}, repetition_penalty=1.3)
              for row in range(6)]
    batch = build(params, outputs=[[3, 7]] * 6, vocab=40)
    scaled = Sampler(0).sample(logits, batch)
    raw = Sampler(0, "raw_logprobs").sample(logits, batch)
    assert torch.equal(scaled.next_token_ids, raw.next_token_ids)
    expected = torch.log_softmax(logits, dim=-1).gather(1, raw.next_token_ids[:, None]).squeeze(1)
    assert torch.allclose(raw.logprobs, expected, atol=1e-6)
    assert not torch.allclose(scaled.logprobs, expected, atol=1e-2)
    assert torch.equal(raw.top_logprob_ids, logits.topk(4).indices)
    with pytest.raises(ValueError, match="logprobs_mode must be one of scaled_logprobs, processed_logprobs, raw_logprobs"):
        Sampler(0, "raw_logits")


def test_processed_logprobs_are_the_filtered_distribution_the_token_was_drawn_from():
    """vLLM's processed_logprobs: after every processor and the top-k / top-p / min-p filters, renormalised.

    The server's default (scaled_logprobs, LightLLM's) stops before the filters; the value that
    vLLM users pass by name meant the scaled one here before, so a top-k-filtered token kept a
    finite logprob where vLLM reports -inf.
    """
    torch.manual_seed(5)
    logits = torch.randn(8, 40) * 2
    params = [SamplingParams(temperature=0.7, top_k=3, seed=row, logprobs=4, logit_bias={3: 5.0},
                             repetition_penalty=1.3) for row in range(6)]
    params += [SamplingParams(temperature=0, top_k=3, logprobs=4), SamplingParams(temperature=0.7, logprobs=4)]
    batch = build(params, outputs=[[3, 7]] * 8, vocab=40)
    scaled = Sampler(0).sample(logits, batch)
    processed = Sampler(0, "processed_logprobs").sample(logits, batch)
    assert torch.equal(scaled.next_token_ids, processed.next_token_ids)
    # Top-k rows: the three kept tokens share the whole probability, the fourth alternative is -inf.
    kept = scaled.top_logprobs[:6, :3]
    normaliser = torch.logsumexp(kept, dim=-1)
    assert torch.allclose(processed.top_logprobs[:6, :3], kept - normaliser[:, None], atol=1e-5)
    assert torch.equal(processed.top_logprob_ids[:6, :3], scaled.top_logprob_ids[:6, :3])
    assert torch.isneginf(processed.top_logprobs[:6, 3]).all()
    assert torch.allclose(processed.logprobs[:6], scaled.logprobs[:6] - normaliser, atol=1e-5)
    # A greedy row is reported unfiltered (as vLLM reports greedy rows); a row without filters
    # is the same in both modes.
    assert torch.allclose(processed.top_logprobs[6:], scaled.top_logprobs[6:], atol=1e-6)
    assert torch.allclose(processed.logprobs[6:], scaled.logprobs[6:], atol=1e-6)
