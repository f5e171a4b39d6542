"""Batched, vectorised next-token selection.

One decode step turns ``logits[B, V]`` into one token per row.  Per-row parameters are packed
into tensors once per batch (:class:`SamplingBatch`), so every step is a single pass of
tensor ops over the whole batch; Python loops only over rows while building the batch and
for rows that carry their own seed.

Processing order (each step works on a float32 copy; the caller's logits are never modified):

1. penalties (:func:`apply_penalties`): repetition penalty over prompt + generated tokens,
   then frequency / presence penalties over generated tokens;
2. ``min_new_tokens`` (:func:`apply_min_tokens_mask`): EOS and stop ids set to ``-inf`` for
   rows that have generated fewer tokens than required;
3. greedy rows take the arg-max here;
4. temperature scaling; the returned log-probabilities are ``log_softmax`` of this scaled
   distribution, i.e. *before* top-k / top-p filtering (greedy rows use temperature 1);
5. top-k then top-p filtering (:func:`apply_top_k_top_p`), then min-p filtering (tokens less
   likely than ``min_p`` times the most likely one are dropped; the ratio is the same before
   and after top-k / top-p, which always keep the most likely token), then inverse-CDF sampling picks
   the token: with ``u ~ U(0, 1)`` per row, the first token whose cumulative probability
   exceeds ``u`` (times the total) is chosen, which selects token ``i`` with probability
   ``probs[i]``.

Seeded rows draw ``u`` from their own generator, seeded from ``(seed, tokens generated so
far)``, so a request reproduces its output no matter which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from lightllm.common.sampling.sampling_params import SamplingParamError, SamplingParams

_MASK64 = (1 << 64) - 1
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _within_float32(values: torch.Tensor, masked: torch.Tensor | None = None) -> torch.Tensor:
    """Clamp values that overflowed to +-inf back to the largest float32; keep masked entries -inf.

    A tiny temperature or repetition penalty can push a logit past the float32 range, and
    ``inf - inf`` inside softmax would turn the whole row into NaN (a garbage token).  Clamped,
    the row's largest logit simply dominates, which is the limit the tiny value asks for.
    """
    bounded = values.clamp(min=-_FLOAT32_MAX, max=_FLOAT32_MAX)
    if masked is not None:
        bounded = bounded.masked_fill(masked, float("-inf"))
    return bounded


def derive_step_seed(seed: int, step: int) -> int:
    """Mix a request seed and its generation step into an independent 64-bit generator seed.

    A plain ``seed + step`` would make request ``seed=1`` at step 0 replay request ``seed=0``
    at step 1; the splitmix64 finaliser decorrelates neighbouring inputs.
    """
    value = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _padded_ids(rows: list[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Right-pad token id lists into one ``LongTensor[B, max_len]``."""
    width = max(len(row) for row in rows)
    padded = [list(row) + [pad] * (width - len(row)) for row in rows]
    return torch.tensor(padded, dtype=torch.long, device=device).reshape(len(rows), width)


