"""SamplingBatch.build and Sampler.sample refuse malformed batches and logits, naming what is wrong."""

from __future__ import annotations

import pytest
import torch
from sampling_test_support import build

from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.common.sampling.sampling_batch import SamplingBatch


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
    # Each row's params (their type, stop and logit_bias ids in the vocabulary) are rank 0's
    # admission screen's to check, not the hot path's: test_admission_screen_sampling.py.


def test_sampler_rejects_mismatched_logits():
    batch = build([SamplingParams()] * 2, vocab=8)
    with pytest.raises(ValueError, match=r"logits must have shape \(2, 8\)"):
        Sampler(0).sample(torch.zeros(3, 8), batch)
    with pytest.raises(ValueError, match="floating-point"):
        Sampler(0).sample(torch.zeros(2, 8, dtype=torch.long), batch)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        Sampler(-1)
