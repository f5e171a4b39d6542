"""Request schemas of ``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

``/tokenize`` takes one of two bodies, told apart by their keys as vLLM's union of models tells
them apart: a body with ``messages`` is a chat (:class:`TokenizeChatRequest`), any other a text
prompt (:class:`TokenizeCompletionRequest`, so a body with neither is refused for its missing
``prompt``). The chat body holds a subset of ``/v1/chat/completions``' fields with the same names
and defaults; it is checked by turning it into that endpoint's own request
(:meth:`TokenizeChatRequest.chat_request`), so a chat that endpoint refuses is refused here with
the same 400 and a chat it takes renders the same way.

vLLM's chat fields with no effect on this server are refused unless null (``null`` is the field
left out, as everywhere): ``response_format`` (vLLM passes it to a few model-specific renderers;
a Hugging Face chat template never sees it), ``media_io_kwargs`` and ``mm_processor_kwargs``
(multimodal inputs, which this server does not take).
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import Field, PrivateAttr, ValidationError, field_validator

from lightllm.server.http.validation.base_models import NullMeansAbsent
from lightllm.server.http.validation.validation_errors import describe_validation_error
from lightllm.server.http.openai.chat_message import ChatMessage
from lightllm.server.http.errors import invalid_request
from lightllm.server.http.openai.openai_fields import ChatTemplateFields
from lightllm.server.http.openai.chat_completion_request import TOOLS_SCHEMA, ChatCompletionRequest

# Field -> why it is refused when set (see the module docstring).
NO_EFFECT_CHAT_FIELDS: dict[str, str] = {
    "response_format": "it only reaches model-specific chat renderers in vLLM, and the chat templates this server "
                       "renders never read it (on /v1/chat/completions it constrains the output instead)",
    "media_io_kwargs": "multimodal inputs are not supported: this server takes text only",
    "mm_processor_kwargs": "multimodal inputs are not supported: this server has no multimodal processor",
}

# The chat fields /tokenize shares with /v1/chat/completions (same names, same defaults).
_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
                "chat_template_kwargs", "tools", "documents", "reasoning_effort")


class TokenizeCompletionRequest(NullMeansAbsent):
    """``POST /tokenize`` of a text prompt."""

    model: str | None = None
    prompt: str
    # As on /v1/completions: the tokenizer's special tokens (BOS) are added by default.
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    """``POST /tokenize`` of a chat, rendered as ``/v1/chat/completions`` renders it (with the same
    template fields: ``chat_template``, ``documents``, ``reasoning_effort``)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # As on /v1/chat/completions: the template writes the special tokens; true adds the tokenizer's too.
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Checked (tools.N.function...) when the chat is rendered, as on /v1/chat/completions.
    tools: list[Any] | None = Field(default=None, json_schema_extra=TOOLS_SCHEMA)
    response_format: Any = Field(default=None, json_schema_extra={"type": "null"})
    media_io_kwargs: Any = Field(default=None, json_schema_extra={"type": "null"})
    mm_processor_kwargs: Any = Field(default=None, json_schema_extra={"type": "null"})

    _chat: ChatCompletionRequest | None = PrivateAttr(default=None)

    @field_validator("response_format", "media_io_kwargs", "mm_processor_kwargs", mode="before")
    @classmethod
    def _refuse_no_effect(cls, value: Any, info: Any) -> Any:
        # Only a non-null value reaches here (NullMeansAbsent drops nulls).
        if value is not None:
            why = NO_EFFECT_CHAT_FIELDS[info.field_name]
            raise ValueError(f"{info.field_name} is not supported on /tokenize: {why}; omit it or send null")
        return value

    def check_consistency(self) -> None:
        """The chat endpoint's own cross-field checks (continue_final_message, roles, tool messages, ...)."""
        values = {name: getattr(self, name) for name in _CHAT_FIELDS if getattr(self, name) is not None}
        try:
            chat = ChatCompletionRequest.model_validate(values)
        except ValidationError as exc:
            # The fields were validated above with the same rules; should the chat endpoint's grow
            # stricter, its refusal is still a 400 naming the field, never a 500.
            raise invalid_request(*describe_validation_error(exc.errors(include_url=False))) from None
        chat.check_consistency()
        self._chat = chat

    def chat_request(self) -> ChatCompletionRequest:
        """This chat as a ``/v1/chat/completions`` request (every other field at its default)."""
        if self._chat is None:
            self.check_consistency()
        assert self._chat is not None
        return self._chat


class DetokenizeRequest(NullMeansAbsent):
    """``POST /detokenize``: token ids back to text (the vocabulary and length bounds need the served model,
    so the endpoint checks them)."""

    model: str | None = None
    tokens: list[int] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})


class TokenizeBody:
    """Picks ``/tokenize``'s schema by the body's keys; :func:`~lightllm.server.http.validation.body.parse_body` calls
    :meth:`model_validate` as it would a model's, so every error names its field as usual."""

    @staticmethod
    def model_validate(data: Any) -> Union[TokenizeCompletionRequest, TokenizeChatRequest]:
        """The validated body: a chat when it has ``messages`` (null included: then refused as missing)."""
        if isinstance(data, dict) and "messages" in data:
            return TokenizeChatRequest.model_validate(data)
        return TokenizeCompletionRequest.model_validate(data)
