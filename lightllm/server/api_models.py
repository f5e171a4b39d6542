"""Request schemas of the HTTP API and the checks that need the served model.

Every request model is strict (no coercion of strings into numbers or bools) and forbids
unknown keys, so a misspelt or internal-only field such as ``infer_high_priority`` is rejected
with a 400 that names it.  Validation failures become :class:`~lightllm.server.api_errors.APIError`
with ``param`` set to the dotted field path (``messages.0.role``, ``parameters.top_p``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from lightllm.common.sampling import MAX_STOP_SEQUENCES, SamplingParamError, SamplingParams
from lightllm.server.api_errors import APIError, invalid_request

MAX_N = 16
MAX_PROMPTS = 64
MAX_OPENAI_STOP = 4
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")

ModelT = TypeVar("ModelT", bound=BaseModel)


class StrictModel(BaseModel):
    """Base for request bodies: strict types, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", strict=True)

    def check_consistency(self) -> None:
        """Cross-field checks that pydantic field validators cannot name a param for."""


def _normalize_stop(value: Any, limit: int, name: str) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise ValueError(f"{name} must be a string or a list of strings")
    if len(items) > limit:
        raise ValueError(f"{name} holds at most {limit} strings, got {len(items)}")
    if any(not item for item in items):
        raise ValueError(f"{name} must not contain empty strings")
    return list(items)


class StreamOptions(StrictModel):
    """``stream_options`` of the OpenAI endpoints."""

    include_usage: bool = False


class OpenAISamplingRequest(StrictModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``.

    After validation ``stop`` is always a list of strings.
    """

    model: str
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: Any = Field(default=None, validate_default=True)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: Any) -> list[str]:
        return _normalize_stop(value, MAX_OPENAI_STOP, "stop")

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported; send null or {}")
        return value

    def check_consistency(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise invalid_request("stream_options is only allowed when stream is true", "stream_options")

    @property
    def include_usage(self) -> bool:
        """True when a streaming client asked for the final usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        """The client's completion-length limit, or None to use the server default."""
        return self.max_tokens

    def sampling_fields(self) -> dict[str, Any]:
        """The SamplingParams keyword arguments the client set (defaults left out)."""
        values: dict[str, Any] = {
            "min_new_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_sequences": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids or []),
        }
        for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
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

    prompt: Any
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> list[str | list[int]]:
        return normalize_completion_prompt(value)

    @field_validator("echo")
    @classmethod
    def _check_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo=true is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("suffix is not supported; send null")
        return value


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in value)


def normalize_completion_prompt(value: Any) -> list[str | list[int]]:
    """Turn every accepted ``prompt`` form into a non-empty list of non-empty prompts."""
    if isinstance(value, str):
        prompts: list[Any] = [value]
    elif _is_token_list(value) and value:
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        prompts = list(value)
    elif isinstance(value, list) and value and all(_is_token_list(item) for item in value):
        prompts = list(value)
    elif isinstance(value, list) and not value:
        raise ValueError("prompt must not be empty")
    else:
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of such lists")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"prompt holds at most {MAX_PROMPTS} prompts, got {len(prompts)}")
    if any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("prompt must not be empty")
    return prompts


