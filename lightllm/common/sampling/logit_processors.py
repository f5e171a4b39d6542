"""Logit processors: logit bias, penalties, the EOS length decay, the ``min_new_tokens`` mask and top-k / top-p / min-p filters.

Each works out of place on float32 logits of one :class:`SamplingBatch` and skips itself
when no row of the batch uses its feature.  The public ``apply_*`` functions check the
logits against the batch and convert them to float32 first; the sampler calls the private
ones on logits it has already checked and converted.
"""

from __future__ import annotations

import torch

from lightllm.common.sampling.sampling_batch import SamplingBatch

_FLOAT32_MAX = torch.finfo(torch.float32).max


def within_float32(values: torch.Tensor, masked: torch.Tensor | None = None) -> torch.Tensor:
    """Clamp values that overflowed to +-inf back to the largest float32; keep masked entries -inf.

    A tiny repetition penalty (or a temperature, see the sampler) can push a logit past the
    float32 range, and ``inf - inf`` inside softmax would turn the whole row into NaN (a garbage
    token).  Clamped, the tokens that overflowed tie at the largest float32 and dominate the
    rest; the sampler divides by the temperature relative to the row's largest logit, so a
    temperature alone never overflows upwards.
    """
    bounded = values.clamp(min=-_FLOAT32_MAX, max=_FLOAT32_MAX)
    if masked is not None:
        bounded = bounded.masked_fill(masked, float("-inf"))
    return bounded


