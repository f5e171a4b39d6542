"""Chat data a template may print or drop: refused when the rendered chat does not depend on it.

``messages[i].name``, an assistant turn's ``tool_calls`` and the request's ``tools`` reach the chat
template as data; a template that never prints them (one writing only each message's role and
content) renders the chat exactly as without them, so the request would be answered as if they had
not been sent.  Each is refused instead, with a 400 naming it, as ``documents``,
``reasoning_effort`` and unread ``chat_template_kwargs`` keys are
(:mod:`lightllm.server.template_variables`).  ``tools`` only where the prompt is all they act
through (tool_choice none): under auto they also pick which calls are read from the output, and a
forced call holds them in its grammar.

These are decided by rendering the chat without the data and comparing the text, not from the
template's source: every template reads ``message`` (and through it ``message.name`` or
``message.tool_calls`` in any spelling), and a template may name a field only to skip it.  Each
check costs one more render, made only when the data is there.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from lightllm.server.manager_errors import ServerChatTemplateError

# Renders a chat (messages, chat_template_kwargs) to its prompt text; ValueError when it cannot.
Render = Callable[[List[Dict[str, Any]], Optional[Dict[str, Any]]], str]


class UnreadTemplateFieldError(ValueError):
    """A request field the chat template never reads (``param`` names it): refused rather than dropped."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class UnreadMessageFieldError(UnreadTemplateFieldError):
    """A message field (``name``, ``tool_calls``) the chat template never reads."""


def _renders_as(render: Render, messages: List[Dict[str, Any]], kwargs: Optional[Dict[str, Any]],
                text: str) -> bool:
    """True when ``messages`` render to ``text``; a render that fails without the data needed it (and
    one with no template to render by, as named templates without ``default`` give without tools)."""
    try:
        return render(messages, kwargs) == text
    except (ValueError, ServerChatTemplateError):
        return False


def _without(message: Dict[str, Any], key: str) -> Dict[str, Any]:
    return {name: value for name, value in message.items() if name != key}


def check_names(render: Render, messages: List[Dict[str, Any]], kwargs: Optional[Dict[str, Any]],
                text: str) -> None:
    """Refuse a message ``name`` without which the chat renders the same (``text``)."""
    named = [index for index, message in enumerate(messages) if message.get("name") is not None]
    if named and _renders_as(render, [_without(message, "name") for message in messages], kwargs, text):
        raise UnreadMessageFieldError(
            f"messages[{named[0]}].name has no effect: this model's chat template does not read message names; "
            "omit name (or start the server with a --chat_template that uses it)", f"messages.{named[0]}.name")
    if len(named) > 1:
        # A template may read names for some roles only (a tool message's): one name it reads
        # hid the ones it drops, so each is checked on its own (one render per named message).
        for index in named:
            alone = [_without(message, "name") if position == index else message
                     for position, message in enumerate(messages)]
            if _renders_as(render, alone, kwargs, text):
                role = messages[index].get("role")
                raise UnreadMessageFieldError(
                    f"messages[{index}].name has no effect: this model's chat template does not read the name of "
                    f"a {role} message; omit it there", f"messages.{index}.name")


def check_tool_calls(render: Render, messages: List[Dict[str, Any]], kwargs: Optional[Dict[str, Any]],
                     text: str) -> None:
    """Refuse a history's ``tool_calls`` when the chat renders the same without any of them.

    Checked for all calls at once (one render): tool calls live on assistant turns only, and a
    template that prints some turns' calls and not others' (the latest ones only, say) does so by
    design, as Qwen3's keeps only the recent turns' reasoning.
    """
    calling = [index for index, message in enumerate(messages) if message.get("tool_calls")]
    if calling and _renders_as(render, [_without(message, "tool_calls") for message in messages], kwargs, text):
        raise UnreadMessageFieldError(
            f"messages[{calling[0]}].tool_calls has no effect: this model's chat template does not render an "
            "assistant turn's tool calls, so the model would not see them; send the history without tool calls "
            "(or start the server with a --chat_template that renders them)", f"messages.{calling[0]}.tool_calls")


def check_tools(render: Render, messages: List[Dict[str, Any]], kwargs: Optional[Dict[str, Any]], text: str,
                source: Optional[str]) -> None:
    """Refuse ``tools`` when the chat renders the same without them (asked under tool_choice none only,
    where the prompt is all they act through).

    ``source``: the template rendered with the tools (None when it cannot be told).  It is kept for
    the render without them: with a tokenizer's named templates the tools pick ``tool_use``, and
    without them ``default`` would be compared, which differs for another reason.
    """
    if not (kwargs or {}).get("tools"):
        return
    without = {key: value for key, value in kwargs.items() if key != "tools"}
    if source is not None:
        without["chat_template"] = source
    if _renders_as(render, messages, without, text):
        raise UnreadTemplateFieldError(
            "tools have no effect with tool_choice 'none': this model's chat template does not render tools, so "
            "the model would not be told of them, and no call is read from the output; omit tools, or send "
            "tool_choice 'auto' (calls the model writes are read, as of tools described in a system message), "
            "'required' or a named function", "tools")