class ChatMessage(StrictModel):
    """One entry of ``messages``; content is text or a list of text parts."""

    role: str
    content: Any = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[Any] | None = None

    @field_validator("role")
    @classmethod
    def _check_role(cls, value: str) -> str:
        if value not in CHAT_ROLES:
            raise ValueError(f"unknown role {value!r}; expected one of {', '.join(CHAT_ROLES)}")
        return value

    @field_validator("content")
    @classmethod
    def _check_content(cls, value: Any) -> str | None:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of content parts")
        texts = []
        for index, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"content part {index} has type {kind!r}; only 'text' parts are supported")
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise ValueError(f"content part {index} must be {{'type': 'text', 'text': <string>}}")
            texts.append(part["text"])
        # Separate parts are usually separate paragraphs; a newline keeps them apart.
        return "\n".join(texts)

    @field_validator("tool_calls")
    @classmethod
    def _check_tool_calls(cls, value: list[Any] | None) -> None:
        if value:
            raise ValueError("tool calls are not supported")
        return None

    def to_template_dict(self) -> dict[str, str]:
        """The message as handed to the chat template.

        ``developer`` is OpenAI's newer name for ``system``; most chat templates only know
        the latter, so it is mapped.
        """
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(OpenAISamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None

    def check_consistency(self) -> None:
        super().check_consistency()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
        for index, message in enumerate(self.messages):
            if message.content is None and message.role != "assistant":
                raise invalid_request(f"messages[{index}].content is required for role {message.role!r}",
                                      f"messages.{index}.content")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise invalid_request("only response_format {'type': 'text'} is supported", "response_format")
        if self.tools:
            raise invalid_request("tools are not supported", "tools")
        if self.tool_choice not in (None, "none"):
            raise invalid_request("tool_choice is not supported; send null or 'none'", "tool_choice")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class NativeParameters(StrictModel):
    """``parameters`` of LightLLM's ``/generate`` and ``/generate_stream``.

    Names follow SamplingParams; range checks happen there. ``logprobs`` is the number of
    top alternatives per token reported in ``details`` (stream events carry the chosen
    token's logprob regardless).
    """

    do_sample: bool | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    stop_sequences: Any = Field(default=None, validate_default=True)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    return_details: bool = False
    logprobs: int | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _check_stop(cls, value: Any) -> list[str]:
        return _normalize_stop(value, MAX_STOP_SEQUENCES, "stop_sequences")

    def sampling_fields(self) -> dict[str, Any]:
        """SamplingParams keyword arguments (max_new_tokens is resolved by the caller)."""
        return self.model_dump(exclude={"return_details", "max_new_tokens"})


class NativeGenerateRequest(StrictModel):
    """Body of ``/generate`` and ``/generate_stream``.

    ``high_priority_request`` is the router admission flag; inference-side priority is
    internal and cannot be set from here.
    """

    inputs: str = Field(min_length=1)
    parameters: NativeParameters = Field(default_factory=NativeParameters)
    high_priority_request: bool = False
    multimodal_params: dict[str, Any] | None = None

    @field_validator("multimodal_params")
    @classmethod
    def _check_multimodal(cls, value: dict[str, Any] | None) -> None:
        if value and any(value.values()):
            raise ValueError("multimodal inputs are not supported by this server")
        return None


def _describe_validation_error(error: Mapping[str, Any]) -> tuple[str, str | None]:
    param = ".".join(str(part) for part in error.get("loc", ())) or None
    kind = error.get("type")
    if kind == "extra_forbidden":
        return f"Unknown parameter '{param}'; it is not accepted by this endpoint", param
    if kind == "missing":
        return f"Missing required parameter '{param}'", param
    message = str(error.get("msg", "invalid value"))
    if kind == "value_error" and isinstance(error.get("ctx", {}).get("error"), ValueError):
        message = str(error["ctx"]["error"])
    if param is not None:
        message = f"Invalid value for '{param}': {message}"
    return message, param


def parse_body(raw: bytes, model_cls: type[ModelT]) -> ModelT:
    """Decode a JSON body and validate it into ``model_cls``, raising 400 on any problem."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid_request(f"Malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise invalid_request(f"The request body must be a JSON object, got {type(data).__name__}")
    try:
        body = model_cls.model_validate(data)
    except ValidationError as exc:
        message, param = _describe_validation_error(exc.errors(include_url=False)[0])
        raise invalid_request(message, param) from None
    if isinstance(body, StrictModel):
        body.check_consistency()
    return body


_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)


def build_sampling_params(
    values: Mapping[str, Any], vocab_size: int, public_names: Mapping[str, str] | None = None
) -> SamplingParams:
    """Build validated SamplingParams, reporting errors under the client's field names.

    ``public_names`` maps SamplingParams field names to the request's own names (for
    example ``max_new_tokens`` -> ``max_tokens``), both in ``param`` and in the message.
    """
    names = dict(public_names or {})
    try:
        params = SamplingParams(**values)
        params.validate(vocab_size)
    except SamplingParamError as exc:
        message = str(exc)
        first_word = message.split(" ", 1)[0]
        field = first_word if first_word in _SAMPLING_FIELDS else None
        for internal, public in names.items():
            message = re.sub(rf"\b{internal}\b", public, message)
        raise invalid_request(message, names.get(field, field) if field else None) from None
    return params


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    """Reject token ids outside ``[0, vocab_size)``."""
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise invalid_request(f"token id {token_id} is outside the vocabulary [0, {vocab_size})", param)


def check_context_length(
    prompt_len: int, max_new_tokens: int, limit: int, *, prompt_param: str, prompt_noun: str, tokens_param: str
) -> None:
    """Reject a request whose prompt plus completion would exceed ``limit`` tokens."""
    total = prompt_len + max_new_tokens
    if total <= limit:
        return
    message = (
        f"This model's maximum context length is {limit} tokens. However, you requested {total} tokens "
        f"({prompt_len} in the {prompt_noun}, {max_new_tokens} in the completion). "
        f"Please reduce the length of the {prompt_noun} or completion."
    )
    param = prompt_param if prompt_len >= limit else tokens_param
    raise APIError(400, message, "invalid_request_error", param, "context_length_exceeded")
