"""The token histories the repetition and frequency / presence penalties act on, as flat cells.

A penalty touches the logits cell ``row * vocab_size + token`` of every id in its row's history,
so a batch's histories become one flat index tensor per penalty kind.  Histories are the only
per-row data of a step that grow with the request (whole prompts and outputs), so they are
converted with numpy, and not at all for rows whose penalty is neutral.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch

from lightllm.common.sampling.sampling_params import SamplingParams

_NO_IDS = np.empty(0, dtype=np.int64)


class PenaltyCells(NamedTuple):
    """Flat ``row * V + token`` cells of the ids each penalty sees (None: no row has any)."""

    seen_cells: torch.Tensor | None  # repetition penalty: prompt + output ids
    counted_cells: torch.Tensor | None  # frequency / presence penalties: the ids they count


def _ids_in_vocab(name: str, row: int, ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """``ids`` as an int64 array; ``ValueError`` if one lies outside ``[0, vocab_size)``.

    Kept on the hot path although the screen bounds prompt ids: output ids are not all this
    rank's samples (a PD decode node appends the token its prefill node handed over), and an
    id past the row's width would silently penalise the next row's cell.
    """
    try:
        array = np.asarray(ids, dtype=np.int64)
    except OverflowError:
        array = None
    if array is None or (array.size and (array.min() < 0 or array.max() >= vocab_size)):
        raise ValueError(f"{name}[{row}] holds a token id outside [0, {vocab_size})")
    return array


def penalty_histories(
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


def flat_cells(histories: list[np.ndarray], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """The ``row * vocab_size + token`` cell of every id in ``histories``; None when all are empty."""
    lengths = [len(history) for history in histories]
    if not any(lengths):
        return None
    row_starts = np.arange(len(histories), dtype=np.int64) * vocab_size
    cells = np.concatenate(histories) + np.repeat(row_starts, lengths)
    return torch.from_numpy(cells).to(device)


def pack_penalty_cells(
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    generated_before: Sequence[int],
    vocab_size: int,
    device: torch.device,
) -> PenaltyCells:
    """Every row's penalty histories (see :func:`penalty_histories`) as flat cells on ``device``."""
    seen_rows: list[np.ndarray] = []
    counted_rows: list[np.ndarray] = []
    for row, param in enumerate(params):
        seen, counted = penalty_histories(param, row, prompt_ids[row], output_ids[row], vocab_size,
                                          generated_before[row])
        seen_rows.append(seen)
        counted_rows.append(counted)
    return PenaltyCells(flat_cells(seen_rows, vocab_size, device), flat_cells(counted_rows, vocab_size, device))
