"""OpenAI platform fields and vLLM extras shared by the OpenAI request schemas.

The schemas in :mod:`lightllm.server.http.openai.openai_models` and
:mod:`lightllm.server.http.openai.chat_completion_request` inherit these fields, so each decision
about a field lives here with its reason:

* ``null`` means the same as leaving a field out, on every known field (OpenAI's SDKs and many
  clients send explicit nulls); the OpenAPI document marks every optional field nullable
  accordingly. An unknown field is refused whatever its value, ``null`` included.
* ``logit_bias`` works (added to the logits in the model rank); ``truncate_prompt_tokens`` keeps
  the last k prompt tokens, as vLLM does; vLLM's structured-output parameters become a grammar
  (:mod:`lightllm.server.http.structured.structured_params`).
* Platform fields that only mean something on OpenAI's hosted service are accepted where their
  meaning holds on a self-hosted server and refused with the reason where it does not:
  ``store`` (nothing is stored: ``false`` accepted, ``true`` refused), ``service_tier`` (one tier:
  ``auto`` and ``default`` accepted), ``prediction`` (a latency hint that never changes the
  output: accepted and not used), ``metadata`` (client bookkeeping: accepted, bounded as OpenAI
  bounds it, not used); ``prompt_cache_retention``, ``prompt_cache_options``, ``verbosity`` and
  ``moderation`` are not fields of the schema (their meaning cannot hold here), so they are refused
  as unknown; on chat, where OpenAI offers them, with the reason in :data:`REFUSED_PLATFORM_FIELDS`.
* Chat only: ``chat_template`` and ``documents`` go to the chat template as in vLLM;
  ``reasoning_effort`` is a template variable too, and also sets ``enable_thinking`` (true unless
  ``"none"``) when ``chat_template_kwargs`` does not, as vLLM 0.32 does for templates that turn
  thinking on only when asked (:meth:`ChatTemplateFields.implied_template_variables`).
  ``documents`` and ``reasoning_effort`` are refused when the template never reads them
  (``reasoning_effort`` counts as read when the template reads ``enable_thinking`` it set;
  :mod:`lightllm.server.template_variables`).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

import numpy as np
from pydantic import Field, field_validator

from lightllm.common.sampling import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS, STORED_DTYPES
from lightllm.server.http.openai.vllm_text_fields import strict_bool
from lightllm.server.http.errors import invalid_request
from lightllm.server.http.validation.base_models import FLOAT32_RULE, NullMeansAbsent, StrictModel
from lightllm.server.http.generation.special_tokens import SpecialTokenFrame
from lightllm.server.http.structured.structured_params import GUIDED_JSON_SCHEMA, MAX_CHOICES, STRUCTURED_OUTPUTS_SCHEMA

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# A chat template is a Jinja source file; real ones are a few KiB.
MAX_CHAT_TEMPLATE_CHARS = 65536
MAX_DOCUMENTS = 64
ACCEPTED_SERVICE_TIERS = ("auto", "default")
# vLLM 0.32's whole set ("max" is DeepSeek V4's, beyond OpenAI's list).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_INT32_MAX = int(np.iinfo(STORED_DTYPES["max_new_tokens"]).max)
# OpenAI chat fields whose meaning cannot hold on this server, with the reason the refusal gives
# (the openai client offers them for chat completions, so a bare "unknown parameter" would leave
# its user guessing; legacy completions has none of them, so there they are unknown fields).
REFUSED_PLATFORM_FIELDS: Mapping[str, str] = {
    "prompt_cache_retention": "it sets how long OpenAI keeps cached prefixes; here the prefix cache keeps "
                              "prefixes while KV memory allows, so a retention asked for could not be honoured",
    "prompt_cache_options": "it sets where OpenAI's cache breakpoints go; here the prefix cache finds shared "
                            "prefixes itself, so a breakpoint asked for could not be honoured",
    "verbosity": "it asks OpenAI's reasoning models for shorter or longer answers; a checkpoint served here has "
                 "no such setting (a chat template with a variable for it can get one through chat_template_kwargs)",
    "moderation": "it asks for OpenAI's moderation of input and output; this server runs none",
}


class PredictionContent(StrictModel):
    """OpenAI's ``prediction``: text the output is expected to repeat (a speed-up hint only)."""

    type: Literal["content"]
    content: str | list[dict[str, str]]


