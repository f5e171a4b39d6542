"""One entry of a chat request's ``messages``: its role, content and the fields clients send with it.

Clients often send a response's message back as history (``message.model_dump()`` in the
``openai`` client), which carries every field of OpenAI's assistant message: ``refusal``,
``audio``, ``function_call`` and ``annotations`` as ``null`` when unused. Those nulls mean
"absent". A refusal's text is the assistant's turn; the others are refused when set, since
this server has nothing to render them with.  The SDK's own ``parsed`` (its parse helpers' copy
of the content) is accepted beside the content it repeats. ``reasoning_content`` (or ``reasoning``) of an
assistant turn reaches the template, as vLLM hands it on; a template that never mentions it would
drop it, so such a chat is refused (:func:`~lightllm.server.http.openai.chat_message.unread_reasoning`).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from lightllm.server.http.validation.base_models import StrictModel
from lightllm.server.http.openai.tool_calls.history import (TOOL_CALL_SCHEMA, check_message_tool_calls,
                                                            template_tool_calls)

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")

# JSON schemas of the fields typed ``Any`` (validated by hand), for the OpenAPI document.
_CONTENT_SCHEMA = {"anyOf": [
    {"type": "string"},
    {"type": "array", "minItems": 1,
     "items": {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
               "required": ["type", "text"], "additionalProperties": False}},
    {"type": "null"},
]}


class ChatMessage(StrictModel):
    """One entry of ``messages``; content is text or a list of text parts."""

    role: str = Field(json_schema_extra={"enum": list(CHAT_ROLES)})
    content: Any = Field(default=None, json_schema_extra=_CONTENT_SCHEMA)
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[Any] | None = Field(default=None, json_schema_extra={
        "anyOf": [{"type": "array", "items": TOOL_CALL_SCHEMA}, {"type": "null"}]})
    # OpenAI's assistant-message fields (see the module docstring); the schema states the one value
    # each refused field takes (its type stays loose, so a value gets the refusal that says why).
    refusal: str | None = None
    audio: Any = Field(default=None, json_schema_extra={"type": "null"})
    function_call: Any = Field(default=None, json_schema_extra={"type": "null"})
    annotations: list[Any] | None = Field(default=None, json_schema_extra={
        "anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]})
    # A reasoning model's thinking of an earlier assistant turn, as vLLM returns it (under either
    # name) and agent loops send it back; templates such as Qwen3's read ``reasoning_content``.
    reasoning_content: str | None = None
    reasoning: str | None = None
    # The openai SDK's parse()/stream() helpers return the content parsed into the response_format's
    # model as well (ParsedChatCompletionMessage.parsed), and a dumped message carries it: a repeat
    # of the content the template renders, accepted beside that content and not used.
    parsed: Any = Field(default=None, json_schema_extra={
        "description": "The openai SDK's parse of an assistant turn's content; accepted beside it, not used"})

    @field_validator("role")
    @classmethod
    def _check_role(cls, value: str) -> str:
        if value not in CHAT_ROLES:
            raise ValueError(f"unknown role {value!r}; expected one of {', '.join(CHAT_ROLES)}")
        return value

    @field_validator("content")
    @classmethod
    def _check_content(cls, value: Any) -> str | list[dict[str, str]] | None:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of content parts")
        if not value:
            # OpenAI refuses an empty list too: send "" for an empty message.
            raise ValueError("content must hold at least one content part (or be a string)")
        parts = []
        for index, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"content part {index} has type {kind!r}; only 'text' parts are supported")
            extra = sorted(str(key) for key in set(part) - {"type", "text"})
            if extra:
                # Named, so a client that adds a field (Anthropic-style cache_control) sees which.
                raise ValueError(f"content part {index} has field(s) this server does not accept: "
                                 f"{', '.join(repr(key) for key in extra)}; a text part is "
                                 "{'type': 'text', 'text': <string>}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {index} needs 'text' as a string, got "
                                 f"{type(part.get('text')).__name__ if 'text' in part else 'none'}")
            parts.append({"type": "text", "text": part["text"]})
        return parts

    @field_validator("audio")
    @classmethod
    def _check_audio(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("audio is not supported: this model has no audio output to refer to; send the turn's "
                             "text as content")
        return None

    @field_validator("function_call")
    @classmethod
    def _check_function_call(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("function_call (OpenAI's deprecated form) is not supported: send the call in tool_calls")
        return None

    @field_validator("annotations")
    @classmethod
    def _check_annotations(cls, value: list[Any] | None) -> None:
        if value:
            raise ValueError("annotations are not supported: a chat template has no place for them; send the "
                             "message without them")
        return None

    # The checks that read another field of the message (role, content) are field validators of the
    # field they refuse, which has been validated after those (info.data holds them), so the 400
    # names messages.N.refusal and not the whole message.  A field missing from info.data failed
    # its own check, which is the error reported.

    @field_validator("refusal")
    @classmethod
    def _check_refusal(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        role = info.data.get("role")
        if role is not None and role != "assistant":
            raise ValueError(f"refusal belongs to assistant messages, not to a {role!r} message")
        if info.data.get("content") not in (None, ""):
            raise ValueError("a message with a refusal has no content: send one of the two")
        return value

    @model_validator(mode="after")
    def _refusal_as_content(self) -> "ChatMessage":
        # A refusal is what the assistant said in that turn, and the template renders it as such.
        if self.refusal is not None:
            self.content, self.refusal = self.refusal, None
        return self

    @field_validator("tool_calls")
    @classmethod
    def _check_tool_calls(cls, value: list[Any] | None) -> list[dict[str, Any]] | None:
        return check_message_tool_calls(value)

    @field_validator("reasoning_content", "reasoning")
    @classmethod
    def _reasoning_of_an_assistant(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        role = info.data.get("role")
        if role is not None and role != "assistant":
            raise ValueError(f"{info.field_name} belongs to assistant messages, not to a {role!r} message")
        # reasoning comes after reasoning_content, so the conflict is reported on it.
        other = info.data.get("reasoning_content") if info.field_name == "reasoning" else None
        if other is not None and other != value:
            raise ValueError("reasoning_content and reasoning are two names of one field: send one of them")
        return value

    @field_validator("parsed")
    @classmethod
    def _parsed_beside_its_content(cls, value: Any, info: ValidationInfo) -> None:
        if value is None:
            return None
        role = info.data.get("role")
        if role is not None and role != "assistant":
            raise ValueError(f"parsed belongs to assistant messages, not to a {role!r} message")
        if "content" in info.data and info.data["content"] is None:
            # Nothing else would carry the turn: parsed is never rendered.
            raise ValueError("parsed (the openai SDK's parse of the content) is not used: send the turn's text "
                             "as content")
        return None

    @property
    def reasoning_text(self) -> str | None:
        """The turn's reasoning, under whichever name the client sent it."""
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning

    def text(self) -> str:
        """The content as one text: parts joined with newlines (usually separate paragraphs), as vLLM joins them."""
        if isinstance(self.content, list):
            return "\n".join(part["text"] for part in self.content)
        return self.content or ""

    def to_template_dict(self, content_parts: bool = False, developer_role: bool = False) -> dict[str, Any]:
        """The message as handed to the chat template.

        ``developer`` is OpenAI's newer name for ``system``; it reaches the template as written when
        ``developer_role`` (the template names it,
        :func:`~lightllm.server.http.openai.developer_role.template_names_developer_role`), else as
        ``system``, the only one most templates know.  Content sent as parts stays a list of parts when
        ``content_parts`` (the template iterates over them,
        :func:`~lightllm.server.http.openai.chat_content_format.template_iterates_content`); otherwise the
        texts are joined with newlines (separate parts are usually separate paragraphs), as vLLM does.
        """
        role = "system" if self.role == "developer" and not developer_role else self.role
        content = self.content if content_parts and isinstance(self.content, list) else self.text()
        message = {"role": role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = template_tool_calls(self.tool_calls)
        if self.reasoning_text is not None:
            # Both names: templates read one or the other (vLLM hands them on the same way).
            message["reasoning_content"] = message["reasoning"] = self.reasoning_text
        return message


def unread_reasoning(messages: list[ChatMessage], template: str | None) -> tuple[str, str] | None:
    """(message, param) of a 400 when a message carries reasoning that ``template`` never mentions.

    A template that mentions it decides what to render (Qwen3's keeps only the turns after the
    last user message: the others are dropped on purpose, as in vLLM); one that never mentions it
    would drop every turn's reasoning without a word.
    """
    for index, message in enumerate(messages):
        if message.reasoning_text is None:
            continue
        if template is None or "reasoning" not in template:
            field = "reasoning_content" if message.reasoning_content is not None else "reasoning"
            return (f"messages[{index}].{field} has no effect: this model's chat template does not read an "
                    f"assistant turn's reasoning; omit it (or serve a --chat_template that uses it)",
                    f"messages.{index}.{field}")
    return None
