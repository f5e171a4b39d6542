"""Per-request sampling parameters and their validation.

The meanings follow the OpenAI / vLLM conventions so that the HTTP layer can copy request
fields across unchanged:

* ``temperature`` 0 means greedy decoding; ``do_sample=False`` forces greedy as well.
* ``top_p`` in (0, 1] is nucleus sampling; ``top_k`` of -1 or 0 disables top-k.
* ``min_p`` in [0, 1] drops tokens less likely than ``min_p`` times the most likely one
  (vLLM semantics; 0 disables it).
* ``skip_special_tokens`` / ``include_stop_str_in_output`` shape the text, not the tokens:
  the detokenizer applies them.
* ``repetition_penalty`` uses Hugging Face semantics over prompt and generated tokens:
  positive logits of seen tokens are divided by it, negative ones multiplied.
* ``presence_penalty`` / ``frequency_penalty`` use OpenAI semantics over generated tokens
  only: ``logit -= frequency * count + presence * (count > 0)``; with ``input_penalty``
  (LightLLM) prompt tokens count too.
* ``logit_bias`` (OpenAI) maps token ids to a number in [-100, 100] added to that token's logit
  before anything else (penalties, masks, temperature); at most 300 entries.
* ``min_new_tokens`` keeps EOS and stop token ids masked until that many tokens exist.
* ``exponential_decay_start`` / ``exponential_decay_factor`` (LightLLM's
  ``exponential_decay_length_penalty``, Hugging Face's ``ExponentialDecayLengthPenalty``): once
  more than ``start`` tokens were generated, each EOS logit ``x`` becomes
  ``x + |x| * (factor ** (generated - start) - 1)``, so ending grows exponentially likelier.
* ``print_eos_token`` (LightLLM) shapes the text: the EOS token's text is part of the output
  even when ``skip_special_tokens`` drops other special tokens.

Besides its range, every number is checked in the width it is stored in (32-bit floats and
integers in shared memory; see :mod:`lightllm.common.sampling.storage_width`), so a value
accepted here reaches the model ranks unchanged in meaning.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from lightllm.common.sampling.ranges import NumberRange
from lightllm.common.sampling.storage_width import (
    GRAMMAR_BYTES,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    STOP_SEQUENCES_BYTES,
    check_stored_widths,
)

MAX_TOP_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16
MAX_SEED = 2**63 - 1
PENALTY_LIMIT = 2.0
# LightLLM's bounds on the decay factor: 1 leaves EOS alone; every factor above raises it.
MIN_DECAY_FACTOR = 1.0
MAX_DECAY_FACTOR = 10.0
# OpenAI's bound on a logit_bias value.
LOGIT_BIAS_LIMIT = 100.0

_PENALTY_RANGE = NumberRange(-PENALTY_LIMIT, PENALTY_LIMIT)
_LOGPROBS_RANGE = NumberRange(0, MAX_TOP_LOGPROBS)
# The range of every bounded number (an item of stop_token_ids for the list): validate checks these,
# and the HTTP request schemas publish them (lightllm.server.http.validation.base_models.sampling_bounds).
SAMPLING_RANGES: dict[str, NumberRange] = {
    "temperature": NumberRange(0.0),
    "top_p": NumberRange(0.0, 1.0, exclusive_minimum=True),
    "min_p": NumberRange(0.0, 1.0),
    # -1 and 0 disable top-k; every k from 1 keeps the k most likely tokens.
    "top_k": NumberRange(-1),
    "repetition_penalty": NumberRange(0.0, exclusive_minimum=True),
    "presence_penalty": _PENALTY_RANGE,
    "frequency_penalty": _PENALTY_RANGE,
    "seed": NumberRange(0, MAX_SEED),
    "max_new_tokens": NumberRange(1),
    "min_new_tokens": NumberRange(0),
    "logprobs": _LOGPROBS_RANGE,
    "prompt_logprobs": _LOGPROBS_RANGE,
    # Each id; the vocabulary bounds it from above once the model is known.
    "stop_token_ids": NumberRange(0),
    "exponential_decay_factor": NumberRange(MIN_DECAY_FACTOR, MAX_DECAY_FACTOR),
    "exponential_decay_start": NumberRange(0),
}


class SamplingParamError(ValueError):
    """A sampling parameter has the wrong type or an out-of-range value."""


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but ``top_k=True`` is almost certainly a client bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_number(name: str, value: Any) -> float:
    """Return ``value`` as a float, rejecting non-numbers, bools and NaN/inf."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise SamplingParamError(f"{name} must be finite, got {value!r}")
    return float(value)


