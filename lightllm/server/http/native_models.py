"""Request schemas of LightLLM's native ``/generate`` and ``/generate_stream`` endpoints (and its ``/tokens``).

Strict like every request schema (:class:`~lightllm.server.http.validation.base_models.StrictModel`: no coercion,
unknown keys rejected with a 400 naming them), with LightLLM's own parameter names and defaults;
``null`` is the same as leaving a field out, on every field (as on the OpenAI endpoints).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from lightllm.common.basemodel.generation_defaults import GenerationDefaults
from lightllm.common.sampling import MAX_STOP_SEQUENCES
from lightllm.common.sampling.sampling_params import MAX_DECAY_FACTOR, MIN_DECAY_FACTOR
from lightllm.server.http.validation.body import json_type_name
from lightllm.server.http.errors import invalid_request
from lightllm.server.http.generation.completion_prompt import (TOKEN_IDS_SCHEMA, integral_token_ids, is_token_id,
                                                               is_token_list, shown_json_value)
from lightllm.server.http.structured.structured_params import (GUIDED_JSON_SCHEMA, NATIVE_CONSTRAINTS,
                                                               native_constraint_grammar)
from lightllm.server.http.validation.base_models import (MAX_N, STOP_TOKEN_IDS_SCHEMA, NullMeansAbsent, integral,
                                                         sampling_bounds, stop_validator, string_or_strings_schema)


INT32_MAX = 2**31 - 1
_MULTIMODAL_KEYS = frozenset({"images", "audios"})
# Sampling fields a request inherits from the checkpoint's generation_config.json when it leaves them out.
_CHECKPOINT_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                         "frequency_penalty")
# Each sampling field's value that changes nothing (no filter, no scaling): giving it asks for no
# sampling, as in TGI, whose sampler runs only when a warper would change the distribution.
_NEUTRAL_SAMPLING_VALUES = {"temperature": (1.0,), "top_p": (1.0,), "top_k": (-1, 0), "min_p": (0.0,)}
# ``inputs`` is typed ``Any`` (validated by hand, as /v1/completions' prompt): its schema for the OpenAPI document.
_INPUTS_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1}, TOKEN_IDS_SCHEMA]}


class NativeParameters(NullMeansAbsent):
    """``parameters`` of LightLLM's ``/generate`` and ``/generate_stream``.

    Names follow SamplingParams; range checks happen there (with their messages), and the schema
    publishes the ranges that check reads (:func:`sampling_bounds`). ``logprobs`` is the number of
    top alternatives per token reported in ``details`` (stream events carry the chosen
    token's logprob regardless).
    """

    # None: see sampling_fields (LightLLM's greedy default, unless the request or the checkpoint asks to sample).
    do_sample: bool | None = None
    # None: the checkpoint's generation_config.json value, else SamplingParams' default.
    temperature: float | None = Field(default=None, **sampling_bounds("temperature"))
    top_p: float | None = Field(default=None, **sampling_bounds("top_p"))
    top_k: int | None = Field(default=None, **sampling_bounds("top_k"))
    min_p: float | None = Field(default=None, **sampling_bounds("min_p"))
    repetition_penalty: float | None = Field(default=None, **sampling_bounds("repetition_penalty"))
    presence_penalty: float | None = Field(default=None, **sampling_bounds("presence_penalty"))
    frequency_penalty: float | None = Field(default=None, **sampling_bounds("frequency_penalty"))
    seed: int | None = Field(default=None, **sampling_bounds("seed"))
    max_new_tokens: int | None = Field(default=None, **sampling_bounds("max_new_tokens"))
    min_new_tokens: int = Field(default=0, **sampling_bounds("min_new_tokens"))
    stop_sequences: Any = Field(default=None, validate_default=True,
                                json_schema_extra=string_or_strings_schema(MAX_STOP_SEQUENCES))
    stop_token_ids: list[int] = Field(default_factory=list, json_schema_extra=STOP_TOKEN_IDS_SCHEMA)
    ignore_eos: bool = False
    return_details: bool = False
    logprobs: int | None = Field(default=None, **sampling_bounds("logprobs"))
    # LightLLM's own parameters.
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    skip_special_tokens: bool = True
    add_special_tokens: bool = True
    input_penalty: bool = False
    print_eos_token: bool = False
    # (start_index, decay_factor): once more than start_index tokens exist, EOS logits grow by
    # decay_factor ** (generated - start_index) (Hugging Face's ExponentialDecayLengthPenalty).
    # LightLLM's structured output: a regular expression, a grammar (llguidance's Lark syntax;
    # LightLLM's xgrammar backend takes GBNF) or a JSON schema (an object or a string holding one).
    regular_constraint: str | None = None
    # Not Field(min_length=1): "" is refused by the grammar check, with its own message.
    guided_grammar: str | None = Field(default=None, json_schema_extra={"minLength": 1})
    guided_json: Any = Field(default=None, json_schema_extra=GUIDED_JSON_SCHEMA)
    exponential_decay_length_penalty: Any = Field(default=None, json_schema_extra={
        "type": "array", "minItems": 2, "maxItems": 2, "prefixItems": [
            {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
            {"type": "number", "minimum": MIN_DECAY_FACTOR, "maximum": MAX_DECAY_FACTOR}]})

    _check_stop = stop_validator("stop_sequences", MAX_STOP_SEQUENCES)

    @field_validator("exponential_decay_length_penalty")
    @classmethod
    def _check_decay(cls, value: Any) -> tuple[int, float] | None:
        # LightLLM's (start_index, decay_factor); JSON sends it as a two-item list.
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ValueError("exponential_decay_length_penalty must be [start_index, decay_factor] or null")
        start, factor = integral(value[0]), value[1]
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= INT32_MAX:
            raise ValueError(f"exponential_decay_length_penalty start_index must be an integer in [0, {INT32_MAX}], got {start!r}")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not MIN_DECAY_FACTOR <= factor <= MAX_DECAY_FACTOR:
            raise ValueError(
                f"exponential_decay_length_penalty decay_factor must be a number in [{MIN_DECAY_FACTOR:g}, {MAX_DECAY_FACTOR:g}], got {factor!r}"
            )
        return (start, float(factor))

    def check_consistency(self) -> None:
        """Refuse ``best_of`` below ``n`` (a 400 naming ``parameters.best_of``)."""
        if self.best_of is not None and self.best_of < self.n:
            raise invalid_request(f"best_of ({self.best_of}) must be >= n ({self.n})", "parameters.best_of")

    @property
    def candidates(self) -> int:
        """Generations run: ``best_of`` when given (the ``n`` most likely are returned), else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    def sampling_fields(self, defaults: GenerationDefaults) -> dict[str, Any]:
        """SamplingParams keyword arguments over the checkpoint's ``defaults`` (max_new_tokens is resolved by the caller).

        Without ``do_sample`` a request samples when it sets temperature, top_p, top_k or min_p to
        a value that changes the distribution (TGI's rule: such a field is never silently ignored;
        a neutral one, ``temperature`` 1 or ``top_k`` -1, asks for nothing), else when the
        checkpoint's ``do_sample`` says so, else it is greedy (LightLLM's default).
        """
        fields = self.model_dump(exclude={"return_details", "max_new_tokens", "n", "best_of", "add_special_tokens",
                                          "exponential_decay_length_penalty", *NATIVE_CONSTRAINTS,
                                          *_CHECKPOINT_DEFAULTED})
        own = {name: getattr(self, name) for name in _CHECKPOINT_DEFAULTED if getattr(self, name) is not None}
        fields.update({**defaults.sampling_fields(), **own})
        if self.do_sample is None:
            asks_to_sample = any(name in own and own[name] not in neutral
                                 for name, neutral in _NEUTRAL_SAMPLING_VALUES.items())
            fields["do_sample"] = asks_to_sample or bool(defaults.do_sample)
        if self.exponential_decay_length_penalty is not None:
            fields["exponential_decay_start"], fields["exponential_decay_factor"] = self.exponential_decay_length_penalty
        fields["grammar"] = native_constraint_grammar({name: getattr(self, name) for name in NATIVE_CONSTRAINTS})
        return fields


class NativeGenerateRequest(NullMeansAbsent):
    """Body of ``/generate`` and ``/generate_stream``.

    ``inputs`` is the prompt: a text, or its token ids (LightLLM's HTTP manager takes a list of
    ints for clients that tokenize themselves), taken as /v1/completions takes a token-id prompt;
    the vocabulary is checked with the served model. ``high_priority_request`` is the router
    admission flag; inference-side priority is internal and cannot be set from here.
    """

    inputs: Any = Field(json_schema_extra=_INPUTS_SCHEMA)
    parameters: NativeParameters = Field(default_factory=NativeParameters)
    high_priority_request: bool = False
    multimodal_params: dict[str, Any] | None = None

    def check_consistency(self) -> None:
        """The parameters' cross-field checks."""
        self.parameters.check_consistency()

    @field_validator("inputs")
    @classmethod
    def _check_inputs(cls, value: Any) -> str | list[int]:
        ids = integral_token_ids(value)
        if isinstance(ids, (str, list)) and not ids:
            raise ValueError("inputs must not be empty")
        if isinstance(ids, str) or is_token_list(ids):
            return ids
        if isinstance(ids, list):
            # A long id list is hard to search by eye: say which item is not an id.
            index = next(index for index, item in enumerate(ids) if not is_token_id(item))
            raise ValueError(f"inputs must be a string or a list of token ids (integers); item {index} is "
                             f"{shown_json_value(value[index])}")
        raise ValueError(f"inputs must be a string or a list of token ids (integers), got {shown_json_value(value)}")

    @field_validator("multimodal_params")
    @classmethod
    def _check_multimodal(cls, value: dict[str, Any] | None) -> None:
        return checked_multimodal_params(value)


class NativeTokenCountRequest(NullMeansAbsent):
    """Body of LightLLM's ``/tokens``: how many prompt tokens ``text`` is, as ``/generate`` counts it.

    ``parameters`` and ``multimodal_params`` are checked as ``/generate`` checks their names and
    values (LightLLM validates them there too), so a value ``/generate`` refuses is refused here with
    the same 400; what depends on the answer (``logprobs`` needing ``return_details``, the ``n`` /
    ``best_of`` caps on free slots) is not, as nothing is generated.
    ``parameters.add_special_tokens`` is the one that changes the count.
    """

    text: str
    parameters: NativeParameters = Field(default_factory=NativeParameters)
    multimodal_params: dict[str, Any] | None = None

    def check_consistency(self) -> None:
        """The parameters' cross-field checks, as on ``/generate``."""
        self.parameters.check_consistency()

    @field_validator("multimodal_params")
    @classmethod
    def _check_multimodal(cls, value: dict[str, Any] | None) -> None:
        return checked_multimodal_params(value)


def checked_multimodal_params(value: dict[str, Any] | None) -> None:
    """``multimodal_params`` of a native body: only LightLLM's empty forms (a ``ValueError`` otherwise)."""
    # LightLLM's clients send {"images": [], "audios": []} with text-only requests; those
    # empty lists mean nothing, any other key is unknown and any content is unsupported.
    if not value:
        return None
    unknown = sorted(key for key in value if key not in _MULTIMODAL_KEYS)
    if unknown:
        raise ValueError(f"unknown multimodal_params key(s) {unknown}; LightLLM's are {sorted(_MULTIMODAL_KEYS)}")
    for key, items in value.items():
        if items is None or items == []:
            continue
        if isinstance(items, list):
            raise ValueError("multimodal inputs are not supported by this server")
        # 0, false, "" and {} are empty too, but not lists: a client sending them has a bug to hear about.
        raise ValueError(f"multimodal_params.{key} must be a list (an empty one: multimodal inputs are not "
                         f"supported by this server), got {json_type_name(items)}")
    return None
