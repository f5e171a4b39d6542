"""What a request manager knows about the model it serves, without loading a weight.

A normal server's HTTP process and a PD master both answer the public API for one model: they
name it (``model_name``, ``served_model_names``), tokenize prompts and chats with its tokenizer
and default ``max_new_tokens``; its limits (``vocab_size``, ``max_req_total_len``) are what a
request's :meth:`~lightllm.server.core.objs.request_spec.RequestSpec.check_fits` is run against.  :class:`ServedModel`
holds those facts and the pure functions over them, so every manager behaves the same; it reads
only the checkpoint's tokenizer files (through :func:`~lightllm.utils.tokenizer_utils.load_tokenizer`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Any, Dict, List, Optional, Sequence

import jinja2

from lightllm.common.basemodel.generation_defaults import GenerationDefaults
from lightllm.server.grammar_tokenizer_check import GrammarTokenizerCheck
from lightllm.server.manager_errors import ServerChatTemplateError
from lightllm.server.prompt_length_probe import RenderedChatTooLongError, encode_within
from lightllm.server.request_defaults import RequestDefaults, invalid_template, template_compile_error
from lightllm.server.request_template_cache import request_template_render
from lightllm.server.chat_render_checks import UnreadTemplateFieldError, check_names, check_tool_calls, check_tools
from lightllm.server.template_variables import (call_argument_keys, call_argument_message, checked_variables,
                                                implied_readers, template_source, template_variables, unread_message,
                                                variable_param)

log = logging.getLogger(__name__)


def served_names(model_dir: str, model_names: Optional[Sequence[str]]) -> tuple[str, List[str]]:
    """``(model_name, served_model_names)`` from ``--model_dir`` and ``--model_name``.

    ``--model_name`` values when given (the first is the reported id), else the directory's
    name plus the checkpoint path as given on the command line (vLLM's default id) and as an
    absolute path (what /v1/models reports as ``root``, which vLLM clients send back as ``model``).
    """
    model_path = model_dir.rstrip("/") or model_dir
    if model_names:
        return model_names[0], list(dict.fromkeys(model_names))
    name = Path(model_path).name
    return name, list(dict.fromkeys([name, model_dir, model_path, os.path.abspath(model_dir)]))


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True, within: Optional[int] = None) -> List[int]:
    """Token ids of ``text``, by default with the special tokens (BOS) the tokenizer adds.

    ``within``: a token limit; a text a prefix of which already needs more raises
    :class:`~lightllm.server.prompt_length_probe.PromptOverContextError` without being tokenized whole.
    """
    return encode_within(lambda part: list(tokenizer(part, add_special_tokens=add_special_tokens, verbose=False)["input_ids"]),
                         text, within)


def server_template_problem(exc: jinja2.TemplateSyntaxError, name: Optional[str] = None) -> str:
    """One line saying the server's chat template (``name``: one of several) does not compile, and how to replace it."""
    which = f"chat template {name!r}" if name is not None else "chat template"
    return f"the server's {which} {invalid_template(exc)}; start the server with --chat_template to replace it"


def check_checkpoint_templates(tokenizer: Any) -> Optional[str]:
    """The problem of the first of the tokenizer's chat templates (one, or a name -> template mapping)
    that does not compile, or of named templates none of which is the default; None when there is
    none. Checked at start: otherwise every chat request found it."""
    templates = getattr(tokenizer, "chat_template", None)
    named = templates.items() if isinstance(templates, dict) else [(None, templates)]
    for name, template in named:
        error = template_compile_error(template) if isinstance(template, str) else None
        if error is not None:
            return server_template_problem(error, name)
    return missing_default_template(templates)


def missing_default_template(templates: Any) -> Optional[str]:
    """The problem of named chat templates with none named ``default`` (None when not so).

    transformers renders a chat with ``default``, or ``tool_use`` when the request has tools; with
    neither it fails every chat without tools ("multiple chat templates with no default
    specified"), which a client cannot fix: a request's template needs --trust_request_chat_template.
    """
    if not isinstance(templates, dict) or not templates or "default" in templates:
        return None
    names = ", ".join(repr(name) for name in templates)
    return (f"the server's chat templates are named {names}, none of them 'default': a chat without tools has no "
            f"template{'' if 'tool_use' in templates else ' (nor one with tools: no tool_use)'}; start the server "
            "with --chat_template to give one")


class ChatTemplateSyntaxError(ValueError):
    """A request's own ``chat_template`` is not a valid Jinja template (``param`` names the field)."""

    param = "chat_template"


def encode_chat_messages(
    tokenizer: Any,
    messages: List[Dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Optional[Dict[str, Any]] = None,
    within: Optional[int] = None,
    max_chars: Optional[int] = None,
    check_tools_read: bool = True,
    implied_variables: AbstractSet[str] = frozenset(),
) -> List[int]:
    """Token ids of a chat rendered with the tokenizer's chat template (``ValueError`` if it cannot be).

    ``within``: a token limit, as for :func:`encode_text` (the rendered text is what is probed).
    ``max_chars``: a limit on the rendered text's characters, checked before it is tokenized
    (:class:`~lightllm.server.prompt_length_probe.RenderedChatTooLongError`).
    ``check_tools_read``: refuse ``tools`` (in ``chat_template_kwargs``) that the template does not
    render; false where they act otherwise too (``tool_choice`` auto reads calls of them from the output,
    a forced call holds them in its grammar) or nothing is generated (``/tokenize``).
    ``implied_variables``: keys of ``chat_template_kwargs`` the server set from a request field
    (``enable_thinking`` from ``reasoning_effort``), not the client: see :func:`_check_variables_read`.
    """
    # A request's own template (vLLM's chat_template field) arrives in chat_template_kwargs.
    if not getattr(tokenizer, "chat_template", None) and not (chat_template_kwargs or {}).get("chat_template"):
        raise ValueError("this model has no chat template: start the server with --chat_template, or use /v1/completions")

    for name in call_argument_keys(tokenizer, chat_template_kwargs):
        # Checked before the first render: such an argument can make transformers fail the render.
        raise UnreadTemplateFieldError(call_argument_message(name), f"chat_template_kwargs.{name}")

    def render(conversation: List[Dict[str, Any]], kwargs: Optional[Dict[str, Any]] = chat_template_kwargs) -> str:
        return _render_chat(tokenizer, conversation, add_generation_prompt, continue_final_message, kwargs)

    text = render(messages)
    printed = [index for index, message in enumerate(messages)
               if isinstance(message.get("content"), list) and repr(message["content"]) in text]
    if printed:
        # The template loops over content parts for some roles only and printed this one's list
        # as Python syntax (a tool message, in most templates that loop): give those their text.
        messages = [_joined_content(message) if index in printed else message for index, message in enumerate(messages)]
        text = render(messages)
    # Before the checks below, each of which may render the chat again: an over-long chat is refused
    # after one render (two when its content parts were rendered again just above).
    if max_chars is not None and len(text) > max_chars:
        raise RenderedChatTooLongError(max_chars, len(text))
    # Data the template may drop without a word: refused unless the rendered chat depends on it.
    check_names(render, messages, chat_template_kwargs, text)
    check_tool_calls(render, messages, chat_template_kwargs, text)
    if check_tools_read:
        check_tools(render, messages, chat_template_kwargs, text, template_source(tokenizer, chat_template_kwargs))
    _check_variables_read(tokenizer, messages, add_generation_prompt, continue_final_message, chat_template_kwargs,
                          text, implied_variables)
    # The template writes BOS itself when it wants one; encode without adding another.
    return encode_text(tokenizer, text, add_special_tokens=False, within=within)


def _check_variables_read(tokenizer: Any, messages: List[Dict[str, Any]], add_generation_prompt: bool,
                          continue_final_message: bool, chat_template_kwargs: Optional[Dict[str, Any]],
                          text: str, implied_variables: AbstractSet[str] = frozenset()) -> None:
    """Refuse ``documents``, ``reasoning_effort`` or a ``chat_template_kwargs`` key the template never reads.

    Read from the template's source (:mod:`lightllm.server.template_variables`), so nothing is
    rendered again unless the source cannot be parsed; then a variable without which the chat
    renders the same (``text``) is the one refused.  Nothing is done when no such variable is given.
    ``implied_variables`` (set by the server from a field) are not checked on their own: the field
    that set them is read when the template reads its own variable or any of them
    (``reasoning_effort`` under a template that reads only ``enable_thinking`` works, as in vLLM).
    """
    names = [name for name in checked_variables(tokenizer, chat_template_kwargs) if name not in implied_variables]
    if not names:
        return
    read = template_variables(tokenizer, chat_template_kwargs)
    for name in names:
        readers = implied_readers(name, implied_variables)
        if read is not None:
            unread = not any(reader in read for reader in readers)
        else:
            without = {key: value for key, value in (chat_template_kwargs or {}).items() if key not in readers}
            unread = _render_chat(tokenizer, messages, add_generation_prompt, continue_final_message,
                                  without) == text
        if unread:
            raise UnreadTemplateFieldError(unread_message(name, readers, chat_template_kwargs), variable_param(name))


def _render_chat(tokenizer: Any, messages: List[Dict[str, Any]], add_generation_prompt: bool,
                 continue_final_message: bool, chat_template_kwargs: Optional[Dict[str, Any]]) -> str:
    kwargs = chat_template_kwargs or {}
    templates = getattr(tokenizer, "chat_template", None)
    chooses = kwargs.get("chat_template") or (kwargs.get("tools") and isinstance(templates, dict) and "tool_use" in templates)
    missing = None if chooses else missing_default_template(templates)
    if missing is not None:
        raise ServerChatTemplateError(missing)
    # A request's own template is compiled for this render only: transformers' LRU of compiled
    # templates would keep it (and the constants Jinja folded into it) after the request.
    scope = request_template_render() if kwargs.get("chat_template") else contextlib.nullcontext()
    try:
        with scope:
            return tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
    except jinja2.TemplateSyntaxError as exc:
        if (chat_template_kwargs or {}).get("chat_template"):
            raise ChatTemplateSyntaxError(
                f"chat_template {invalid_template(exc)}") from exc
        # The server's own template: no chat can render, whatever the client sends.
        raise ServerChatTemplateError(server_template_problem(exc)) from exc
    except Exception as exc:
        raise ValueError(f"chat template failed: {exc}") from exc


def _joined_content(message: Dict[str, Any]) -> Dict[str, Any]:
    # Parts joined with newlines, as a template that does not loop over them gets every message's.
    return {**message, "content": "\n".join(part["text"] for part in message["content"])}


def default_max_new_tokens(
    max_req_total_len: int, prompt_len: int, configured: Optional[int], fallback: Optional[int] = None,
    checkpoint: Optional[int] = None,
) -> int:
    """max_new_tokens for a request that gives none.

    ``configured`` (``--max_new_tokens_default``) when set, else the checkpoint's
    ``generation_config.json`` ``max_new_tokens`` (``checkpoint``), else the endpoint's own
    default ``fallback``, else the rest of the context; never more than the rest of the context.
    """
    remaining = max(1, max_req_total_len - prompt_len)
    for default in (configured, checkpoint, fallback):
        if default is not None:
            return min(default, remaining)
    return remaining


@dataclass
class ServedModel:
    """The served model's names, tokenizer and limits, with the API-facing helpers over them."""

    model_name: str
    served_model_names: List[str]
    tokenizer: Any
    vocab_size: int
    eos_token_ids: List[int]
    max_req_total_len: int
    max_new_tokens_default: Optional[int] = None
    request_defaults: RequestDefaults = field(default_factory=RequestDefaults)
    # --model_dir as an absolute path: a model card's ``root`` (vLLM reports its --model there).
    model_path: str = ""
    grammar_check: GrammarTokenizerCheck = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.request_defaults.chat_template is not None:
            # --chat_template: every chat renders with it (a request's own still replaces it).
            self.tokenizer.chat_template = self.request_defaults.chat_template
        else:
            problem = check_checkpoint_templates(self.tokenizer)
            if problem is not None:
                # Warned, not refused: completions and /generate do not need it.
                templates = getattr(self.tokenizer, "chat_template", None)
                which = ("every chat without tools" if problem == missing_default_template(templates)
                         and "tool_use" in templates else "every chat request")
                log.warning("%s; until then %s fails with 500 chat_template_invalid", problem, which)
        self.check_eos_ids()
        self.grammar_check = GrammarTokenizerCheck(self.tokenizer, self.eos_token_ids)
        size = len(self.tokenizer) if hasattr(self.tokenizer, "__len__") else 0
        if size > self.vocab_size:
            log.warning("the tokenizer has %d tokens and the model reads %d: a prompt holding one of the others is "
                        "refused with a 400 naming it", size, self.vocab_size)

    def check_eos_ids(self) -> None:
        """Warn when the loaded tokenizer's ``eos_token`` is not an id generation stops at.

        The launcher read it from the tokenizer files without transformers
        (:func:`~lightllm.utils.tokenizer_files.tokenizer_eos_token_id`); a tokenizer it could not read
        that way, or ``--eos_id`` leaving it out, would let chats run past their end of turn.
        """
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int) and 0 <= eos < self.vocab_size and eos not in self.eos_token_ids:
            log.warning("the tokenizer's eos_token (id %d) is not among the end-of-sequence ids %s, so generation "
                        "does not stop at it; give --eos_id with every id to stop at", eos, self.eos_token_ids)

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """The sampling fields a request inherits (``--generation_config``)."""
        return self.request_defaults.generation

    def encode_prompt(self, text: str, add_special_tokens: bool = True, within: Optional[int] = None) -> List[int]:
        """Token ids of a text prompt (``within``: see :func:`encode_text`)."""
        return encode_text(self.tokenizer, text, add_special_tokens, within)

    def encode_chat(
        self,
        messages: List[Dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
        within: Optional[int] = None,
        max_chars: Optional[int] = None,
        check_tools_read: bool = True,
        implied_variables: AbstractSet[str] = frozenset(),
    ) -> List[int]:
        """Token ids of a chat rendered with the model's template (``within``, ``max_chars``,
        ``check_tools_read``, ``implied_variables``: see :func:`encode_chat_messages`)."""
        return encode_chat_messages(
            self.tokenizer, messages, add_generation_prompt, continue_final_message, chat_template_kwargs, within,
            max_chars, check_tools_read, implied_variables,
        )

    def default_max_new_tokens(self, prompt_len: int, fallback: Optional[int] = None) -> int:
        """max_new_tokens for a request that gives none (see :func:`default_max_new_tokens`)."""
        return default_max_new_tokens(self.max_req_total_len, prompt_len, self.max_new_tokens_default, fallback,
                                      self.generation_defaults.max_new_tokens)

    def structured_output_problem(self) -> Optional[str]:
        """Why grammars cannot run with this tokenizer (None: they can); see :class:`GrammarTokenizerCheck`."""
        return self.grammar_check.problem()
