"""Ctrl-C in a command-line tool: one line and the conventional exit status, never a traceback.

Ctrl-C is a request, not a fault.  compare_strategies set the pattern: ``error: interrupted;
<what became of the work>`` on stderr and exit status 130 (128 + SIGINT), after every child
process it started was stopped (their ``finally`` blocks run while the KeyboardInterrupt
unwinds, before the line is printed).  :func:`interruptible` gives a tool's ``main`` that
ending; a tool with partial results it can write says itself what it did with them.

A Ctrl-C while Python imports the tool's module (before ``main`` runs) cannot be caught here;
the tools import torch and the tokenizer inside ``main`` where they can.
"""

from __future__ import annotations

import functools
import signal
import sys
from typing import Callable, TypeVar

INTERRUPTED_STATUS = 128 + signal.SIGINT

Main = TypeVar("Main", bound=Callable[..., int])


def report_interrupted(what: str) -> int:
    """Print ``error: interrupted; <what>`` (one line) and return :data:`INTERRUPTED_STATUS`."""
    print(f"error: interrupted; {what}", file=sys.stderr)
    return INTERRUPTED_STATUS


def interruptible(what: str) -> Callable[[Main], Main]:
    """Decorate a ``main``: a KeyboardInterrupt ends it with :func:`report_interrupted` (``what``
    says what became of the work, e.g. ``nothing was written``)."""

    def wrap(main: Main) -> Main:
        @functools.wraps(main)
        def run(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except KeyboardInterrupt:
                return report_interrupted(what)

        return run  # type: ignore[return-value]

    return wrap