def _check_ids_in_vocab(name: str, row: int, ids: Sequence[int], vocab_size: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"{name}[{row}] holds a token id outside [0, {vocab_size})")


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
    seen_token_ids: torch.Tensor | None  # long[B, L] prompt + output ids, padded with V
    output_token_ids: torch.Tensor | None  # long[B, L] output ids, padded with V
    min_tokens_mask_rows: torch.Tensor | None  # long[M] row of each masked (row, token) pair
    min_tokens_mask_cols: torch.Tensor | None  # long[M] token of each masked pair
    seeded_rows: list[tuple[int, int]]  # (row, generator seed for this step), sampled rows only
    top_logprobs_counts: list[int]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool = False

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        eos_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> "SamplingBatch":
        """Pack one step's requests.

        Args:
            params: one :class:`SamplingParams` per row.
            prompt_ids: each row's prompt token ids.
            output_ids: each row's generated token ids so far (its length is the step index
                used for seeding and for ``min_new_tokens``).
            eos_token_ids: the model's EOS ids; masked while ``min_new_tokens`` is unmet,
                except on ``ignore_eos`` rows where EOS is not a stop token.
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
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        eos = list(eos_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in eos):
            raise ValueError(f"eos_token_ids must be integers in [0, {vocab_size}), got {eos}")
        device = torch.device(device)

        temperatures: list[float] = []
        greedy: list[bool] = []
        top_k: list[int] = []
        top_p: list[float] = []
        seen_rows: list[list[int]] = []
        output_rows: list[Sequence[int]] = []
        mask_rows: list[int] = []
        mask_cols: list[int] = []
        seeded_rows: list[tuple[int, int]] = []
        for row, param in enumerate(params):
            if not isinstance(param, SamplingParams):
                raise ValueError(f"params[{row}] must be SamplingParams, got {type(param).__name__}")
            is_greedy = param.is_greedy
            greedy.append(is_greedy)
            temperatures.append(1.0 if is_greedy else float(param.temperature))
            top_k.append(min(param.top_k, vocab_size) if param.top_k_enabled else vocab_size)
            top_p.append(float(param.top_p))
            generated = output_ids[row]
            # Rows whose penalty is neutral get an empty history: less padding, same result.
            if param.repetition_penalty != 1.0:
                _check_ids_in_vocab("prompt_ids", row, prompt_ids[row], vocab_size)
                _check_ids_in_vocab("output_ids", row, generated, vocab_size)
                seen_rows.append([*prompt_ids[row], *generated])
            else:
                seen_rows.append([])
            if param.presence_penalty != 0.0 or param.frequency_penalty != 0.0:
                _check_ids_in_vocab("output_ids", row, generated, vocab_size)
                if param.input_penalty:
                    _check_ids_in_vocab("prompt_ids", row, prompt_ids[row], vocab_size)
                    output_rows.append([*prompt_ids[row], *generated])
                else:
                    output_rows.append(generated)
            else:
                output_rows.append([])
            if len(generated) < param.min_new_tokens:
                banned = set(param.stop_token_ids) if param.ignore_eos else set(eos) | set(param.stop_token_ids)
                for token_id in sorted(banned):
                    if token_id >= vocab_size:
                        raise SamplingParamError(
                            f"stop_token_ids must be < vocab_size ({vocab_size}), got {token_id}"
                        )
                    mask_rows.append(row)
                    mask_cols.append(token_id)
            if param.seed is not None and not is_greedy:
                seeded_rows.append((row, derive_step_seed(param.seed, len(generated))))

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        any_seen = any(seen_rows)
        any_output = any(output_rows)
        return cls(
            size=size,
            vocab_size=vocab_size,
            device=device,
            temperatures=floats(temperatures),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=longs(top_k),
            top_p=floats(top_p),
            min_p=floats([float(p.min_p) for p in params]),
            repetition_penalties=floats([float(p.repetition_penalty) for p in params]),
            presence_penalties=floats([float(p.presence_penalty) for p in params]),
            frequency_penalties=floats([float(p.frequency_penalty) for p in params]),
            seen_token_ids=_padded_ids(seen_rows, vocab_size, device) if any_seen else None,
            output_token_ids=_padded_ids(output_rows, vocab_size, device) if any_output else None,
            min_tokens_mask_rows=longs(mask_rows) if mask_rows else None,
            min_tokens_mask_cols=longs(mask_cols) if mask_cols else None,
            seeded_rows=seeded_rows,
            top_logprobs_counts=[min(p.logprobs or 0, vocab_size) for p in params],
            all_greedy=all(greedy),
            any_top_k=any(k < vocab_size for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
            any_min_p=any(p.min_p > 0.0 for p in params),
        )


def _check_logits(logits: torch.Tensor, batch: SamplingBatch) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point tensor")
    if tuple(logits.shape) != (batch.size, batch.vocab_size):
        raise ValueError(
            f"logits must have shape ({batch.size}, {batch.vocab_size}) to match the batch, "
            f"got {tuple(logits.shape)}"
        )
    if logits.device != batch.device:
        raise ValueError(f"logits are on {logits.device} but the batch was built for {batch.device}")


def _penalised(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Out-of-place penalties on float32 logits (see :func:`apply_penalties`)."""
    padded_width = batch.vocab_size + 1  # the extra column absorbs padding ids
    if batch.seen_token_ids is not None:
        seen = torch.zeros(batch.size, padded_width, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, batch.seen_token_ids, True)
        seen = seen[:, : batch.vocab_size]
        penalty = batch.repetition_penalties[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = _within_float32(torch.where(seen, penalised, logits))
    if batch.output_token_ids is not None:
        ids = batch.output_token_ids
        counts = torch.zeros(batch.size, padded_width, dtype=torch.float32, device=logits.device)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=logits.device))
        counts = counts[:, : batch.vocab_size]
        logits = (
            logits
            - batch.frequency_penalties[:, None] * counts
            - batch.presence_penalties[:, None] * (counts > 0).to(torch.float32)
        )
    return logits