# Longest logit_bias key read as a number: a token id needs 10 digits at most, and int() takes time
# quadratic in the length of what it parses.
_MAX_TOKEN_KEY_CHARS = 64
# The schema's rule for a key, looser than int(): of ASCII, only what int() reads (digits, signs,
# "_", white space), and any other character.  int() also reads other scripts' digits ("٣", "５")
# and white space ("\xa0"), which JSON Schema's regular expressions cannot name portably (ECMA-262's
# \d and \s are not Python's), so the schema lets every non-ASCII character through and the server
# decides; it never refuses a key the server accepts.
_TOKEN_KEY_PATTERN = r"^(?:[0-9+_ \t\n\x0b\x0c\r-]|[^\x00-\x7f])+$"


def _token_id_key(key: str) -> int:
    """A ``logit_bias`` key as the token id it names, read as vLLM reads it (Python's ``int()``: ``"05"``,
    ``"+5"`` and ``" 5"`` are token 5); whether the id is in the vocabulary is checked with the
    sampling parameters."""
    try:
        if len(key) > _MAX_TOKEN_KEY_CHARS:
            raise ValueError(key)
        return int(key)
    except ValueError:
        raise ValueError(f"logit_bias keys must be token ids (integers, such as \"5\"), got {key[:80]!r}") from None