def check_logits(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Raise ``ValueError`` unless ``logits`` is a float ``[B, V]`` tensor on the batch's device."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point tensor")
    if tuple(logits.shape) != (batch.size, batch.vocab_size):
        raise ValueError(
            f"logits must have shape ({batch.size}, {batch.vocab_size}) to match the batch, "
            f"got {tuple(logits.shape)}"
        )
    if logits.device != batch.device:
        raise ValueError(f"logits are on {logits.device} but the batch was built for {batch.device}")


def biased(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Every row's ``logit_bias`` added to its logits (out of place; see :func:`apply_logit_bias`)."""
    if batch.bias_cells is None:
        return logits
    # A masked token stays masked: -inf plus a finite bias is still -inf.
    return logits.reshape(-1).index_add(0, batch.bias_cells, batch.bias_values).view_as(logits)


def penalised(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Out-of-place penalties on float32 logits (see :func:`apply_penalties`)."""
    # Penalised tokens arrive as flat cells ``row * V + token``, so one 1-D scatter covers
    # every row without padding the rows' histories to a common length.
    cells = batch.size * batch.vocab_size
    if batch.seen_cells is not None:
        seen = torch.zeros(cells, dtype=torch.bool, device=logits.device)
        seen.scatter_(0, batch.seen_cells, True)
        penalty = batch.repetition_penalties[:, None]
        penalised_logits = torch.where(logits > 0, logits / penalty, logits * penalty)
        # A token masked before (structured output's -inf) stays masked: the clamp of the
        # overflow guard would otherwise turn it into the lowest float32, a finite logprob.
        logits = within_float32(torch.where(seen.view_as(logits), penalised_logits, logits), torch.isneginf(logits))
    if batch.counted_cells is not None:
        ones = torch.ones(1, dtype=torch.float32, device=logits.device).expand(batch.counted_cells.shape)
        counts = torch.zeros(cells, dtype=torch.float32, device=logits.device)
        counts = counts.scatter_add_(0, batch.counted_cells, ones).view_as(logits)
        logits = (
            logits
            - batch.frequency_penalties[:, None] * counts
            - batch.presence_penalties[:, None] * (counts > 0).to(torch.float32)
        )
    return logits


def eos_decayed(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """EOS logits raised by the exponential decay length penalty (see :func:`apply_exponential_decay`)."""
    if batch.decay_rows is None:
        return logits
    rows = batch.decay_rows[:, None]
    cols = batch.decay_eos_ids[None, :]
    current = logits[rows, cols]
    raised = within_float32(current + current.abs() * batch.decay_scales[:, None])
    # A token already masked (structured output) stays masked: -inf + inf would be NaN.
    raised = torch.where(torch.isneginf(current), current, raised)
    return logits.index_put((rows.expand_as(current), cols.expand_as(current)), raised)


def min_tokens_masked(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """EOS / stop ids at ``-inf`` on rows below ``min_new_tokens`` (out of place)."""
    if batch.min_tokens_mask is None:
        return logits
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put((batch.min_tokens_mask[0], batch.min_tokens_mask[1]), neg_inf)


def min_tokens_kept_possible(before: torch.Tensor, masked: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``masked`` (the min_tokens ban applied to ``before``), except rows the ban left with no
    token at all: they keep ``before``.  Only a structured-output mask that allows nothing but
    EOS and stop ids does that; the grammar decides (it cannot go on any other way), as it
    does where it ends the output itself."""
    if batch.min_tokens_mask is None:
        return masked
    # Only the rows the ban touched can have lost their last token: look at those alone.
    rows = torch.unique(batch.min_tokens_mask[0])
    dead = rows[torch.isneginf(masked[rows]).all(dim=-1)]
    if dead.numel() == 0:
        return masked
    kept = masked.clone() if masked.data_ptr() == before.data_ptr() else masked
    kept[dead] = before[dead]
    return kept


def top_k_top_p_filtered(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Tokens outside each row's top-k / top-p set at ``-inf`` (see :func:`apply_top_k_top_p`)."""
    if not (batch.any_top_k or batch.any_top_p):
        return logits
    if not batch.any_top_p:
        # Top-k alone needs only the k-th largest value per row, not a vocabulary-wide sort.
        largest = logits.topk(batch.max_top_k, dim=-1).values
        kth_value = largest.gather(1, (batch.top_k - 1)[:, None])
        return logits.masked_fill(logits < kth_value, float("-inf"))
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    # Threshold at the k-th largest value: ties with it are kept.
    kth_value = sorted_logits.gather(1, (batch.top_k - 1)[:, None])
    remove_sorted = sorted_logits < kth_value
    sorted_probs = sorted_logits.masked_fill(remove_sorted, float("-inf")).softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p == 1 rows must stay untouched even when float cumsum overshoots 1.
    nucleus_active = (batch.top_p < 1.0)[:, None]
    # The mass before the first sorted token is exactly 0 < top_p, so it always survives.
    remove_sorted |= nucleus_active & (mass_before >= batch.top_p[:, None])
    remove = torch.zeros_like(remove_sorted).scatter_(1, sorted_ids, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def min_p_filtered(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Tokens with ``p < min_p * p_max`` at ``-inf``, compared as ``logit < max + log(min_p)``."""
    if not batch.any_min_p:
        return logits
    # log(0) = -inf: rows without min-p keep every token.
    threshold = logits.max(dim=-1, keepdim=True).values + torch.log(batch.min_p)[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Return float32 logits with each row's ``logit_bias`` values added to their tokens' logits.

    The input tensor is not modified.
    """
    check_logits(logits, batch)
    return biased(logits.to(torch.float32), batch)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Return float32 logits after repetition, frequency and presence penalties.

    Repetition (prompt + generated tokens): ``x / p`` where ``x > 0`` else ``x * p``.
    Frequency / presence (generated tokens only): ``x - f * count - r * (count > 0)``.
    The input tensor is not modified.
    """
    check_logits(logits, batch)
    return penalised(logits.to(torch.float32), batch)


def apply_exponential_decay(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Return float32 logits with the exponential decay length penalty applied.

    On a row with ``exponential_decay_start`` s and factor f that has generated g > s tokens,
    every EOS logit ``x`` becomes ``x + |x| * (f ** (g - s) - 1)`` (Hugging Face's
    ``ExponentialDecayLengthPenalty`` with the prompt length as its offset).
    """
    check_logits(logits, batch)
    return eos_decayed(logits.to(torch.float32), batch)


def apply_min_tokens_mask(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Return float32 logits with EOS / stop ids at ``-inf`` on rows below ``min_new_tokens``."""
    check_logits(logits, batch)
    before = logits.to(torch.float32)
    return min_tokens_kept_possible(before, min_tokens_masked(before, batch), batch)


def apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Return float32 logits with tokens outside each row's top-k / top-p set at ``-inf``.

    Top-p keeps the smallest prefix of the sorted distribution (after top-k) whose mass
    reaches ``top_p``; the most likely token is always kept.
    """
    check_logits(logits, batch)
    return top_k_top_p_filtered(logits.to(torch.float32), batch)
