"""Tests for lightllm.common.sampling: parameter validation and the batched sampler."""

from __future__ import annotations

import math

import pytest
import torch

from lightllm.common.sampling import (
    Sampler,
    SamplingBatch,
    SamplingParamError,
    SamplingParams,
    apply_min_tokens_mask,
    apply_penalties,
    apply_top_k_top_p,
    derive_step_seed,
)


def build(params, prompts=None, outputs=None, eos=(), vocab=8, device="cpu") -> SamplingBatch:
    size = len(params)
    prompts = prompts if prompts is not None else [[] for _ in range(size)]
    outputs = outputs if outputs is not None else [[] for _ in range(size)]
    return SamplingBatch.build(params, prompts, outputs, list(eos), vocab, device)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
        ({"temperature": "1.0"}, "temperature must be a number"),
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"temperature": True}, "temperature must be a number"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_k": -2}, "top_k must be -1 or 0 (disabled) or >= 1, got -2"),
        ({"top_k": True}, "top_k must be an integer"),
        ({"top_k": 2.0}, "top_k must be an integer"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -2.01}, "frequency_penalty must be in [-2, 2], got -2.01"),
        ({"seed": -1}, "seed must be in [0, 2**63 - 1], got -1"),
        ({"seed": 2**63}, "seed must be in [0, 2**63 - 1]"),
        ({"seed": "7"}, "seed must be an integer"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"max_new_tokens": False}, "max_new_tokens must be an integer"),
        ({"min_new_tokens": -1}, "min_new_tokens must be >= 0, got -1"),
        ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens must be <= max_new_tokens (4), got 5"),
        ({"stop_token_ids": [-3]}, "stop_token_ids must be >= 0, got -3"),
        ({"stop_token_ids": ["2"]}, "stop_token_ids must contain integers"),
        ({"stop_token_ids": 2}, "stop_token_ids must be a list"),
        ({"ignore_eos": "yes"}, "ignore_eos must be a bool"),
        ({"do_sample": 1}, "do_sample must be a bool or None"),
        ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
        ({"logprobs": -1}, "logprobs must be in [0, 20], got -1"),
        ({"stop_sequences": [""]}, "stop_sequences must not contain empty strings"),
        ({"stop_sequences": ["x"] * 17}, "stop_sequences must hold at most 16 entries, got 17"),
        ({"stop_sequences": [3]}, "stop_sequences must contain strings"),
        ({"stop_sequences": "stop"}, "stop_sequences must be a list"),
    ],
)
def test_invalid_values_raise_naming_the_parameter(kwargs, message):
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_validate_checks_stop_ids_against_vocab_and_mutations():
    params = SamplingParams(stop_token_ids=[3, 9])
    params.validate(vocab_size=10)
    with pytest.raises(SamplingParamError, match=r"stop_token_ids must be < vocab_size \(9\), got 9"):
        params.validate(vocab_size=9)
    with pytest.raises(SamplingParamError, match="vocab_size must be a positive integer"):
        params.validate(vocab_size=0)
    params.top_p = 2.0
    with pytest.raises(SamplingParamError, match="top_p"):
        params.validate()


def test_boundary_values_are_accepted():
    SamplingParams(temperature=0, top_p=1, top_k=0, presence_penalty=-2, frequency_penalty=2, seed=0,
                   max_new_tokens=1, min_new_tokens=1, logprobs=0, stop_sequences=["a"] * 16)
    SamplingParams(top_k=-1, logprobs=20, seed=2**63 - 1, stop_token_ids=(1, 2))


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.7, do_sample=False).is_greedy
    assert not SamplingParams(temperature=0.7, do_sample=True).is_greedy
    assert not SamplingParams().is_greedy


def test_to_dict_from_dict_round_trip():
    params = SamplingParams(temperature=0.3, top_k=5, seed=11, stop_token_ids=[1, 2], stop_sequences=["\n\n"],
                            logprobs=3, min_new_tokens=2, do_sample=True)
    data = params.to_dict()
    assert data["stop_token_ids"] == [1, 2] and data["seed"] == 11
    data["stop_token_ids"].append(99)  # the dict must not alias the params' lists
    assert params.stop_token_ids == [1, 2]
    data["stop_token_ids"].pop()
    assert SamplingParams.from_dict(data) == params
    assert SamplingParams.from_dict({}) == SamplingParams()
    with pytest.raises(SamplingParamError, match="unknown sampling parameter.*tempreature"):
        SamplingParams.from_dict({"tempreature": 1.0})
    with pytest.raises(SamplingParamError, match="top_p must be in"):
        SamplingParams.from_dict({"top_p": 3})
    with pytest.raises(SamplingParamError, match="must be a mapping"):
        SamplingParams.from_dict([("top_p", 0.5)])


# ---------------------------------------------------------------- batch building


