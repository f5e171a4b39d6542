"""Which variables a chat template reads, so a request value it never reads is refused, not dropped.

``documents``, ``reasoning_effort`` and every ``chat_template_kwargs`` key reach the chat template
only as variables of its context (transformers' ``apply_chat_template`` hands them on as they are).
A template that never names one would render the chat exactly as without it: the request would be
accepted and the value ignored.  vLLM drops such ``chat_template_kwargs`` keys silently; this server
refuses them with a 400 naming the field (``documents``, ``chat_template_kwargs.<key>``).

"Reads" is decided from the template's source, as vLLM decides which keys to keep: the names the
template uses without defining them itself (``jinja2.meta.find_undeclared_variables``).  This is
not the same as "changes the prompt": ``enable_thinking: true`` under a template that only tests
``enable_thinking is false`` renders as without it, and is still a value the template honours.
Only a template this module cannot parse (a custom tag) falls back to rendering the chat without
the variable and comparing.

A variable the server sets itself from a request field (``enable_thinking`` from
``reasoning_effort``, :data:`IMPLIED_VARIABLES`) is not the client's and is never refused on its
own; the field counts as read when the template reads the field's variable or one it set.

Not checked here: the template call's own arguments (a request's ``chat_template`` is the template
itself; ``tools`` also select a template and decide how the output is read), which the request
model keeps out of ``chat_template_kwargs`` or which the call consumes.  Tools a template does not
render are refused by rendering without them (:mod:`lightllm.server.chat_render_checks`).
"""

from __future__ import annotations

import functools
import inspect
from typing import AbstractSet, Any, Dict, FrozenSet, List, Optional, Sequence

import jinja2
import jinja2.meta

from lightllm.server.request_defaults import chat_template_environment
from lightllm.server.request_template_cache import cached_unless_request

# Variables that are request fields of their own (named so in a 400); any other key came in
# chat_template_kwargs.
FIELD_VARIABLES = ("documents", "reasoning_effort")
# Variables the server sets from a request field (variable -> that field) unless chat_template_kwargs
# sets them (vLLM 0.32: reasoning_effort sets enable_thinking; ChatTemplateFields.implied_template_variables).
IMPLIED_VARIABLES: Dict[str, str] = {"enable_thinking": "reasoning_effort"}
# Arguments of apply_chat_template that are not template variables, whatever the tokenizer.
_CALL_ARGUMENTS = frozenset({"chat_template", "tools"})
_TEMPLATE_CACHE = 32


# Parses with the syntax the server renders and checks templates with (one definition of it).
_ENV = chat_template_environment()


def variable_param(name: str) -> str:
    """The request field that set template variable ``name`` (the ``param`` of its 400)."""
    return name if name in FIELD_VARIABLES else f"chat_template_kwargs.{name}"


@functools.lru_cache(maxsize=8)
def _call_arguments(tokenizer_type: type) -> FrozenSet[str]:
    try:
        parameters = inspect.signature(tokenizer_type.apply_chat_template).parameters
    except (AttributeError, TypeError, ValueError):
        return _CALL_ARGUMENTS
    named = {name for name, parameter in parameters.items()
             if parameter.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)}
    # documents is an argument transformers hands to the template as the variable of that name.
    return frozenset((named | _CALL_ARGUMENTS) - {"self", "documents"})


def checked_variables(tokenizer: Any, chat_template_kwargs: Optional[Dict[str, Any]]) -> List[str]:
    """The keys of ``chat_template_kwargs`` that reach the template only as variables."""
    if not chat_template_kwargs:
        return []
    consumed = _call_arguments(type(tokenizer))
    return [name for name in chat_template_kwargs if name not in consumed]


def call_argument_keys(tokenizer: Any, chat_template_kwargs: Optional[Dict[str, Any]]) -> List[str]:
    """Keys of ``chat_template_kwargs`` that ``apply_chat_template`` itself takes as arguments.

    The server passes only the request's template and tools that way; any other such key came from
    the client's ``chat_template_kwargs`` (the request model refuses the arguments the server sets,
    such as ``tokenize``), and would change how transformers renders (a newer release's
    ``sanitize_control_tokens`` needs ``tokenize=True`` and fails the render), not what the
    template reads.
    """
    if not chat_template_kwargs:
        return []
    consumed = _call_arguments(type(tokenizer))
    return [name for name in chat_template_kwargs if name in consumed and name not in _CALL_ARGUMENTS]


