"""One step's per-row sampling parameters, packed as tensors for the batched sampler.

Building the batch is the only per-row Python work of a sampling step, and it runs every
step, so it copies each row's fields once, converts token histories with numpy rather than
element by element, and moves all per-row numbers to the device in as few copies as it can.
Each tensor group has its own ``_pack_*`` function (the penalty histories theirs in
:mod:`.penalty_cells`); :meth:`SamplingBatch.build` checks the batch's shape and runs them in turn.

The rows' parameters are not checked again here.  Every served request passed rank 0's
admission screen (``lightllm/server/model_rank/scheduling/admission.py``) before any rank
admitted it: its params are a :class:`SamplingParams` (``RequestSpec.__post_init__``) validated
against the model's vocabulary (``RequestSpec.check_fits``), so stop token ids and logit_bias
ids lie in ``[0, vocab_size)``, the width of the logits they are applied to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

from lightllm.common.sampling.penalty_cells import pack_penalty_cells
from lightllm.common.sampling.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def derive_step_seed(seed: int, step: int) -> int:
    """Mix a request seed and its generation step into an independent 64-bit generator seed.

    A plain ``seed + step`` would make request ``seed=1`` at step 0 replay request ``seed=0``
    at step 1; the splitmix64 finaliser decorrelates neighbouring inputs.
    """
    value = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def decay_scale(factor: float, steps: int) -> float:
    """``factor ** steps - 1``, held at the largest float32 instead of overflowing.

    An infinite scale would turn an EOS logit of exactly 0 into ``0 * inf = NaN``; the largest
    finite one gives the intended limit (EOS dominates) for every other logit.
    """
    try:
        scale = factor**steps - 1.0
    except OverflowError:
        return _FLOAT32_MAX
    return min(scale, _FLOAT32_MAX)


class _RowControls(NamedTuple):
    """Each row's temperature, filters, penalty strengths and logprob count, and what they imply."""

    temperatures: torch.Tensor
    greedy_mask: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalties: torch.Tensor
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    top_logprobs_counts: list[int]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_top_k: int


class _DecayRows(NamedTuple):
    """The exponential-decay rows, their scales and the EOS ids they raise (all None: no row decays)."""

    decay_rows: torch.Tensor | None
    decay_scales: torch.Tensor | None
    decay_eos_ids: torch.Tensor | None


class _LogitBias(NamedTuple):
    """Every row's logit_bias as flat cells ``row * V + token`` and the values added there."""

    bias_cells: torch.Tensor | None
    bias_values: torch.Tensor | None


def _pack_floats(params: Sequence[SamplingParams], vocab_size: int, device: torch.device) -> _RowControls:
    """The per-row numbers of ``params`` (temperature, top-k / top-p / min-p, penalty strengths)."""
    # Rows of [temperature, top_p, min_p, repetition, presence, frequency], one per request:
    # a single tensor, so a single host-to-device copy.
    floats: list[tuple[float, float, float, float, float, float]] = []
    greedy: list[bool] = []
    top_k: list[int] = []
    top_logprobs_counts: list[int] = []
    for param in params:
        is_greedy = param.is_greedy
        greedy.append(is_greedy)
        floats.append((
            1.0 if is_greedy else float(param.temperature),
            float(param.top_p),
            float(param.min_p),
            float(param.repetition_penalty),
            float(param.presence_penalty),
            float(param.frequency_penalty),
        ))
        top_k.append(min(param.top_k, vocab_size) if param.top_k_enabled else vocab_size)
        top_logprobs_counts.append(min(param.logprobs or 0, vocab_size))
    # Transposed on the host so that each parameter is a contiguous row on the device.
    packed = torch.tensor(floats, dtype=torch.float32).T.contiguous().to(device)
    temperatures, top_p, min_p, repetition, presence, frequency = packed
    return _RowControls(
        temperatures=temperatures,
        greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
        top_k=torch.tensor(top_k, dtype=torch.long, device=device),
        top_p=top_p,
        min_p=min_p,
        repetition_penalties=repetition,
        presence_penalties=presence,
        frequency_penalties=frequency,
        top_logprobs_counts=top_logprobs_counts,
        all_greedy=all(greedy),
        any_top_k=min(top_k) < vocab_size,
        any_top_p=any(row[1] < 1.0 for row in floats),
        any_min_p=any(row[2] > 0.0 for row in floats),
        max_top_k=max(top_k),
    )


