"""Each tensor group of SamplingBatch, packed alone by its own function."""

from __future__ import annotations

import torch

from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.penalty_cells import pack_penalty_cells
from lightllm.common.sampling.sampling_batch import (
    _check_batch_shape,
    _pack_decay,
    _pack_floats,
    _pack_logit_bias,
    _pack_min_tokens_mask,
    _pack_seeds,
    decay_scale,
    derive_step_seed,
)

CPU = torch.device("cpu")


def test_floats_hold_each_rows_controls_and_what_they_imply() -> None:
    sampled = SamplingParams(temperature=0.5, top_p=0.25, min_p=0.1, top_k=99, repetition_penalty=1.5,
                             presence_penalty=-1.0, frequency_penalty=0.5)
    params = [SamplingParams(temperature=0, top_k=3, logprobs=2), sampled]
    controls = _pack_floats(params, 10, CPU)
    assert controls.temperatures.tolist() == [1.0, 0.5]  # a greedy row divides by 1
    assert controls.greedy_mask.tolist() == [True, False]
    assert controls.top_k.tolist() == [3, 10]  # clamped to the vocabulary
    assert controls.top_p.tolist() == [1.0, 0.25]
    assert controls.min_p.tolist() == [0.0, torch.tensor(0.1).item()]
    assert controls.repetition_penalties.tolist() == [1.0, 1.5]
    assert controls.presence_penalties.tolist() == [0.0, -1.0]
    assert controls.frequency_penalties.tolist() == [0.0, 0.5]
    assert controls.top_logprobs_counts == [2, 0]
    assert not controls.all_greedy and controls.any_top_k and controls.any_top_p and controls.any_min_p
    assert controls.max_top_k == 10
    plain = _pack_floats([SamplingParams(top_k=-1)], 10, CPU)
    assert (plain.any_top_k, plain.any_top_p, plain.any_min_p, plain.max_top_k) == (False, False, False, 10)


def test_penalty_cells_flatten_each_rows_history() -> None:
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams(), SamplingParams(frequency_penalty=1.0)]
    cells = pack_penalty_cells(params, [[1, 2], [3], [4, 5]], [[6], [7], [8]], [0, 0, 1], 10, CPU)
    assert cells.seen_cells.tolist() == [1, 2, 6]  # the neutral rows add nothing
    assert cells.counted_cells.tolist() == [25, 28]  # row 2: its last prompt id was generated before
    none = pack_penalty_cells([SamplingParams()], [[1]], [[2]], [0], 10, CPU)
    assert none.seen_cells is None and none.counted_cells is None


def test_min_tokens_mask_bans_eos_and_stop_ids_on_rows_short_of_their_minimum() -> None:
    params = [SamplingParams(min_new_tokens=2, stop_token_ids=[7, 3]), SamplingParams(min_new_tokens=1),
              SamplingParams(min_new_tokens=1, stop_token_ids=[5])]
    mask = _pack_min_tokens_mask(params, [[1], [], [4]], [3, 0], CPU)
    assert mask.tolist() == [[0, 0, 0, 1, 1], [0, 3, 7, 0, 3]]  # row 2 has its one token
    assert _pack_min_tokens_mask([SamplingParams(min_new_tokens=1)], [[1]], [0], CPU) is None


def test_seeds_are_per_step_and_skip_greedy_rows() -> None:
    params = [SamplingParams(seed=4), SamplingParams(seed=4, temperature=0), SamplingParams(), SamplingParams(seed=9)]
    assert _pack_seeds(params, [0, 1, 2, 5]) == [(0, derive_step_seed(4, 0)), (3, derive_step_seed(9, 5))]


def test_decay_covers_rows_past_their_start_and_needs_an_eos() -> None:
    params = [SamplingParams(exponential_decay_start=2, exponential_decay_factor=2.0),
              SamplingParams(exponential_decay_start=5, exponential_decay_factor=2.0),
              SamplingParams(exponential_decay_start=0, exponential_decay_factor=1.0)]
    decay = _pack_decay(params, [5, 5, 9], [4, 2, 4], CPU)
    assert decay.decay_rows.tolist() == [0]
    assert decay.decay_scales.tolist() == [decay_scale(2.0, 3)]
    assert decay.decay_eos_ids.tolist() == [2, 4]
    assert _pack_decay(params, [5, 5, 9], [], CPU) == (None, None, None)


def test_logit_bias_becomes_flat_cells_and_values() -> None:
    params = [SamplingParams(logit_bias={3: 1.5, 0: -2}), SamplingParams(), SamplingParams(logit_bias={9: 100})]
    bias = _pack_logit_bias(params, 10, CPU)
    assert bias.bias_cells.tolist() == [3, 0, 29]
    assert bias.bias_values.tolist() == [1.5, -2.0, 100.0]
    assert bias.bias_values.dtype == torch.float32
    assert _pack_logit_bias([SamplingParams()], 10, CPU) == (None, None)


def test_batch_shape_defaults_generated_before_to_zeros() -> None:
    assert _check_batch_shape(2, [[1], [2]], [[], []], None, (1,), 8) == ([0, 0], [1])
    assert _check_batch_shape(1, [[1, 2]], [[]], [1], [], 8) == ([1], [])
