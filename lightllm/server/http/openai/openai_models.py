"""Request schemas of the OpenAI-compatible endpoints: the fields ``/v1/completions`` and
``/v1/chat/completions`` share, and the ``/v1/completions`` request.

Strict like every request schema (:class:`~lightllm.server.http.validation.base_models.StrictModel`), with OpenAI's
parameter names and limits plus the vLLM extras that common clients send.  The ``/v1/chat/completions``
request is :class:`~lightllm.server.http.openai.chat_completion_request.ChatCompletionRequest`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from lightllm.common.sampling.sampling_params import MAX_SEED
from lightllm.server.http.openai.request_id_header import REQUEST_ID_MAX_LENGTH, REQUEST_ID_PATTERN
from lightllm.server.http.generation.completion_prompt import (MAX_PROMPTS, TOKEN_IDS_SCHEMA, integral_token_ids,
                                                               normalize_completion_prompt)
from lightllm.server.http.errors import invalid_request
from lightllm.server.http.structured.response_format import RESPONSE_FORMAT_SCHEMA
from lightllm.server.http.validation.base_models import (FLOAT32_RULE, MAX_N, STOP_TOKEN_IDS_SCHEMA, max_tokens_field,
                                                         null_only, stop_validator, stored_bounds,
                                                         string_or_strings_schema)
from lightllm.server.http.validation.base_models import NullMeansAbsent
from lightllm.server.http.openai.openai_fields import OpenAIPlatformFields
from lightllm.server.http.openai.vllm_text_fields import (check_spaces_between_special_tokens, check_vllm_default,
                                                          strict_bool)

# OpenAI takes 4 stop strings; the native endpoint's 16 here, as lm-eval's code tasks send 5 or 6
# (humaneval's `until`) and a stop string costs the detokenizer next to nothing.
MAX_OPENAI_STOP = 16
MAX_COMPLETION_LOGPROBS = 20  # OpenAI's legacy cap is 5; vLLM (and this server) allow 20
MAX_CHAT_TOP_LOGPROBS = 20

# JSON schemas of the fields typed ``Any`` (validated by hand), for the OpenAPI document.
_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_PROMPTS},
    TOKEN_IDS_SCHEMA,
    {"type": "array", "items": TOKEN_IDS_SCHEMA, "minItems": 1, "maxItems": MAX_PROMPTS}]}


class StreamOptions(NullMeansAbsent):
    """``stream_options`` of the OpenAI endpoints."""

    include_usage: bool = False
    # vLLM extra (guidellm sends it): usage on every chunk, not only on the last one.
    continuous_usage_stats: bool = False
    # OpenAI pads stream events with random text against size side channels; there is no padding here.
    include_obfuscation: Literal[False] | None = Field(
        default=None, description="Only false: this server does not pad stream events")

    @field_validator("include_obfuscation", mode="before")
    @classmethod
    def _check_obfuscation(cls, value: Any) -> Any:
        if value is True:
            raise ValueError("include_obfuscation: true is not supported: this server does not pad stream events "
                             "(send false or omit it)")
        return strict_bool(value)


class OpenAISamplingRequest(OpenAIPlatformFields):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``.

    After validation ``stop`` is always a list of strings.
    """

    # The endpoint's completion length when the client sends none (None: the rest of the context).
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = None
    # Whether echo with max_tokens 0 (the prompt alone) is offered: completions only, as in vLLM.
    ECHO_ALLOWS_ZERO_MAX_TOKENS: ClassVar[bool] = False
    # How this endpoint asks for token logprobs, in the 400 of a field that needs them.
    LOGPROBS_ASK: ClassVar[str] = "logprobs"
    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    stop: Any = Field(default=None, validate_default=True, json_schema_extra=string_or_strings_schema(MAX_OPENAI_STOP))
    # Below 1 is refused by _check_max_tokens and check_consistency with the whole rule (pydantic's
    # "ge" message would not say it); CompletionRequest lowers the published minimum to 0 (echo).
    max_tokens: int | None = max_tokens_field(1)
    # The 32-bit float rule of each float (the width check of SamplingParams) is stated in words.
    temperature: float | None = Field(default=None, ge=0, le=2, description=FLOAT32_RULE)
    top_p: float | None = Field(default=None, gt=0, le=1, description=FLOAT32_RULE)
    top_k: int | None = Field(default=None, ge=-1, **stored_bounds("top_k"))
    min_p: float | None = Field(default=None, ge=0, le=1, description=FLOAT32_RULE)
    # -1 means no seed, as vLLM reads it (UIs send it for "random").
    seed: int | None = Field(default=None, ge=-1, **stored_bounds("seed"))
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, description=FLOAT32_RULE)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, description=FLOAT32_RULE)
    repetition_penalty: float | None = Field(default=None, gt=0, **stored_bounds("repetition_penalty"))
    min_tokens: int = Field(default=0, ge=0, **stored_bounds("min_new_tokens"))
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, json_schema_extra=STOP_TOKEN_IDS_SCHEMA)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's successor of user; and a key OpenAI routes on for prompt-cache hits, which the
    # prefix cache here gets from the prompt itself.
    safety_identifier: str | None = Field(default=None, max_length=64)
    prompt_cache_key: str | None = None
    # vLLM extras.
    # logprobs name tokens ``token_id:<id>`` instead of their (possibly ambiguous) text.
    return_tokens_as_token_ids: bool = False
    # The prompt's and every choice's token ids beside the text (vLLM's; RL trainers read them
    # rather than re-tokenizing text, which need not round-trip): see token_ids.TokenIdShaper.
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Becomes the response id and appears in the server log.
    request_id: str | None = Field(default=None, min_length=1, max_length=REQUEST_ID_MAX_LENGTH,
                                   pattern=REQUEST_ID_PATTERN)
    # Logprobs of every prompt token with this many alternatives (vLLM), from the prefill forward.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    # OpenAI's structured output (both endpoints, as vLLM accepts it on completions too).
    response_format: dict[str, Any] | None = Field(default=None, json_schema_extra=RESPONSE_FORMAT_SCHEMA)
    # vLLM's; only true (the default): see check_spaces_between_special_tokens.
    spaces_between_special_tokens: Literal[True] = Field(
        default=True, description="Only true: the fast tokenizers this server decodes with put no spaces between "
                                  "special tokens, whatever this flag says")

    # vLLM's, at their defaults only (see vllm_text_fields.VLLM_DEFAULT_ONLY_FIELDS): clients built on
    # vLLM's request models send them so on every request.
    use_beam_search: Literal[False] = False
    length_penalty: Literal[1.0] = 1.0
    priority: Literal[0] = 0
    bad_words: list[str] = Field(default_factory=list, json_schema_extra={"maxItems": 0})
    allowed_token_ids: None = None
    return_weight_versions: Literal[False] = False
    routed_experts_prompt_start: Literal[0] = 0
    return_token_offsets: Literal[False] = False
    mm_payload: Literal["tensors"] = "tensors"

    _check_stop = stop_validator("stop", MAX_OPENAI_STOP)

    @field_validator("use_beam_search", "length_penalty", "priority", "bad_words", "allowed_token_ids",
                     "return_weight_versions", "routed_experts_prompt_start", "return_token_offsets", "mm_payload",
                     mode="before")
    @classmethod
    def _check_vllm_default(cls, value: Any, info: Any) -> Any:
        return check_vllm_default(info.field_name, value)

    @field_validator("max_tokens")
    @classmethod
    def _check_max_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            # The error formatter adds "Invalid value for 'max_tokens': ", as check_consistency does for 0.
            raise ValueError(cls._max_tokens_rule(value))
        return value

    @classmethod
    def _max_tokens_rule(cls, value: int) -> str:
        # Only completions return the prompt alone; chat's echo repeats a message, not the prompt.
        zero = " (0 is allowed only with echo=true)" if cls.ECHO_ALLOWS_ZERO_MAX_TOKENS else ""
        return f"must be >= 1{zero}, got {value}"

    @field_validator("seed")
    @classmethod
    def _no_seed(cls, value: int | None) -> int | None:
        if value is not None and value > MAX_SEED:
            # Said here: the sampling check's range would leave out the -1 these endpoints take.
            raise ValueError(f"must be -1 (no seed) or in [0, 2**63 - 1], got {value}")
        return None if value == -1 else value

    @field_validator("spaces_between_special_tokens", mode="before")
    @classmethod
    def _check_spaces(cls, value: Any) -> Any:
        return check_spaces_between_special_tokens(value)

    def check_consistency(self) -> None:
        """The checks that read two fields or more, each a 400 naming the field: among them ``stream_options``
        without ``stream`` (an empty object is dropped), continuous usage without ``include_usage``,
        ``best_of`` below ``n`` or above it with ``stream``, ``max_tokens`` 0 without ``echo``,
        ``prompt_logprobs`` with ``stream`` and ``return_tokens_as_token_ids`` without logprobs."""
        if self.stream_options is not None and not self.stream:
            if self.stream_options.model_fields_set:
                raise invalid_request("stream_options is only allowed when stream is true", "stream_options")
            # An empty object asks for nothing (vLLM refuses only a non-empty one without stream).
            self.stream_options = None
        if self.stream_options is not None and self.stream_options.continuous_usage_stats \
                and not self.stream_options.include_usage:
            # Usage on every chunk is an addition to the final usage chunk; without it the flag
            # would silently do nothing.
            raise invalid_request("stream_options.continuous_usage_stats needs stream_options.include_usage to be "
                                  "true", "stream_options.continuous_usage_stats")
        if self.best_of is not None and self.best_of < self.n:
            raise invalid_request(f"best_of ({self.best_of}) must be >= n ({self.n})", "best_of")
        if self.max_tokens == 0 and not (self.ECHO_ALLOWS_ZERO_MAX_TOKENS and getattr(self, "echo", False)):
            # Worded as the field's own errors (-1, pydantic's), though it needs echo to decide.
            raise invalid_request(f"Invalid value for 'max_tokens': {self._max_tokens_rule(0)}", "max_tokens")
        if self.prompt_logprobs is not None and self.stream:
            raise invalid_request("prompt_logprobs is not supported when streaming", "prompt_logprobs")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise invalid_request("best_of > n is not supported when streaming (the best choices are known "
                                  "only at the end)", "best_of")
        if self.return_tokens_as_token_ids and not self.asks_token_logprobs():
            # It only renames the tokens of logprobs (prompt_logprobs keep their strings, as in
            # vLLM): without logprobs it would silently do nothing.
            raise invalid_request(f"return_tokens_as_token_ids needs {self.LOGPROBS_ASK}: it names the tokens of "
                                  "logprobs token_id:<id>, and this request asks for no logprobs (prompt_logprobs "
                                  "keep their text strings, as in vLLM); ask for logprobs or drop it",
                                  "return_tokens_as_token_ids")

    def asks_token_logprobs(self) -> bool:
        """Whether the request asks for the logprobs of its tokens (each endpoint's own field)."""
        return False

    @property
    def include_usage(self) -> bool:
        """True when a streaming client asked for the final usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """True when every streamed chunk carries the usage so far (vLLM's continuous_usage_stats)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def candidates(self) -> int:
        """Generations per prompt: ``best_of`` when given (the ``n`` most likely are returned), else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    def requested_max_tokens(self) -> int | None:
        """The client's completion-length limit, or None to use the server default."""
        return self.max_tokens

    def max_tokens_param(self) -> str:
        """The request field that set the completion-length limit (named in errors)."""
        return "max_tokens"

    def public_names(self) -> dict[str, str]:
        """SamplingParams field -> this request's field name, for error messages."""
        return {"max_new_tokens": self.max_tokens_param(), "min_new_tokens": "min_tokens",
                "stop_sequences": "stop"}

    def sampling_fields(self) -> dict[str, Any]:
        """The SamplingParams keyword arguments the client set (defaults left out)."""
        values: dict[str, Any] = {
            "min_new_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "stop_sequences": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids or []),
            "logit_bias": self.logit_bias_ids(),
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        return values


class CompletionRequest(OpenAISamplingRequest):
    """``POST /v1/completions``.

    ``prompt`` may be a string, a list of strings, a list of token ids, or a list of
    lists of token ids; after validation it is always a list whose items are a string or
    a list of token ids.
    """

    DEFAULT_MAX_TOKENS: ClassVar[int | None] = 16  # as OpenAI and vLLM
    ECHO_ALLOWS_ZERO_MAX_TOKENS: ClassVar[bool] = True
    LOGPROBS_ASK: ClassVar[str] = "logprobs (0 or more)"

    prompt: Any = Field(json_schema_extra=_PROMPT_SCHEMA)
    max_tokens: int | None = max_tokens_field(0, "0 only with echo: the prompt alone is returned")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    # Typed str so a number still gets pydantic's type error; the schema says the one value taken.
    suffix: str | None = Field(default=None, json_schema_extra=null_only(
        "Only null: this server does not generate text to fit before a suffix"))
    # vLLM's: a text prompt is tokenized with the special tokens (BOS) the tokenizer adds; token-id
    # prompts are used as given either way.
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> list[str | list[int]]:
        return normalize_completion_prompt(integral_token_ids(value))

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("suffix is not supported; send null")
        return value

    def asks_token_logprobs(self) -> bool:
        """``logprobs`` given (0 asks for the tokens' own logprobs, with no alternatives)."""
        return self.logprobs is not None

    def prompt_logprob_count(self) -> int | None:
        """The alternatives each prompt position's logprobs carry (None: none are computed), vLLM 0.32's
        rule: ``prompt_logprobs`` when given, else ``logprobs`` with ``echo`` (the echoed prompt's
        logprobs are the prompt's).  The count also sets the echoed prompt tokens' alternatives, so an
        explicit ``prompt_logprobs`` below ``logprobs`` gives them fewer, as in vLLM; every choice
        reports them as ``prompt_logprobs`` too."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None