def _pack_min_tokens_mask(
    params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]], eos: Sequence[int], device: torch.device
) -> torch.Tensor | None:
    """``long[2, M]`` (row, token) pairs held at -inf: EOS and stop ids of rows short of ``min_new_tokens``."""
    eos_set = set(eos)
    eos_sorted = sorted(eos_set)
    mask_rows: list[int] = []
    mask_cols: list[int] = []
    for row, param in enumerate(params):
        if len(output_ids[row]) < param.min_new_tokens:
            banned = sorted(eos_set.union(param.stop_token_ids)) if param.stop_token_ids else eos_sorted
            mask_rows.extend([row] * len(banned))
            mask_cols.extend(banned)
    if not mask_rows:
        return None
    return torch.tensor([mask_rows, mask_cols], dtype=torch.long, device=device)


def _pack_seeds(params: Sequence[SamplingParams], steps: Sequence[int]) -> list[tuple[int, int]]:
    """``(row, generator seed for this step)`` of each seeded row that samples (greedy rows draw nothing)."""
    return [
        (row, derive_step_seed(param.seed, steps[row]))
        for row, param in enumerate(params)
        if param.seed is not None and not param.is_greedy
    ]


def _pack_decay(
    params: Sequence[SamplingParams], steps: Sequence[int], eos: Sequence[int], device: torch.device
) -> _DecayRows:
    """The rows past their exponential-decay start, each with ``factor ** (steps - start) - 1``."""
    decay_rows: list[int] = []
    decay_scales: list[float] = []
    for row, param in enumerate(params):
        start = param.exponential_decay_start
        if start is not None and steps[row] > start and param.exponential_decay_factor != 1.0:
            decay_rows.append(row)
            decay_scales.append(decay_scale(float(param.exponential_decay_factor), steps[row] - start))
    # Decay only raises EOS logits: without an EOS id there is nothing to raise.
    if not decay_rows or not eos:
        return _DecayRows(None, None, None)
    return _DecayRows(
        decay_rows=torch.tensor(decay_rows, dtype=torch.long, device=device),
        decay_scales=torch.tensor(decay_scales, dtype=torch.float32, device=device),
        decay_eos_ids=torch.tensor(sorted(set(eos)), dtype=torch.long, device=device),
    )


def _pack_logit_bias(params: Sequence[SamplingParams], vocab_size: int, device: torch.device) -> _LogitBias:
    """Every row's logit_bias as flat cells and values (both None when no row has one)."""
    bias_cells: list[int] = []
    bias_values: list[float] = []
    for row, param in enumerate(params):
        bias = param.logit_bias
        if bias:
            row_start = row * vocab_size
            bias_cells.extend([row_start + token_id for token_id in bias])
            bias_values.extend(map(float, bias.values()))
    if not bias_cells:
        return _LogitBias(None, None)
    return _LogitBias(
        bias_cells=torch.tensor(bias_cells, dtype=torch.long, device=device),
        bias_values=torch.tensor(bias_values, dtype=torch.float32, device=device),
    )