def call_argument_message(name: str) -> str:
    """The 400's message for a ``chat_template_kwargs`` key that is an argument of the render call."""
    return (f"chat_template_kwargs.{name} is an argument of transformers' apply_chat_template, not a variable of "
            "the chat template; the server renders chats with its own arguments, so it is not supported here")


def _parse_undeclared(source: str) -> FrozenSet[str]:
    return frozenset(jinja2.meta.find_undeclared_variables(_ENV.parse(source)))


# Cached for the server's templates; a request's own chat_template is parsed each time and kept
# nowhere (request_template_cache).
_undeclared = cached_unless_request(_parse_undeclared, maxsize=_TEMPLATE_CACHE)


def template_source(tokenizer: Any, chat_template_kwargs: Optional[Dict[str, Any]]) -> Optional[str]:
    """The text of the template ``apply_chat_template`` renders this chat with; None when it cannot be told.

    The request's own (``chat_template``) or the tokenizer's, the ``tool_use`` one of a set of named
    templates when tools are given.
    """
    kwargs = chat_template_kwargs or {}
    try:
        source = tokenizer.get_chat_template(kwargs.get("chat_template"), kwargs.get("tools"))
    except Exception:  # noqa: BLE001 - a tokenizer without transformers' lookup: its one template, if it has one
        source = kwargs.get("chat_template") or getattr(tokenizer, "chat_template", None)
    return source if isinstance(source, str) else None


def template_variables(tokenizer: Any, chat_template_kwargs: Optional[Dict[str, Any]]) -> Optional[FrozenSet[str]]:
    """The variables the template rendering this chat reads (:func:`template_source`); None when its
    source cannot be told or parsed here."""
    source = template_source(tokenizer, chat_template_kwargs)
    if source is None:
        return None
    try:
        return _undeclared(source, request_template=bool((chat_template_kwargs or {}).get("chat_template")))
    except jinja2.TemplateError:
        return None


def implied_readers(name: str, implied: AbstractSet[str]) -> List[str]:
    """The variables through which field variable ``name`` reaches the template: itself and those of
    ``implied`` (the server set them) that it sets; it has an effect when the template reads any."""
    return [name, *(variable for variable in sorted(implied) if IMPLIED_VARIABLES.get(variable) == name)]


def unread_message(name: str, readers: Sequence[str] = (), chat_template_kwargs: Optional[Dict[str, Any]] = None) -> str:
    """The 400's message for a variable the template never reads.

    ``readers``: the variables through which it would have reached the template
    (:func:`implied_readers`; itself alone when empty).  ``chat_template_kwargs``: what the
    client's own keys were, to say when one of them kept the field from setting a variable.
    """
    if name == "documents":
        return ("documents has no effect: the chat template in use does not read documents (it is not a RAG "
                "template); omit documents (or start the server with a --chat_template that uses them)")
    if name == "reasoning_effort":
        if "enable_thinking" in readers:
            return ("reasoning_effort has no effect on this model: the chat template in use reads neither "
                    "reasoning_effort nor enable_thinking (which reasoning_effort sets), so it is not a reasoning "
                    "model; omit it")
        if "enable_thinking" in (chat_template_kwargs or {}):
            # The client's enable_thinking replaced the one reasoning_effort would set.
            return ("reasoning_effort has no effect here: the chat template in use does not read reasoning_effort, "
                    "and enable_thinking, which reasoning_effort would set, is given in chat_template_kwargs; omit "
                    "reasoning_effort (or leave enable_thinking to it)")
        return ("reasoning_effort has no effect on this model: the chat template in use does not read it (it is not "
                "a reasoning model); omit it")
    return (f"{variable_param(name)} has no effect: the chat template in use does not read a variable named "
            f"{name!r}; omit it")
