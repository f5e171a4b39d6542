"""What a request inherits when it leaves a field out: the checkpoint's sampling defaults and the chat template.

Resolved once at start-up from ``--generation_config`` and ``--chat_template`` (a bad file or
template is a one-line error before any process starts), then carried to whoever answers the
public API: a normal server's HTTP process or a PD master (:class:`~lightllm.server.served_model.ServedModel`).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from lightllm.common.basemodel.generation_defaults import GenerationDefaults, resolve_generation_defaults
from lightllm.common.basemodel.model_config import ModelConfig

log = logging.getLogger(__name__)

# Longest --chat_template accepted (a template file is a few KiB; a request's own is capped at 64 Ki chars).
MAX_CHAT_TEMPLATE_FILE_BYTES = 1 << 20


class _GenerationBlock(jinja2.ext.Extension):
    """Parses ``{% generation %}...{% endgeneration %}`` (training templates mark the assistant's
    tokens with it; transformers renders the body unchanged), so such a template passes the check."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def chat_template_environment() -> jinja2.Environment:
    """A sandboxed environment that parses what transformers renders chat templates with."""
    # The syntax transformers renders chat templates with: loop controls, generation blocks, and
    # its own tojson filter (jinja2 has one of that name, so compiling checks the same names).
    return jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols, _GenerationBlock])


@dataclass(frozen=True)
class RequestDefaults:
    """Defaults of the served model beyond the flags' own (``generation``: sampling; ``chat_template``:
    the text that replaces the tokenizer's template, None to keep it)."""

    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    chat_template: Optional[str] = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RequestDefaults":
        """Read ``--generation_config`` and ``--chat_template``; ``ValueError`` (one line) for a bad one."""
        generation = resolve_generation_defaults(args.generation_config, args.model_dir)
        template_flag = args.chat_template
        return cls(generation=generation,
                   chat_template=None if template_flag is None else read_chat_template_flag(template_flag))


def read_chat_template_flag(value: str) -> str:
    """``--chat_template``'s text: a file's contents, or the value itself when it is a Jinja template.

    Checked for Jinja syntax here, so a broken template stops the start, not every chat request.
    """
    path = Path(value)
    looks_like_template = "{{" in value or "{%" in value
    if not looks_like_template:
        if not path.is_file():
            raise ValueError(f"--chat_template {value}: no such file, and not a Jinja template either")
        if path.stat().st_size > MAX_CHAT_TEMPLATE_FILE_BYTES:
            raise ValueError(f"--chat_template {value}: larger than {MAX_CHAT_TEMPLATE_FILE_BYTES} bytes")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat_template {value}: cannot be read as text ({exc})") from exc
        source = str(path)
    else:
        text, source = value, "the value"
    if not text.strip():
        raise ValueError(f"--chat_template {value}: the template is empty")
    error = template_compile_error(text)
    if error is not None:
        raise ValueError(f"--chat_template: {source} {invalid_template(error)}") from error
    return text


def template_compile_error(text: str) -> Optional[jinja2.TemplateSyntaxError]:
    """The error of compiling ``text`` as transformers renders chat templates; None when it compiles.

    Compiled, not only parsed: an unknown filter or test is an error only at compile time.
    """
    try:
        chat_template_environment().from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        return exc
    return None


def invalid_template(exc: jinja2.TemplateSyntaxError) -> str:
    """The words of every refusal of a template that does not compile: reason and line."""
    return f"is not a valid Jinja template: {exc.message} (line {exc.lineno})"


def resolve_eos_token_ids(args: argparse.Namespace, config: ModelConfig) -> List[int]:
    """The ids generation stops at: ``--eos_id`` when given, else the checkpoint's (config.json,
    generation_config.json, the tokenizer's eos_token); ``ValueError`` (one line) for an id outside
    the vocabulary, which the ranks would refuse on every request."""
    given = args.eos_id
    ids = list(dict.fromkeys(given)) if given else list(config.eos_token_ids)
    outside = [token_id for token_id in ids if not 0 <= token_id < config.vocab_size]
    if outside:
        source = "--eos_id" if given else "the checkpoint's eos_token_id (config.json / generation_config.json)"
        raise ValueError(f"{source} names {outside}, outside the vocabulary [0, {config.vocab_size})")
    return ids


def warn_without_eos(args: argparse.Namespace, config: ModelConfig) -> None:
    """Say so at start when nothing names an end-of-sequence token: every request then runs to its length limit."""
    if not args.eos_id and not config.eos_token_ids:
        log.warning("no end-of-sequence token id in config.json, generation_config.json or the tokenizer's "
                    "eos_token: requests end only at max_tokens, a stop string or a stop token; give --eos_id")