class OpenAIPlatformFields(NullMeansAbsent):
    """Fields both OpenAI endpoints accept besides the sampling parameters."""

    logit_bias: dict[str, float] | None = Field(default=None, json_schema_extra={
        "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"maxLength": _MAX_TOKEN_KEY_CHARS, "pattern": _TOKEN_KEY_PATTERN},
        "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_LIMIT, "maximum": LOGIT_BIAS_LIMIT,
                                 "description": FLOAT32_RULE}})
    # vLLM: keep only the last k prompt tokens.
    truncate_prompt_tokens: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    # vLLM's structured outputs (current and legacy spellings); see api_structured_params.
    structured_outputs: dict[str, Any] | None = Field(default=None, json_schema_extra=STRUCTURED_OUTPUTS_SCHEMA)
    guided_json: Any = Field(default=None, json_schema_extra=GUIDED_JSON_SCHEMA)
    guided_regex: str | None = None
    # The other bounds are checked when the choice is compiled (structured_params._choice), with its messages.
    guided_choice: list[str] | None = Field(default=None, min_length=1, json_schema_extra={
        "maxItems": MAX_CHOICES, "items": {"type": "string", "minLength": 1}})
    guided_grammar: str | None = Field(default=None, min_length=1)
    store: Literal[False] | None = Field(default=None, description="Only false: this server stores no completions")
    service_tier: Literal["auto", "default"] | None = None
    prediction: PredictionContent | None = None
    metadata: dict[str, str] | None = Field(default=None, json_schema_extra={
        "maxProperties": MAX_METADATA_PAIRS, "propertyNames": {"maxLength": MAX_METADATA_KEY_CHARS},
        "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS}})

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
        named: dict[int, str] = {}
        for key, bias in value.items():
            token_id = _token_id_key(key)
            if token_id in named:
                # Two spellings of one id ("5" and "05"): one bias would silently replace the other.
                raise ValueError(f"logit_bias keys {named[token_id]!r} and {key!r} both name token {token_id}; "
                                 "give each token one bias")
            named[token_id] = key
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias[{key}] must be in [-100, 100], got {bias}")
        return value

    @field_validator("store", mode="before")
    @classmethod
    def _check_store(cls, value: Any) -> Any:
        if value is True:
            raise ValueError("store: true is not supported: this server stores no completions (send false or omit it)")
        return strict_bool(value)

    @field_validator("service_tier", mode="before")
    @classmethod
    def _check_service_tier(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in ACCEPTED_SERVICE_TIERS:
            raise ValueError(f"service_tier {value!r} is not offered: this server has one tier; send 'auto' or "
                             "'default' or omit it")
        return value

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs, got {len(value)}")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters")
            if len(item) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"metadata values are at most {MAX_METADATA_VALUE_CHARS} characters")
        return value

    def logit_bias_ids(self) -> dict[int, float]:
        """``logit_bias`` keyed by token id (empty when not given)."""
        return {int(key): float(bias) for key, bias in (self.logit_bias or {}).items()}

    def guided_fields(self) -> dict[str, Any]:
        """vLLM's legacy structured-output fields by name (None: not given)."""
        return {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}

    def structured_output_param(self) -> str:
        """The field that asked for structured output (the request asks one way at most)."""
        if self.structured_outputs is not None:
            return "structured_outputs"
        given = [name for name, value in self.guided_fields().items() if value is not None]
        return given[0] if given else "response_format"

    def check_truncation(self, context_len: int) -> None:
        """A 400 naming ``truncate_prompt_tokens`` above the context length, whatever the prompt (vLLM
        refuses it up front, naming the field): refused later as a too-long ``prompt``, the message
        pointed at the input the client had asked to cut.  The context length itself is taken (a
        client's way of saying "cut to the model"); a prompt cut to it is then refused as too long."""
        keep = self.truncate_prompt_tokens
        if keep is not None and keep > context_len:
            raise invalid_request(f"truncate_prompt_tokens ({keep}) cannot be greater than the context length "
                                  f"({context_len} tokens)", "truncate_prompt_tokens")

    def truncated(self, prompt_ids: list[int], frame: SpecialTokenFrame | None = None) -> list[int]:
        """The prompt cut to its last ``truncate_prompt_tokens`` tokens (vLLM keeps the end).

        ``frame``: the special tokens the tokenizer added around the prompt's text, which are kept
        (vLLM truncates in the tokenizer, which adds them after cutting the text: Llama's BOS stays);
        they count within ``truncate_prompt_tokens``.  Token-id prompts are cut as given.
        """
        keep = self.truncate_prompt_tokens
        if keep is None or len(prompt_ids) <= keep:
            return prompt_ids
        if frame is None or not frame.frames(prompt_ids):
            return prompt_ids[-keep:]
        text_ids = prompt_ids[len(frame.prefix):len(prompt_ids) - len(frame.suffix)]
        kept = keep - len(frame.prefix) - len(frame.suffix)
        if kept < 0:
            raise invalid_request(f"truncate_prompt_tokens must be at least {keep - kept} here: the tokenizer adds "
                                  f"{keep - kept} special token(s) to the prompt, and they are kept",
                                  "truncate_prompt_tokens")
        return frame.apply(text_ids[len(text_ids) - kept:])


class ChatTemplateFields(NullMeansAbsent):
    """Chat-only fields that reach the chat template."""

    chat_template: str | None = Field(default=None, min_length=1, max_length=MAX_CHAT_TEMPLATE_CHARS)
    documents: list[dict[str, str]] | None = Field(default=None, max_length=MAX_DOCUMENTS)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    @field_validator("reasoning_effort", mode="before")
    @classmethod
    def _check_reasoning_effort(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {value!r}")
        return value

    def template_variables(self) -> dict[str, Any]:
        """What these fields add to the chat template call (``chat_template`` and ``documents`` are
        arguments of ``apply_chat_template``; ``reasoning_effort`` a template variable)."""
        variables: dict[str, Any] = {}
        if self.chat_template is not None:
            variables["chat_template"] = self.chat_template
        if self.documents is not None:
            variables["documents"] = [dict(document) for document in self.documents]
        if self.reasoning_effort is not None:
            variables["reasoning_effort"] = self.reasoning_effort
        return variables

    def implied_template_variables(self, chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """Template variables these fields set besides their own, unless ``chat_template_kwargs`` sets them.

        vLLM 0.32's rule: ``reasoning_effort`` also sets ``enable_thinking`` (false for ``"none"``,
        else true), since templates such as Gemma's think only when ``enable_thinking`` says so and
        would otherwise ignore an effort the client asked for.  The client's own ``enable_thinking``
        wins.  The server sets these, not the client, so a template that does not read them is no
        reason to refuse the request (:func:`lightllm.server.template_variables.implied_readers`).
        """
        if self.reasoning_effort is None or "enable_thinking" in (chat_template_kwargs or {}):
            return {}
        return {"enable_thinking": self.reasoning_effort != "none"}
