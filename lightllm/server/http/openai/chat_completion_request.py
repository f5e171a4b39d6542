"""Request schema of ``/v1/chat/completions``, with the schemas of its tool fields.

The fields it shares with ``/v1/completions`` are those of
:class:`~lightllm.server.http.openai.openai_models.OpenAISamplingRequest`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Mapping

from pydantic import Field, field_validator

from lightllm.common.sampling.storage_width import STORED_DTYPES, check_stored_int
from lightllm.server.http.errors import invalid_request
from lightllm.server.http.validation.base_models import stored_bounds
from lightllm.server.http.openai.openai_fields import REFUSED_PLATFORM_FIELDS, ChatTemplateFields
from lightllm.server.http.openai.openai_models import MAX_CHAT_TOP_LOGPROBS, OpenAISamplingRequest
from lightllm.server.http.openai.vllm_text_fields import chat_echo_text, check_chat_echo, check_vllm_default
from lightllm.server.http.openai.chat_message import ChatMessage
from lightllm.server.http.openai.tool_calls.history import check_tool_messages

# apply_chat_template's own arguments: a template variable must not override them. Those the
# request has fields for are set there; the others shape the call itself, which the server makes.
REQUEST_FIELD_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message"})
RESERVED_TEMPLATE_KWARGS = REQUEST_FIELD_TEMPLATE_KWARGS | frozenset({
    "conversation", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})

# JSON schemas of the fields typed ``Any`` (validated by hand), for the OpenAPI document.
_FUNCTION_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
    "parameters": {"type": "object"}, "strict": {"type": ["boolean", "null"]}},
    "required": ["name"], "additionalProperties": False}
TOOLS_SCHEMA = {"type": "array", "maxItems": 128, "items": {
    "type": "object", "properties": {"type": {"const": "function"}, "function": _FUNCTION_SCHEMA},
    "required": ["type", "function"], "additionalProperties": False}}
TOOL_CHOICE_SCHEMA = {"anyOf": [
    {"enum": ["none", "auto", "required"]}, {"type": "null"},
    {"type": "object", "properties": {"type": {"const": "function"}, "function": {
        "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
        "additionalProperties": False}}, "required": ["type", "function"], "additionalProperties": False}]}


class ChatCompletionRequest(OpenAISamplingRequest, ChatTemplateFields):
    """``POST /v1/chat/completions``."""

    # Read by the body parser: why these unknown top-level fields are refused.
    REFUSED_FIELD_REASONS: ClassVar[Mapping[str, str]] = REFUSED_PLATFORM_FIELDS
    LOGPROBS_ASK: ClassVar[str] = "logprobs: true"

    messages: list[ChatMessage] = Field(min_length=1)
    # Below 1 is refused by _check_max_completion_tokens in max_tokens' words (pydantic's own
    # "Input should be greater than or equal to 1" read unlike max_tokens' "must be >= 1, got 0").
    max_completion_tokens: int | None = Field(default=None, json_schema_extra={
        "minimum": 1, **stored_bounds("max_new_tokens")["json_schema_extra"]})
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    # Checked (with the server's --tool_call_parser) by lightllm.server.http.openai.tool_calls.request.plan_tool_calls.
    tools: list[Any] | None = Field(default=None, json_schema_extra=TOOLS_SCHEMA)
    tool_choice: Any = Field(default=None, json_schema_extra=TOOL_CHOICE_SCHEMA)
    parallel_tool_calls: bool | None = None
    # vLLM chat-template extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: false because the chat template writes the special tokens (BOS) itself; true adds the
    # tokenizer's on top of them (lightllm.server.http.generation.special_tokens).
    add_special_tokens: bool = False
    # vLLM's: the answer's content starts with the last message's when that one is the assistant's.
    echo: bool = False
    # vLLM's (reasoning text left out of the answer): only true, see VLLM_DEFAULT_ONLY_FIELDS.
    include_reasoning: Literal[True] = True

    @field_validator("max_completion_tokens")
    @classmethod
    def _check_max_completion_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @field_validator("include_reasoning", mode="before")
    @classmethod
    def _check_include_reasoning(cls, value: Any) -> Any:
        return check_vllm_default("include_reasoning", value)

    def check_consistency(self) -> None:
        """The shared checks, then the chat ones: a ``max_tokens`` beside ``max_completion_tokens`` that
        would be refused alone (both are accepted, ``max_completion_tokens`` wins),
        ``continue_final_message``, reserved ``chat_template_kwargs``, ``top_logprobs`` without ``logprobs``,
        missing contents, tool messages and ``echo``; each a 400 naming the field."""
        super().check_consistency()
        if self.max_completion_tokens is not None and self.max_tokens is not None:
            # max_completion_tokens sets the limit, so SamplingParams never sees max_tokens; the
            # width check it would have made is made here, so a value refused alone is refused beside it.
            try:
                check_stored_int("max_tokens", self.max_tokens, STORED_DTYPES["max_new_tokens"])
            except ValueError as exc:
                raise invalid_request(str(exc), "max_tokens") from None
        if self.add_generation_prompt and self.continue_final_message:
            raise invalid_request("continue_final_message requires add_generation_prompt to be false",
                                  "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise invalid_request("continue_final_message requires the last message to be from the assistant",
                                  "continue_final_message")
        reserved = sorted(set(self.chat_template_kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            fields = [key for key in reserved if key in REQUEST_FIELD_TEMPLATE_KWARGS]
            calls = [key for key in reserved if key not in REQUEST_FIELD_TEMPLATE_KWARGS]
            why = "; ".join(part for part in (
                f"{', '.join(fields)} {'is a request field' if len(fields) == 1 else 'are request fields'}: "
                "set it there" if fields else "",
                f"{', '.join(calls)} {'shapes' if len(calls) == 1 else 'shape'} the template call, which the "
                "server makes" if calls else "") if part)
            raise invalid_request(f"chat_template_kwargs must not set {', '.join(reserved)} ({why})",
                                  "chat_template_kwargs")
        if self.top_logprobs and not self.logprobs:
            # 0 asks for no alternatives: vLLM's default, which its clients send without logprobs.
            raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
        for index, message in enumerate(self.messages):
            if message.content is None and message.role != "assistant":
                raise invalid_request(f"messages[{index}].content is required for role {message.role!r}",
                                      f"messages.{index}.content")
        check_tool_messages(self.messages)
        check_chat_echo(self.echo, self.add_generation_prompt, self.messages[-1].role)

    def asks_token_logprobs(self) -> bool:
        """``logprobs`` true (chat's switch; ``top_logprobs`` only counts alternatives)."""
        return self.logprobs

    def echo_text(self) -> str | None:
        """What ``echo`` puts before every choice's content (None without echo); see :func:`chat_echo_text`."""
        if not self.echo:
            return None
        return chat_echo_text(self.messages[-1].role, self.messages[-1].text())

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` when given (it wins over ``max_tokens``), else ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_options(self) -> dict[str, Any]:
        """Chat-template options that differ from the defaults (for ``encode_chat``): the template
        variables (the client's ``chat_template_kwargs``, the fields', and ``enable_thinking`` that
        ``reasoning_effort`` sets unless the client did) and which of them the server set."""
        options: dict[str, Any] = {}
        if not self.add_generation_prompt:
            options["add_generation_prompt"] = False
        if self.continue_final_message:
            options["continue_final_message"] = True
        implied = self.implied_template_variables(self.chat_template_kwargs)
        variables = {**(self.chat_template_kwargs or {}), **self.template_variables(), **implied}
        if variables:
            options["chat_template_kwargs"] = variables
        if implied:
            # Set by the server, not the client: a template that does not read them is no reason to refuse.
            options["implied_variables"] = frozenset(implied)
        return options

    def max_tokens_param(self) -> str:
        """The field :meth:`requested_max_tokens` read its limit from."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def public_names(self) -> dict[str, str]:
        """As the parent, and ``logprobs`` is named ``top_logprobs`` (chat's count of alternatives)."""
        # Chat asks for the number of alternatives with top_logprobs; logprobs is its switch.
        return {**super().public_names(), "logprobs": "top_logprobs"}
