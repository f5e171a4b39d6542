"""Write a tool's output files, then print its report: the order and the failures of the end of a run.

A tool that simulates or measures for minutes must not lose its result at the last moment:

* the simulator tools write their files before anything is printed, so a reader that closes
  stdout early (``| head -1``) cannot stop them being written; the tools that measure a live
  server (bench_serving, bench_burst, bench_hf_baseline, soak_server) print their summary first,
  so a file that then cannot be written loses nothing already shown;
* a file that cannot be written (a full disk: ``--json /dev/full``) is a one-line error naming
  the flag and the path, not an OSError traceback;
* JSON is strict (``allow_nan=False``): NaN and Infinity are not JSON, and a reader such as
  ``jq`` refuses the whole file;
* a closed stdout ends the printing quietly (for the simulator tools, the files being already written).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple


def strict_json(document: Any) -> str:
    """``document`` as indented UTF-8 JSON text; a NaN or an infinity raises ValueError."""
    try:
        return json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    except ValueError as exc:
        raise ValueError(f"the results hold a number JSON cannot hold (NaN or infinity): {exc}") from None


def write_output(flag: str, path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` (the value of ``flag``); an OSError raises ValueError naming both."""
    out = Path(path)
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{flag} {str(path)!r} could not be written: {exc.strerror or exc}") from None
    return out


def refuse_same_output(outputs: Sequence[Tuple[str, Optional[str]]]) -> None:
    """Raise ValueError when two of ``outputs`` (flag, path or None) name the same file: one
    output would silently replace the other.  Paths are compared resolved (``./a`` and ``a``,
    links)."""
    seen: dict[Path, str] = {}
    for flag, path in outputs:
        if not path:
            continue
        resolved = Path(path).resolve()
        if resolved in seen:
            raise ValueError(f"{seen[resolved]} and {flag} name the same file ({path!r}): the second would "
                             "replace the first; give each its own file")
        seen[resolved] = flag


def print_report(text: str) -> bool:
    """Print ``text`` on stdout; False (and nothing raised) when the reader closed the pipe."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would report the broken pipe again when it flushes stdout at exit: point
        # stdout at /dev/null, so the tool ends quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass  # stdout is no real file (a test's capture): nothing will flush it at exit
        finally:
            os.close(devnull)
        return False
    return True


def write_outputs_or_exit(parser: argparse.ArgumentParser, outputs: Sequence[Tuple[str, Optional[str], str]]) -> None:
    """Write each (flag, path, text) whose path is given; the first failure is ``parser.error``
    (one line, exit 2)."""
    for flag, path, text in outputs:
        if not path:
            continue
        try:
            write_output(flag, path, text)
        except ValueError as exc:
            parser.error(str(exc))
