"""Command-line parsers whose usage errors are one line, for every tool of the project.

argparse prints the whole usage block (dozens of flags) before its message; the server's and the
tools' refusals are one line naming the flag, so an operator scanning a log or a terminal finds
the message without reading the usage.  ``--help`` still prints everything.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any, List, NoReturn


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line: ``error: <argparse's message>``.

    Subclasses add hints (for example what to use instead of an unknown flag) with :meth:`hints`.
    A shortened flag (``--profil``) is refused like any unknown one: argparse would guess it from
    its prefix, and a guess that runs a minute of work is not what the user typed.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        matcher = getattr(self, "_negative_number_matcher", None)
        if matcher is not None:
            # argparse reads "-inf" / "-nan" as a flag ("expected one argument"); as values they get
            # the flag's own refusal (finite_float: "must be a finite number").
            self._negative_number_matcher = re.compile(rf"{matcher.pattern}|^-(inf|infinity|nan)$", re.IGNORECASE)

    def hints(self, message: str) -> List[str]:
        """Extra remarks for ``message``, put in parentheses after it (none here)."""
        return []

    def error(self, message: str) -> NoReturn:
        """Print ``error: message`` on one line and exit 2, as argparse's usage errors do."""
        hints = self.hints(message)
        why = f" ({'; '.join(hints)})" if hints else ""
        self.exit(2, f"error: {' '.join(message.split())}{why} (--help lists the flags)\n")


def finite_float(text: str) -> float:
    """argparse type of every float flag: nan and inf would pass range checks written as comparisons."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value
