"""One step's per-row sampling parameters, packed as tensors for the batched sampler.

Building the batch is the only per-row Python work of a sampling step, and it runs every
step, so it copies each row's fields once, converts token histories with numpy rather than
element by element, and moves all per-row numbers to the device in as few copies as it can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from lightllm.common.sampling.sampling_params import SamplingParamError, SamplingParams

_MASK64 = (1 << 64) - 1
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_NO_IDS = np.empty(0, dtype=np.int64)


def derive_step_seed(seed: int, step: int) -> int:
    """Mix a request seed and its generation step into an independent 64-bit generator seed.

    A plain ``seed + step`` would make request ``seed=1`` at step 0 replay request ``seed=0``
    at step 1; the splitmix64 finaliser decorrelates neighbouring inputs.
    """
    value = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _ids_in_vocab(name: str, row: int, ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """``ids`` as an int64 array; ``ValueError`` if one lies outside ``[0, vocab_size)``."""
    try:
        array = np.asarray(ids, dtype=np.int64)
    except OverflowError:
        array = None
    if array is None or (array.size and (array.min() < 0 or array.max() >= vocab_size)):
        raise ValueError(f"{name}[{row}] holds a token id outside [0, {vocab_size})")
    return array


def _penalty_histories(
    param: SamplingParams,
    row: int,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    vocab_size: int,
    generated_before: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """The ids the row's repetition penalty sees, and those its frequency / presence penalties count.

    The last ``generated_before`` prompt ids are output of earlier segments: frequency / presence
    count them as generated.  A neutral penalty gets an empty history: less to copy, same result.
    """
    seen = counted = _NO_IDS
    prompt = output = None
    if param.repetition_penalty != 1.0:
        prompt = _ids_in_vocab("prompt_ids", row, prompt_ids, vocab_size)
        output = _ids_in_vocab("output_ids", row, output_ids, vocab_size)
        seen = np.concatenate((prompt, output))
    if param.presence_penalty != 0.0 or param.frequency_penalty != 0.0:
        if output is None:
            output = _ids_in_vocab("output_ids", row, output_ids, vocab_size)
        counted = output
        if generated_before and not param.input_penalty:
            if prompt is None:
                prompt = _ids_in_vocab("prompt_ids", row, prompt_ids, vocab_size)
            counted = np.concatenate((prompt[len(prompt) - generated_before :], output))
        if param.input_penalty:
            if prompt is None:
                prompt = _ids_in_vocab("prompt_ids", row, prompt_ids, vocab_size)
            counted = np.concatenate((prompt, output))
    return seen, counted


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


def _flat_cells(histories: list[np.ndarray], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """The ``row * vocab_size + token`` cell of every id in ``histories``; None when all are empty."""
    lengths = [len(history) for history in histories]
    if not any(lengths):
        return None
    row_starts = np.arange(len(histories), dtype=np.int64) * vocab_size
    cells = np.concatenate(histories) + np.repeat(row_starts, lengths)
    return torch.from_numpy(cells).to(device)


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
            params: one :class:`SamplingParams` per row.
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
        device = torch.device(device)

        # Rows of [temperature, top_p, min_p, repetition, presence, frequency], one per request:
        # a single tensor, so a single host-to-device copy.
        floats: list[tuple[float, float, float, float, float, float]] = []
        greedy: list[bool] = []
        top_k: list[int] = []
        top_logprobs_counts: list[int] = []
        seen_rows: list[np.ndarray] = []
        counted_rows: list[np.ndarray] = []
        mask_rows: list[int] = []
        mask_cols: list[int] = []
        seeded_rows: list[tuple[int, int]] = []
        decay_rows: list[int] = []
        decay_scales: list[float] = []
        bias_cells: list[int] = []
        bias_values: list[float] = []
        for row, param in enumerate(params):
            if not isinstance(param, SamplingParams):
                raise ValueError(f"params[{row}] must be SamplingParams, got {type(param).__name__}")
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
            for token_id, bias in param.logit_bias.items():
                if not 0 <= token_id < vocab_size:
                    raise SamplingParamError(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})")
                bias_cells.append(row * vocab_size + token_id)
                bias_values.append(float(bias))
            top_logprobs_counts.append(min(param.logprobs or 0, vocab_size))
            generated = output_ids[row]
            seen, counted = _penalty_histories(param, row, prompt_ids[row], generated, vocab_size, before[row])
            # Tokens generated so far by the whole generation, earlier segments included.
            steps = before[row] + len(generated)
            seen_rows.append(seen)
            counted_rows.append(counted)
            if len(generated) < param.min_new_tokens:
                banned = set(eos) | set(param.stop_token_ids)
                for token_id in sorted(banned):
                    if token_id >= vocab_size:
                        raise SamplingParamError(
                            f"stop_token_ids must be < vocab_size ({vocab_size}), got {token_id}"
                        )
                    mask_rows.append(row)
                    mask_cols.append(token_id)
            if param.seed is not None and not is_greedy:
                seeded_rows.append((row, derive_step_seed(param.seed, steps)))
            start = param.exponential_decay_start
            if start is not None and steps > start and param.exponential_decay_factor != 1.0:
                decay_rows.append(row)
                decay_scales.append(decay_scale(float(param.exponential_decay_factor), steps - start))

        # Transposed on the host so that each parameter is a contiguous row on the device.
        packed = torch.tensor(floats, dtype=torch.float32).T.contiguous().to(device)
        temperatures, top_p, min_p, repetition, presence, frequency = packed
        return cls(
            size=size,
            vocab_size=vocab_size,
            device=device,
            temperatures=temperatures,
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=top_p,
            min_p=min_p,
            repetition_penalties=repetition,
            presence_penalties=presence,
            frequency_penalties=frequency,
            seen_cells=_flat_cells(seen_rows, vocab_size, device),
            counted_cells=_flat_cells(counted_rows, vocab_size, device),
            min_tokens_mask=(
                torch.tensor([mask_rows, mask_cols], dtype=torch.long, device=device) if mask_rows else None
            ),
            seeded_rows=seeded_rows,
            top_logprobs_counts=top_logprobs_counts,
            all_greedy=all(greedy),
            any_top_k=min(top_k) < vocab_size,
            any_top_p=any(row[1] < 1.0 for row in floats),
            any_min_p=any(row[2] > 0.0 for row in floats),
            max_top_k=max(top_k),
            decay_rows=torch.tensor(decay_rows, dtype=torch.long, device=device) if decay_rows and eos else None,
            decay_scales=torch.tensor(decay_scales, dtype=torch.float32, device=device) if decay_rows and eos else None,
            decay_eos_ids=torch.tensor(sorted(set(eos)), dtype=torch.long, device=device) if decay_rows and eos else None,
            bias_cells=torch.tensor(bias_cells, dtype=torch.long, device=device) if bias_cells else None,
            bias_values=torch.tensor(bias_values, dtype=torch.float32, device=device) if bias_cells else None,
        )