def _check_batch_shape(
    size: int,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    generated_before: Sequence[int] | None,
    eos_token_ids: Sequence[int],
    vocab_size: int,
) -> tuple[list[int], list[int]]:
    """``ValueError`` unless the batch's lists have one entry per row and its vocabulary and EOS ids
    are sound; returns ``generated_before`` (zeros when None) and the EOS ids as lists."""
    if size == 0:
        raise ValueError("params must hold at least one SamplingParams")
    if len(prompt_ids) != size or len(output_ids) != size:
        raise ValueError(
            f"prompt_ids and output_ids must have one entry per row ({size}), "
            f"got {len(prompt_ids)} and {len(output_ids)}"
        )
    # Each count is a RequestSpec's, checked (within its prompt) when the spec was built.
    before = [0] * size if generated_before is None else list(generated_before)
    if len(before) != size:
        raise ValueError(f"generated_before must have one entry per row ({size}), got {len(before)}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    eos = list(eos_token_ids)
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in eos):
        raise ValueError(f"eos_token_ids must be integers in [0, {vocab_size}), got {eos}")
    return before, eos


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, packed as tensors on the logits' device.

    Build it with :meth:`build`; the optional tensors are ``None`` when no row needs them,
    which lets the sampler skip that stage entirely.
    """

    size: int
    vocab_size: int
    device: torch.device
    temperatures: torch.Tensor  # float32[B]; 1.0 on greedy rows
    greedy_mask: torch.Tensor  # bool[B]
    top_k: torch.Tensor  # long[B] in [1, V]; V where top-k is disabled
    top_p: torch.Tensor  # float32[B]
    min_p: torch.Tensor  # float32[B]; 0 where min-p is disabled
    repetition_penalties: torch.Tensor  # float32[B]
    presence_penalties: torch.Tensor  # float32[B]
    frequency_penalties: torch.Tensor  # float32[B]
    seen_cells: torch.Tensor | None  # long[N] row * V + token over prompt + output ids
    counted_cells: torch.Tensor | None  # long[N] the same over the ids frequency / presence count
    min_tokens_mask: torch.Tensor | None  # long[2, M] (row, token) pairs held at -inf
    seeded_rows: list[tuple[int, int]]  # (row, generator seed for this step), sampled rows only
    top_logprobs_counts: list[int]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_top_k: int  # largest entry of top_k
    # Exponential decay length penalty: the rows past their start, each with its
    # ``factor ** (generated - start) - 1``, and the EOS ids it raises.  None: no row decays.
    decay_rows: torch.Tensor | None = None  # long[R]
    decay_scales: torch.Tensor | None = None  # float32[R]
    decay_eos_ids: torch.Tensor | None = None  # long[E]
    # logit_bias of every row as flat cells ``row * V + token`` and the values added there.
    bias_cells: torch.Tensor | None = None  # long[N]
    bias_values: torch.Tensor | None = None  # float32[N]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        eos_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
        generated_before: Sequence[int] | None = None,
    ) -> "SamplingBatch":
        """Pack one step's requests.

        Args:
            params: one :class:`SamplingParams` per row, validated against ``vocab_size``
                (rank 0's admission screen did so for every served request; not checked again).
            prompt_ids: each row's prompt token ids.
            output_ids: each row's generated token ids so far (its length is the step index
                used for seeding and for ``min_new_tokens``).
            generated_before: per row, how many trailing ``prompt_ids`` are really output of
                earlier segments of the same generation (a PD continuation; None: all 0).
                Everything that depends on the output so far counts them: the seeded step
                index, frequency / presence penalties and the exponential-decay length.
                ``min_new_tokens`` is not: its budget arrives already reduced by them, like
                ``max_new_tokens``.
            eos_token_ids: the model's EOS ids; masked while ``min_new_tokens`` is unmet, also on
                ``ignore_eos`` rows (as vLLM and transformers' ``min_new_tokens`` do: the
                minimum is about the output, whether or not EOS would end it).
            vocab_size: width of the logits the batch will be applied to.
            device: device of those logits.
        """
        size = len(params)
        before, eos = _check_batch_shape(size, prompt_ids, output_ids, generated_before, eos_token_ids, vocab_size)
        device = torch.device(device)
        # Tokens generated so far by the whole generation, earlier segments included.
        steps = [earlier + len(generated) for earlier, generated in zip(before, output_ids)]
        return cls(
            size=size,
            vocab_size=vocab_size,
            device=device,
            **_pack_floats(params, vocab_size, device)._asdict(),
            **pack_penalty_cells(params, prompt_ids, output_ids, before, vocab_size, device)._asdict(),
            min_tokens_mask=_pack_min_tokens_mask(params, output_ids, eos, device),
            seeded_rows=_pack_seeds(params, steps),
            **_pack_decay(params, steps, eos, device)._asdict(),
            **_pack_logit_bias(params, vocab_size, device)._asdict(),
        )
