"""Batched, vectorised next-token selection.

One decode step turns ``logits[B, V]`` into one token per row.  Per-row parameters are packed
into tensors once per batch (:class:`SamplingBatch`), so every step is a single pass of
tensor ops over the whole batch; Python loops only over rows while building the batch and
for rows that carry their own seed.

Processing order (each step works on a float32 copy; the caller's logits are never modified):

0. ``logit_bias`` (:func:`apply_logit_bias`): each row's biases added to its logits, before
   everything else, as vLLM applies them;
1. penalties (:func:`apply_penalties`): repetition penalty over prompt + generated tokens,
   then frequency / presence penalties over generated tokens;
2. the exponential decay length penalty (:func:`apply_exponential_decay`): EOS logits raised
   on rows past their start, before the EOS mask below so a masked EOS stays masked;
3. ``min_new_tokens`` (:func:`apply_min_tokens_mask`): EOS and stop ids set to ``-inf`` for
   rows that have generated fewer tokens than required, unless they are all a row has left (a
   structured-output grammar that allows only them): then that row keeps them;
4. greedy rows take the arg-max here;
5. temperature scaling (of each logit's distance to its row's largest, so that a tiny
   temperature cannot overflow the largest ones into a tie); with ``scaled_logprobs`` (the
   default) the returned log-probabilities are ``log_softmax`` of this scaled distribution,
   *before* min-p / top-k / top-p filtering (greedy rows use temperature 1); with
   ``raw_logprobs`` of the logits as the forward returned them;
6. min-p filtering (tokens less likely than ``min_p`` times the most likely one are dropped),
   then top-k then top-p filtering (:func:`apply_top_k_top_p`), in vLLM's order: top-p's
   nucleus is then taken from the distribution min-p left, renormalised (after top-p the
   nucleus of ``min_p = 0.2, top_p = 0.3`` kept 7 tokens where vLLM keeps 1); then inverse-CDF
   sampling picks the token: with ``u ~ U(0, 1)`` per row, the first token whose cumulative
   probability exceeds ``u`` (times the total) is chosen, which selects token ``i`` with
   probability ``probs[i]``; with ``processed_logprobs`` (vLLM's meaning) the returned
   log-probabilities are ``log_softmax`` of this filtered distribution (a greedy row's: of its
   distribution at temperature 1, unfiltered, as vLLM reports greedy rows).

Seeded rows draw ``u`` from their own generator, seeded from ``(seed, tokens generated so
far)``, so the draw a request gets does not depend on which other requests share the batch. The
probabilities it is compared with come from a forward whose float sums may differ in the last
bits with the batch (about 1e-5 in a logprob), so a draw that lands within that of the boundary
between two tokens can pick the neighbour: rare, and rarer the more peaked the distribution (no
flip in ~6,000 seeded draws of the demo model measured; one in ~750 on a near-uniform 4096-token
vocabulary), but a seeded request is reproducible exactly only in the same batch, and a request
preempted and recomputed is in another batch.
"""

from __future__ import annotations

import torch

from lightllm.common.sampling.logit_processors import (
    biased,
    check_logits,
    eos_decayed,
    min_p_filtered,
    min_tokens_kept_possible,
    min_tokens_masked,
    penalised,
    top_k_top_p_filtered,
    within_float32,
)
from lightllm.common.sampling.logprobs_mode import DEFAULT_LOGPROBS_MODE, LOGPROBS_MODES, PROCESSED_LOGPROBS, RAW_LOGPROBS
from lightllm.common.sampling.sampler_output import SamplerOutput
from lightllm.common.sampling.sampling_batch import SamplingBatch

_FLOAT32_MAX = torch.finfo(torch.float32).max