def _check_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise SamplingParamError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    return value


def _check_range(name: str, value: float, shown: Any, range_text: str | None = None) -> None:
    """Refuse ``value`` outside ``name``'s range, quoting the client's ``shown`` value.

    ``range_text``: the range in other words where :meth:`NumberRange.describe` would read worse
    (``-1 or 0 (disabled) or >= 1`` for top_k).
    """
    bounds = SAMPLING_RANGES[name]
    if not bounds.holds(value):
        raise SamplingParamError(f"{name} must be {range_text or bounds.describe()}, got {shown}")


@dataclass
class SamplingParams:
    """How one request picks its next tokens.

    Construction validates every field (without a vocabulary size); call
    :meth:`validate` again with ``vocab_size`` once the model is known to also range-check
    ``stop_token_ids``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    do_sample: bool | None = None
    logprobs: int | None = None
    # Logprobs of the prompt's own tokens (with this many alternatives each), computed in the
    # prefill forward; None: not computed.
    prompt_logprobs: int | None = None
    stop_sequences: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # LightLLM's input_penalty: frequency / presence penalties count prompt tokens too.
    input_penalty: bool = False
    # Structured output: an llguidance grammar the generated tokens must follow (None: free text).
    grammar: str | None = None
    # LightLLM's print_eos_token: the EOS token's text is shown even when special tokens are skipped.
    print_eos_token: bool = False
    # LightLLM's exponential_decay_length_penalty = (start, factor); start None: no decay.
    exponential_decay_start: int | None = None
    exponential_decay_factor: float = 1.0
    # OpenAI's logit_bias: token id -> value added to its logit before sampling (empty: none).
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Accept tuples from callers but store lists, so to_dict/from_dict round-trip exactly.
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.stop_sequences, tuple):
            self.stop_sequences = list(self.stop_sequences)
        # to_dict writes logit_bias as [id, bias] pairs (JSON object keys would become strings).
        if isinstance(self.logit_bias, (list, tuple)):
            pairs = self.logit_bias
            if not all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in pairs):
                raise SamplingParamError("logit_bias must map token ids to numbers (or be a list of [id, bias] pairs)")
            self.logit_bias = {token_id: bias for token_id, bias in pairs}
        self.validate()

    @property
    def is_greedy(self) -> bool:
        """True when the request always takes the arg-max token (temperature 0 or do_sample=False)."""
        return self.do_sample is False or self.temperature == 0

    @property
    def top_k_enabled(self) -> bool:
        """True when ``top_k`` restricts the candidate set."""
        return self.top_k > 0

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every field; raise :class:`SamplingParamError` naming the first bad one.

        Args:
            vocab_size: when given, ``stop_token_ids`` must lie in ``[0, vocab_size)``.
        """
        if vocab_size is not None and (not _is_int(vocab_size) or vocab_size <= 0):
            raise SamplingParamError(f"vocab_size must be a positive integer, got {vocab_size!r}")

        for name in ("temperature", "top_p", "min_p"):
            _check_range(name, _check_number(name, getattr(self, name)), getattr(self, name))

        top_k = _check_int("top_k", self.top_k)
        _check_range("top_k", top_k, top_k, "-1 or 0 (disabled) or >= 1")

        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            _check_range(name, _check_number(name, getattr(self, name)), getattr(self, name))

        if self.seed is not None:
            seed = _check_int("seed", self.seed)
            # 2**63 - 1 as a power: describe() would print it as 9.22337e+18.
            _check_range("seed", seed, seed, "in [0, 2**63 - 1]")

        max_new_tokens = _check_int("max_new_tokens", self.max_new_tokens)
        _check_range("max_new_tokens", max_new_tokens, max_new_tokens)

        min_new_tokens = _check_int("min_new_tokens", self.min_new_tokens)
        _check_range("min_new_tokens", min_new_tokens, min_new_tokens)
        if min_new_tokens > max_new_tokens:
            raise SamplingParamError(
                f"min_new_tokens must be <= max_new_tokens ({max_new_tokens}), got {min_new_tokens}"
            )

        self._validate_stop_token_ids(vocab_size)
        self._validate_logit_bias(vocab_size)

        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "input_penalty", "print_eos_token"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.do_sample is not None and not isinstance(self.do_sample, bool):
            raise SamplingParamError(f"do_sample must be a bool or None, got {type(self.do_sample).__name__}")

        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                count = _check_int(name, getattr(self, name))
                _check_range(name, count, count)

        self._validate_exponential_decay()

        if self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar:
                raise SamplingParamError("grammar must be a non-empty string or None")
            if len(self.grammar.encode()) > GRAMMAR_BYTES:
                raise SamplingParamError(f"grammar must take at most {GRAMMAR_BYTES} bytes encoded")

        self._validate_stop_sequences()
        check_stored_widths(vars(self), SamplingParamError)

    def _validate_exponential_decay(self) -> None:
        factor = _check_number("exponential_decay_factor", self.exponential_decay_factor)
        _check_range("exponential_decay_factor", factor, self.exponential_decay_factor)
        if self.exponential_decay_start is not None:
            start = _check_int("exponential_decay_start", self.exponential_decay_start)
            _check_range("exponential_decay_start", start, start)

    def _validate_stop_token_ids(self, vocab_size: int | None) -> None:
        if not isinstance(self.stop_token_ids, list):
            raise SamplingParamError(
                f"stop_token_ids must be a list of integers, got {type(self.stop_token_ids).__name__}"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamError(
                f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} entries, got {len(self.stop_token_ids)}"
            )
        for token_id in self.stop_token_ids:
            if not _is_int(token_id):
                raise SamplingParamError(f"stop_token_ids must contain integers, got {token_id!r}")
            _check_range("stop_token_ids", token_id, token_id)
            if vocab_size is not None and token_id >= vocab_size:
                raise SamplingParamError(
                    f"stop_token_ids must be < vocab_size ({vocab_size}), got {token_id}"
                )

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if not isinstance(self.logit_bias, dict):
            raise SamplingParamError(f"logit_bias must map token ids to numbers, got {type(self.logit_bias).__name__}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingParamError(f"logit_bias holds at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for token_id, bias in self.logit_bias.items():
            if not _is_int(token_id):
                raise SamplingParamError(f"logit_bias keys must be token ids (integers), got {token_id!r}")
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise SamplingParamError(f"logit_bias token id {token_id} is outside the vocabulary {bound}")
            value = _check_number(f"logit_bias[{token_id}]", bias)
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise SamplingParamError(f"logit_bias[{token_id}] must be in [-100, 100], got {bias}")
        check_stored_widths({"logit_bias_ids": list(self.logit_bias), "logit_bias_values": list(self.logit_bias.values())},
                            SamplingParamError)

    def _validate_stop_sequences(self) -> None:
        if not isinstance(self.stop_sequences, list):
            raise SamplingParamError(
                f"stop_sequences must be a list of strings, got {type(self.stop_sequences).__name__}"
            )
        if len(self.stop_sequences) > MAX_STOP_SEQUENCES:
            raise SamplingParamError(
                f"stop_sequences must hold at most {MAX_STOP_SEQUENCES} entries, "
                f"got {len(self.stop_sequences)}"
            )
        for sequence in self.stop_sequences:
            if not isinstance(sequence, str):
                raise SamplingParamError(f"stop_sequences must contain strings, got {sequence!r}")
            if not sequence:
                raise SamplingParamError("stop_sequences must not contain empty strings")
        # Stored JSON-encoded in a fixed-size field of the shared-memory record.
        encoded_size = len(json.dumps(self.stop_sequences).encode())
        if encoded_size > STOP_SEQUENCES_BYTES:
            raise SamplingParamError(
                f"stop_sequences must take at most {STOP_SEQUENCES_BYTES} bytes JSON-encoded, got {encoded_size}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain-data copy of every field (lists are copied, not shared; ``logit_bias`` as [id, bias]
        pairs, so the copy survives JSON)."""
        data: dict[str, Any] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            data[item.name] = list(value) if isinstance(value, list) else value
        data["logit_bias"] = [[token_id, bias] for token_id, bias in self.logit_bias.items()]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SamplingParams":
        """Build validated params from a mapping; unknown keys are rejected by name.

        Missing keys take their defaults, so ``from_dict({})`` equals ``SamplingParams()``.
        """
        if not isinstance(data, Mapping):
            raise SamplingParamError(f"sampling params must be a mapping, got {type(data).__name__}")
        known = {item.name for item in fields(cls)}
        unknown = sorted(str(key) for key in data if key not in known)
        if unknown:
            raise SamplingParamError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        copied = {key: list(value) if isinstance(value, (list, tuple)) else value for key, value in data.items()}
        return cls(**copied)