def _min_tokens_masked(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.min_tokens_mask_rows is None:
        return logits
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put((batch.min_tokens_mask_rows, batch.min_tokens_mask_cols), neg_inf)


def _top_k_top_p_filtered(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if not (batch.any_top_k or batch.any_top_p):
        return logits
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    # Threshold at the k-th largest value: ties with it are kept.
    kth_value = sorted_logits.gather(1, (batch.top_k - 1)[:, None])
    remove_sorted = sorted_logits < kth_value
    if batch.any_top_p:
        sorted_probs = sorted_logits.masked_fill(remove_sorted, float("-inf")).softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # top_p == 1 rows must stay untouched even when float cumsum overshoots 1.
        nucleus_active = (batch.top_p < 1.0)[:, None]
        # The mass before the first sorted token is exactly 0 < top_p, so it always survives.
        remove_sorted |= nucleus_active & (mass_before >= batch.top_p[:, None])
    remove = torch.zeros_like(remove_sorted).scatter_(1, sorted_ids, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def _min_p_filtered(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Tokens with ``p < min_p * p_max`` at ``-inf``, compared as ``logit < max + log(min_p)``."""
    if not batch.any_min_p:
        return logits
    # log(0) = -inf: rows without min-p keep every token.
    threshold = logits.max(dim=-1, keepdim=True).values + torch.log(batch.min_p)[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Return float32 logits after repetition, frequency and presence penalties.

    Repetition (prompt + generated tokens): ``x / p`` where ``x > 0`` else ``x * p``.
    Frequency / presence (generated tokens only): ``x - f * count - r * (count > 0)``.
    The input tensor is not modified.
    """
    _check_logits(logits, batch)
    return _penalised(logits.to(torch.float32), batch)


def apply_min_tokens_mask(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Return float32 logits with EOS / stop ids at ``-inf`` on rows below ``min_new_tokens``."""
    _check_logits(logits, batch)
    return _min_tokens_masked(logits.to(torch.float32), batch)


def apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Return float32 logits with tokens outside each row's top-k / top-p set at ``-inf``.

    Top-p keeps the smallest prefix of the sorted distribution (after top-k) whose mass
    reaches ``top_p``; the most likely token is always kept.
    """
    _check_logits(logits, batch)
    return _top_k_top_p_filtered(logits.to(torch.float32), batch)


@dataclass
class SamplerOutput:
    """Result of one sampling step.

    ``logprobs`` are log-softmax values of the penalised, temperature-scaled distribution
    (before top-k / top-p).  ``top_logprob_ids`` / ``top_logprobs`` have width
    ``max(top_logprobs_counts)``; row ``i`` asked for ``top_logprobs_counts[i]`` of them.
    """

    next_token_ids: torch.Tensor  # long[B]
    logprobs: torch.Tensor  # float32[B]
    top_logprob_ids: torch.Tensor | None  # long[B, N]
    top_logprobs: torch.Tensor | None  # float32[B, N]
    top_logprobs_counts: list[int]

    def row_top_logprobs(self, row: int) -> list[tuple[int, float]]:
        """The ``(token_id, logprob)`` pairs row ``row`` requested, most likely first."""
        count = self.top_logprobs_counts[row]
        if count == 0 or self.top_logprob_ids is None or self.top_logprobs is None:
            return []
        ids = self.top_logprob_ids[row, :count].tolist()
        values = self.top_logprobs[row, :count].tolist()
        return list(zip(ids, values))


class Sampler:
    """Picks next tokens for a :class:`SamplingBatch`.

    Unseeded rows draw randomness from a generator owned by this sampler (one per device,
    seeded with ``seed`` when given, otherwise from the OS entropy pool).
    """

    def __init__(self, seed: int | None = None) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

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
        for row, step_seed in batch.seeded_rows:
            row_generator = torch.Generator(device=device)
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
        _check_logits(logits, batch)
        processed = _min_tokens_masked(_penalised(logits.to(torch.float32), batch), batch)
        greedy_ids = processed.argmax(dim=-1)
        scaled = _within_float32(processed / batch.temperatures[:, None], torch.isneginf(processed))
        logprobs = torch.log_softmax(scaled, dim=-1)

        if batch.all_greedy:
            next_ids = greedy_ids
        else:
            probs = _min_p_filtered(_top_k_top_p_filtered(scaled, batch), batch).softmax(dim=-1)
            sampled_ids = self._draw(probs, batch)
            next_ids = torch.where(batch.greedy_mask, greedy_ids, sampled_ids)

        chosen = logprobs.gather(1, next_ids[:, None]).squeeze(1)
        width = max(batch.top_logprobs_counts)
        top_values: torch.Tensor | None = None
        top_ids: torch.Tensor | None = None
        if width > 0:
            top_values, top_ids = logprobs.topk(width, dim=-1)
        return SamplerOutput(
            next_token_ids=next_ids,
            logprobs=chosen,
            top_logprob_ids=top_ids,
            top_logprobs=top_values,
            top_logprobs_counts=list(batch.top_logprobs_counts),
        )
