"""What the benchmark and simulator command lines share: one-line usage errors and argument types
that check paths and numbers while the flags are parsed, before any long work starts.

:class:`OneLineErrorParser` is the project's (:mod:`lightllm.utils.one_line_errors`: ``error:
<message> (--help lists the flags)``, exit 2), exported here so a tool has one import for its parser
and its types.

A type here raises :class:`argparse.ArgumentTypeError`, so argparse prefixes the flag:
``error: argument --json: the directory of '/x/out.json' does not exist``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import tempfile
from pathlib import Path
from typing import Callable, List, Optional

from lightllm.utils.one_line_errors import OneLineErrorParser, finite_float

__all__ = [
    "OneLineErrorParser", "argument_type", "checkpoint_dir", "finite_float", "non_negative_float", "non_negative_int",
    "comma_items", "output_dir", "output_file", "output_file_in_new_dirs", "positive_float", "shell_words",
]


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def comma_items(text: str) -> List[str]:
    """The items of a comma list, stripped; ``ValueError`` for an empty item (``1024,,4096``: a typo
    that would otherwise drop a value silently) or an empty list."""
    items = [part.strip() for part in text.split(",")]
    if not any(items):
        raise ValueError(f"expected a comma list, got {text!r}")
    if not all(items):
        raise ValueError(f"{text!r} has an empty item between commas")
    return items


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def shell_words(text: str) -> str:
    """Flags given as one shell-quoted string (split later with ``shlex.split``); refused when unbalanced."""
    try:
        shlex.split(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid shell-quoted string: {exc}") from None
    return text


def argument_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """``parse`` as an argparse type: its ``ValueError`` message is kept (argparse would drop it)."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _cannot_write_in(directory: Path) -> Optional[str]:
    """Why no file can be created in the existing ``directory`` (None when one can).

    Creating one is the only reliable test: permission bits say nothing for root, nor for
    /proc or a read-only mount.
    """
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return f"no file can be created in {str(directory)!r} ({exc.strerror or exc})"
    return None


def _cannot_create(directory: Path) -> Optional[str]:
    """Why the missing ``directory`` (absolute) cannot be created with its parents (None when it can)."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{str(existing)!r} is not a directory"
    return _cannot_write_in(existing)


def _not_a_file(text: str) -> None:
    if not text:
        raise argparse.ArgumentTypeError("must name a file, got ''")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")


def output_file(text: str) -> str:
    """A file the tool can write: its directory exists and takes new files; not a directory itself."""
    _not_a_file(text)
    path = Path(text)
    directory = path.absolute().parent
    if not directory.is_dir():
        raise argparse.ArgumentTypeError(f"the directory of {text!r} does not exist")
    why = _cannot_write_in(directory)
    if why is None and path.exists() and not os.access(path, os.W_OK):
        why = "permission denied"
    if why is not None:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written: {why}")
    return text


def output_file_in_new_dirs(text: str) -> str:
    """A file the tool can write after creating its missing directories."""
    _not_a_file(text)
    directory = Path(text).absolute().parent
    if directory.is_dir():
        return output_file(text)
    why = _cannot_create(directory)
    if why is not None:
        raise argparse.ArgumentTypeError(f"the directory of {text!r} cannot be created: {why}")
    return text


def output_dir(text: str) -> str:
    """A directory the tool can write files in: it exists and takes files, or it can be created."""
    if not text:
        raise argparse.ArgumentTypeError("must name a directory, got ''")
    path = Path(text).absolute()
    if path.exists():
        why = _cannot_write_in(path) if path.is_dir() else "it is not a directory"
        if why is not None:
            raise argparse.ArgumentTypeError(f"{text!r} cannot be written in: {why}")
    else:
        why = _cannot_create(path)
        if why is not None:
            raise argparse.ArgumentTypeError(f"{text!r} cannot be created: {why}")
    return text


def checkpoint_dir(text: str) -> str:
    """A local checkpoint directory: one with a ``config.json`` (checked before any server starts)."""
    if not Path(text, "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a local checkpoint directory (no config.json there)")
    return text
