"""Whether this user can read ``--model_dir`` and the files in it the server reads, checked first.

The checks after this one read each file with its own parser, and an ``OSError`` there (a file
``chmod 600`` by another user, a Hugging Face cache snapshot whose link points to a blob that was
deleted or never downloaded) surfaced as a raw traceback, or, for a directory that cannot be
listed, as "no config.json there".  Here each file is opened (nothing is read), so the refusal is
one line naming the file and what is wrong with it, before any child process starts.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Optional, Set

# The files of a Hugging Face checkpoint the launcher, its children or transformers read: the
# configs, the tokenizer's serializations and vocabularies, the chat template.  Other files a
# checkpoint often carries (LICENSE.txt, trainer_state.json, Mistral's params.json) are never
# opened, so a broken one must not refuse the start.
READ_NAMES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.json", "chat_template.jinja", "model.safetensors.index.json",
})
# SentencePiece and tiktoken vocabularies go by many names (tokenizer.model, spiece.model).
READ_SUFFIXES = (".model", ".tiktoken")
WEIGHTS_INDEX = "model.safetensors.index.json"


def _why(exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied for this user (uid {os.getuid()})"
    return exc.strerror or str(exc)


def checkpoint_access_problem(model_dir: str | Path, weights: bool = True) -> Optional[str]:
    """One line naming the first path of ``model_dir`` this process cannot read, or ``None``.

    ``model_dir`` itself must be listable and searchable; each top-level file the server reads
    (:data:`READ_NAMES`, :data:`READ_SUFFIXES`, chat templates, and the weights when ``weights``:
    the shards the index names, or every ``*.safetensors`` without one; a PD master loads none)
    must open for reading.  A symbolic link whose target is missing is named with that target.
    """
    directory = Path(model_dir)
    try:
        entries = sorted(os.scandir(directory), key=lambda entry: entry.name)
    except OSError as exc:
        return f"--model_dir {model_dir}: the directory cannot be read ({_why(exc)})"
    names = {entry.name for entry in entries}
    shards = _indexed_shards(directory) if weights and WEIGHTS_INDEX in names else None
    for entry in entries:
        name = entry.name
        if not _read_by_the_server(name, weights, shards):
            continue
        path = directory / name
        try:
            os.stat(path)  # follows links: a dangling one, or a loop, fails here
        except OSError as exc:
            if entry.is_symlink() and exc.errno == errno.ENOENT:
                # An HF cache snapshot whose blob is gone (or was never downloaded).
                try:
                    target = os.readlink(path)
                except OSError:
                    target = "?"
                resolved = (directory / target) if not os.path.isabs(target) else Path(target)
                return (f"{path} is a dangling link to {target} ({os.path.normpath(resolved)} does not exist); "
                        "download or copy the file again")
            return f"{path} cannot be read ({_why(exc)})"
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


def _read_by_the_server(name: str, weights: bool, shards: Optional[Set[str]]) -> bool:
    """Whether the server opens the top-level file ``name`` (see :data:`READ_NAMES`)."""
    if name.endswith(".safetensors"):
        # With an index, only the shards it names are loaded (a consolidated copy beside them is not).
        return weights and (shards is None or name in shards)
    return name in READ_NAMES or name.endswith(READ_SUFFIXES) or (name.startswith("chat_template")
                                                                 and name.endswith(".jinja"))


def _indexed_shards(directory: Path) -> Optional[Set[str]]:
    """The shard files the weights index names; None when it cannot be read as one (the index's
    own check, and the loader, name that problem)."""
    try:
        weight_map = json.loads((directory / WEIGHTS_INDEX).read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(weight_map, dict):
        return None
    return {str(shard) for shard in weight_map.values()}