def test_batch_build_rejects_bad_inputs():
    params = [SamplingParams(repetition_penalty=1.2)]
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingBatch.build(params, [[1], [2]], [[]], [], 8)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] holds a token id outside \[0, 8\)"):
        SamplingBatch.build(params, [[8]], [[]], [], 8)
    with pytest.raises(ValueError, match="eos_token_ids"):
        SamplingBatch.build(params, [[1]], [[]], [8], 8)
    with pytest.raises(ValueError, match="params must hold at least one"):
        SamplingBatch.build([], [], [], [], 8)
    with pytest.raises(ValueError, match=r"params\[0\] must be SamplingParams"):
        SamplingBatch.build([{"top_p": 1.0}], [[1]], [[]], [], 8)
    with pytest.raises(SamplingParamError, match="stop_token_ids must be < vocab_size"):
        SamplingBatch.build([SamplingParams(min_new_tokens=1, stop_token_ids=[20])], [[1]], [[]], [], 8)


def test_sampler_rejects_mismatched_logits():
    batch = build([SamplingParams()] * 2, vocab=8)
    with pytest.raises(ValueError, match=r"logits must have shape \(2, 8\)"):
        Sampler(0).sample(torch.zeros(3, 8), batch)
    with pytest.raises(ValueError, match="floating-point"):
        Sampler(0).sample(torch.zeros(2, 8, dtype=torch.long), batch)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        Sampler(-1)


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
    draws, temperature = 20_000, 0.7
    row = torch.tensor([1.0, 2.0, 0.0, 0.5, -1.0])
    batch = build([SamplingParams(temperature=temperature)] * draws, vocab=5)
    out = Sampler(1234).sample(row.expand(draws, 5), batch)
    expected = torch.softmax(row / temperature, dim=-1)
    assert (_frequencies(out.next_token_ids, 5) - expected).abs().max() < 0.03
    # The untempered distribution differs by more than the tolerance, so temperature matters.
    assert (torch.softmax(row, dim=-1) - expected).abs().max() > 0.05


def test_top_k_and_top_p_sampling_renormalise():
    draws = 20_000
    probs = torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03])
    logits = probs.log().expand(draws, 5)
    sampler = Sampler(99)
    out = sampler.sample(logits, build([SamplingParams(top_k=2)] * draws, vocab=5))
    expected = torch.tensor([0.4, 0.3, 0.0, 0.0, 0.0]) / 0.7
    assert (_frequencies(out.next_token_ids, 5) - expected).abs().max() < 0.03
    out = sampler.sample(logits, build([SamplingParams(top_p=0.85)] * draws, vocab=5))
    expected = torch.tensor([0.4, 0.3, 0.2, 0.0, 0.0]) / 0.9
    assert (_frequencies(out.next_token_ids, 5) - expected).abs().max() < 0.03


# ---------------------------------------------------------------- penalties


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


# ---------------------------------------------------------------- seeds


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
    assert torch.isfinite(masked[2, eos]) and torch.isinf(masked[2, stop])

    out = Sampler(0).sample(logits, batch)
    assert out.next_token_ids.tolist()[:3] == [1, eos, eos]
    assert out.next_token_ids[3].item() not in (eos, stop)


# ---------------------------------------------------------------- logprobs


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


# ---------------------------------------------------------------- min_p

def test_min_p_drops_tokens_below_its_share_of_the_best():
    draws = 20_000
    probs = torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03])
    logits = probs.log().expand(draws, 5)
    sampler = Sampler(7)
    # 0.4 * 0.6 = 0.24: only the first two survive, renormalised.
    out = sampler.sample(logits, build([SamplingParams(min_p=0.6)] * draws, vocab=5))
    expected = torch.tensor([0.4, 0.3, 0.0, 0.0, 0.0]) / 0.7
    assert (_frequencies(out.next_token_ids, 5) - expected).abs().max() < 0.03
    # Rows without min_p in the same batch keep the full distribution.
    mixed = [SamplingParams(min_p=1.0), SamplingParams()] * (draws // 2)
    out = sampler.sample(logits, build(mixed, vocab=5))
    assert (out.next_token_ids[0::2] == 0).all()
    assert (_frequencies(out.next_token_ids[1::2], 5) - probs).abs().max() < 0.03


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), True])
def test_min_p_out_of_range_is_refused(value):
    with pytest.raises(SamplingParamError, match="min_p"):
        SamplingParams(min_p=value)


def test_input_penalty_counts_prompt_tokens_in_presence_and_frequency():
    logits = torch.zeros(2, 6)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, input_penalty=True),
              SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)]
    batch = build(params, prompts=[[1, 1, 2], [1, 1, 2]], outputs=[[2], [2]], vocab=6)
    out = apply_penalties(logits, batch)
    # Row 0 counts the prompt: token 1 twice, token 2 twice (prompt + output).
    assert out[0].tolist() == [0.0, -1.0, -1.0, 0.0, 0.0, 0.0]
    assert out[1].tolist() == [0.0, 0.0, -0.75, 0.0, 0.0, 0.0]
