"""The server's command-line parser class: one-line usage errors that name what to use instead.

Users arrive from LightLLM and vLLM with their launch lines; a flag this server does not have is
refused (never guessed from a prefix), and where it has an equivalent the refusal names it.
Every float flag is parsed by :func:`~lightllm.utils.one_line_errors.finite_float`.
"""

from __future__ import annotations

import re
from typing import Collection, List

from lightllm.server.launch.foreign_flags import foreign_flag_hint
from lightllm.utils.one_line_errors import OneLineErrorParser as BaseOneLineErrorParser

_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")


def unknown_flag_hints(message: str, known_flags: Collection[str] = ()) -> List[str]:
    """``flag: hint`` for every unknown flag in argparse's ``unrecognized arguments`` message.

    ``known_flags``: the parser's own option strings. An unknown ``--foo-bar`` (vLLM spells its
    flags with dashes) whose ``--foo_bar`` is among them is named as that flag.
    """
    match = _UNRECOGNIZED.search(message)
    if match is None:
        return []
    hints = []
    for word in match.group(1).split():
        flag = word.split("=", 1)[0]
        hint = foreign_flag_hint(flag)
        if hint is not None:
            hints.append(f"{flag}: {hint}")
        elif flag.startswith("--") and "-" in flag[2:]:
            underscored = "--" + flag[2:].replace("-", "_")
            if underscored in known_flags:
                hints.append(f"{flag}: use {underscored}")
    return hints


class OneLineErrorParser(BaseOneLineErrorParser):
    """The project's one-line parser (:mod:`lightllm.utils.one_line_errors`) that also names this
    server's equivalent of an unknown flag that LightLLM or vLLM has."""

    def hints(self, message: str) -> List[str]:
        """``flag: what to use instead`` for each unknown LightLLM or vLLM flag in ``message``."""
        return unknown_flag_hints(message, self._option_string_actions.keys())
