"""SamplingParams: validation of every field, greedy detection and the dict round trip."""

from __future__ import annotations

import pytest

from lightllm.common.sampling import SamplingParamError, SamplingParams


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


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), True])
def test_min_p_out_of_range_is_refused(value):
    with pytest.raises(SamplingParamError, match="min_p"):
        SamplingParams(min_p=value)
