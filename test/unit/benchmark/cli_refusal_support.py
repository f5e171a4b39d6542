"""The one assertion the benchmark command-line tests share: a refusal is one ``error:`` line, exit 2."""

from __future__ import annotations

import argparse
from typing import Callable, List

import pytest


def one_line_refusal(main: Callable[[List[str]], object], argv: List[str], capsys) -> str:
    """Run ``main(argv)``; it must exit with status 2 and print exactly one stderr line, ``error: ...``.

    Returns that line.  argparse's usage block before the message, or a traceback, fails.
    """
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{err}"
    assert lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


class _Parsed(Exception):
    """Raised in place of ``parse_args`` to hand the parser a ``main`` built back to the test."""


def parser_of(main: Callable[[List[str]], object], monkeypatch) -> argparse.ArgumentParser:
    """The parser ``main`` builds (caught at its ``parse_args`` call; nothing after it runs)."""

    def caught(self, *args, **kwargs):
        raise _Parsed(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", caught)
        with pytest.raises(_Parsed) as parsed:
            main([])
    return parsed.value.args[0]


def flags_without_help(parser: argparse.ArgumentParser) -> List[str]:
    """The flags (or positionals) of ``parser`` whose ``--help`` line has no description."""
    return [
        "/".join(action.option_strings) or action.dest
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction) and (not action.help or action.help == argparse.SUPPRESS)
    ]