class Sampler:
    """Picks next tokens for a :class:`SamplingBatch`.

    Unseeded rows draw randomness from a generator owned by this sampler (one per device,
    seeded with ``seed`` when given, otherwise from the OS entropy pool).  ``logprobs_mode``
    says what the returned logprobs describe (:mod:`~lightllm.common.sampling.logprobs_mode`):
    ``scaled_logprobs`` (default, as LightLLM) bias, penalties, masks and temperature applied,
    before min-p / top-k / top-p; ``processed_logprobs`` (vLLM's) the filtered distribution the
    token was drawn from; ``raw_logprobs`` (vLLM's default) the model's own, ``log_softmax`` of
    the logits as the forward returned them.
    """

    def __init__(self, seed: int | None = None, logprobs_mode: str = DEFAULT_LOGPROBS_MODE) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self._seed = seed
        self._logprobs_mode = logprobs_mode
        self._generators: dict[torch.device, torch.Generator] = {}
        # Re-seeded for every seeded row; reseeding resets its whole state, so reusing one
        # generator draws exactly what a fresh one would, without creating one per row.
        self._row_generators: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator

    def _uniforms(self, batch: SamplingBatch, device: torch.device) -> torch.Tensor:
        # One uniform draw per row is all inverse-CDF sampling needs, so a seeded row costs one
        # tiny generator call instead of a vocabulary-wide noise tensor.
        uniforms = torch.empty(batch.size, dtype=torch.float64, device=device)
        if len(batch.seeded_rows) < batch.size:
            uniforms.uniform_(generator=self._shared_generator(device))
        if batch.seeded_rows:
            row_generator = self._row_generators.get(device)
            if row_generator is None:
                row_generator = self._row_generators[device] = torch.Generator(device=device)
            for row, step_seed in batch.seeded_rows:
                row_generator.manual_seed(step_seed)
                uniforms[row : row + 1].uniform_(generator=row_generator)
        return uniforms

    def _draw(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Inverse-CDF sampling: the first token whose cumulative probability exceeds u * total."""
        cdf = probs.to(torch.float64).cumsum(dim=-1)
        targets = self._uniforms(batch, probs.device) * cdf[:, -1]
        ids = torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1)
        # u * total can round up to the total itself; the last token with mass is then the pick.
        return ids.clamp_(max=probs.shape[1] - 1)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Choose one token per row of ``logits[B, V]`` (any float dtype; computed in float32)."""
        check_logits(logits, batch)
        # Every processor below works out of place, so this stays the forward's own logits.
        raw = logits.to(torch.float32)
        processed = eos_decayed(penalised(biased(raw, batch), batch), batch)
        processed = min_tokens_kept_possible(processed, min_tokens_masked(processed, batch), batch)
        greedy_ids = processed.argmax(dim=-1)
        if batch.all_greedy:
            # Every temperature of an all-greedy batch is 1 (x / 1 == x), so no finite logit can
            # overflow here and an entry is -inf only where a processor masked it: clamping +inf
            # alone equals within_float32(processed, isneginf(processed)), at a fifth of its cost.
            # A logit is +inf only when the forward overflowed; the clamp copies the whole block,
            # the max only reads it.
            overflowed = bool(processed.max() == float("inf"))
            scaled = processed.clamp(max=_FLOAT32_MAX) if overflowed else processed
        else:
            # Divided relative to the row's largest logit, which stays at 0: a tiny temperature
            # then pushes the others towards -inf (clamped to the float32 floor), the greedy
            # limit it asks for.  Divided as they were, every logit above T * 3.4e38 overflowed
            # to +inf and clamped to the same largest float32, and those tokens tied (14 of them
            # drawn evenly at T = 1.2e-38).  Softmax and its logprobs do not change with the shift.
            masked = torch.isneginf(processed)
            finite = processed.clamp(max=_FLOAT32_MAX)
            row_max = finite.amax(dim=-1, keepdim=True).clamp(min=-_FLOAT32_MAX)
            scaled = within_float32((finite - row_max) / batch.temperatures[:, None], masked)
        if self._logprobs_mode == RAW_LOGPROBS:
            # A logit the forward overflowed to +inf is clamped as the greedy path does; a -inf
            # one is the model's own zero probability.
            logprobs = torch.log_softmax(raw.clamp(max=_FLOAT32_MAX), dim=-1)
        else:
            logprobs = torch.log_softmax(scaled, dim=-1)

        if batch.all_greedy:
            next_ids = greedy_ids
        else:
            filtered = top_k_top_p_filtered(min_p_filtered(scaled, batch), batch)
            sampled_ids = self._draw(filtered.softmax(dim=-1), batch)
            next_ids = torch.where(batch.greedy_mask, greedy_ids, sampled_ids)
            if self._logprobs_mode == PROCESSED_LOGPROBS:
                # Greedy rows keep their unfiltered distribution (filters do not apply to them).
                logprobs = torch.where(batch.greedy_mask[:, None], logprobs, torch.log_softmax(filtered, dim=-1))
        return SamplerOutput.from_logprobs(next_ids, logprobs, batch.top_logprobs_counts)
