"""Whether this user can read ``--model_dir`` and the files in it the server reads, checked first.

The checks after this one read each file with its own parser, and an ``OSError`` there (a file
``chmod 600`` by another user, a Hugging Face cache snapshot whose link points to a blob that was
deleted or never downloaded) surfaced as a raw traceback, or, for a directory that cannot be
listed, as "no config.json there".  Here each file is opened (nothing is read), so the refusal is
one line naming the file and what is wrong with it, before any child process starts.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Optional

# The files of a Hugging Face checkpoint the launcher, its children or transformers read: configs
# and tokenizer serializations (*.json), weights, SentencePiece / tiktoken vocabularies, BPE merges
# and WordPiece vocabularies (*.txt), chat templates (*.jinja).  Others (a README) are never opened.
READ_SUFFIXES = (".json", ".safetensors", ".model", ".tiktoken", ".txt", ".jinja")


def _why(exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied for this user (uid {os.getuid()})"
    return exc.strerror or str(exc)


def checkpoint_access_problem(model_dir: str | Path, weights: bool = True) -> Optional[str]:
    """One line naming the first path of ``model_dir`` this process cannot read, or ``None``.

    ``model_dir`` itself must be listable and searchable; each top-level file with a name in
    :data:`READ_SUFFIXES` (``*.safetensors`` only when ``weights``: a PD master loads none) must
    open for reading.  A symbolic link whose target is missing is named with that target.
    """
    directory = Path(model_dir)
    try:
        entries = sorted(os.scandir(directory), key=lambda entry: entry.name)
    except OSError as exc:
        return f"--model_dir {model_dir}: the directory cannot be read ({_why(exc)})"
    for entry in entries:
        name = entry.name
        if not name.endswith(READ_SUFFIXES) or (name.endswith(".safetensors") and not weights):
            continue
        path = directory / name
        if entry.is_symlink() and not path.exists():
            # exists() follows the link: a dangling one (an HF snapshot whose blob is gone) lands here.
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            resolved = (directory / target) if not os.path.isabs(target) else Path(target)
            return (f"{path} is a dangling link to {target} ({os.path.normpath(resolved)} does not exist); "
                    "download or copy the file again")
        if path.is_dir():
            continue
        if not path.is_file():
            # A FIFO would block the open below for good; no parser reads one either.
            return f"{path} is not a regular file"
        # os.access answers from the permission bits for this user; the open catches what the bits
        # do not show (an ACL, a mount that refuses reads).
        if not os.access(path, os.R_OK):
            return f"{path} cannot be read (permission denied for this user (uid {os.getuid()}))"
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            return f"{path} cannot be read ({_why(exc)})"
    return None
