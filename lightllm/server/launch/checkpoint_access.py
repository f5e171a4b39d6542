"""Whether this user can read ``--model_dir`` and the files in it the server reads, checked first.

The checks after this one read each file with its own parser, and an ``OSError`` there (a file
``chmod 600`` by another user, a Hugging Face cache snapshot whose link points to a blob that was
deleted or never downloaded) surfaced as a raw traceback, or, for a directory that cannot be
listed, as "no config.json there".  Here each file is opened (nothing is read), so the refusal is
one line naming the file and what is wrong with it, before any child process starts.
"""

from __future__ import annotations

import errno
import fnmatch
import os
from pathlib import Path
from typing import List, Optional, Set

from lightllm.common.basemodel.checkpoint_files import INDEX_FILE, SINGLE_FILE, CheckpointFilesError, read_weight_map
from lightllm.utils.tokenizer_sources import (TOKENIZER_CONFIG, VOCABULARY_NAMES, VOCABULARY_PATTERNS,
                                              read_tokenizer_config)

# The files of a Hugging Face checkpoint the launcher, its children or transformers read: the
# configs, the tokenizer's serializations and vocabularies (the names and patterns tokenizer
# detection uses, plus a serialization tokenizer_config.json's fast_tokenizer_files names), BPE
# merges, chat templates (also those in additional_chat_templates/, which transformers opens),
# and the weights by the loader's rule.  Other files a checkpoint often carries (LICENSE.txt,
# trainer_state.json, Mistral's params.json or consolidated.safetensors) are never opened, so a
# broken one must not refuse the start.
READ_NAMES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", TOKENIZER_CONFIG, "special_tokens_map.json",
    "added_tokens.json", "merges.txt", "chat_template.json", "chat_template.jinja", *VOCABULARY_NAMES,
})
TEMPLATE_DIR = "additional_chat_templates"


def _why(exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied for this user (uid {os.getuid()})"
    return exc.strerror or str(exc)


def checkpoint_access_problem(model_dir: str | Path, weights: bool = True) -> Optional[str]:
    """One line naming the first path of ``model_dir`` this process cannot read, or ``None``.

    ``model_dir`` itself must be listable and searchable; each file the server reads (see
    :data:`READ_NAMES`; the weights only when ``weights``: a PD master loads none) must open for
    reading.  A symbolic link whose target is missing is named with that target.
    """
    directory = Path(model_dir)
    try:
        names = sorted(entry.name for entry in os.scandir(directory))
    except OSError as exc:
        return f"--model_dir {model_dir}: the directory cannot be read ({_why(exc)})"
    fast_files = _fast_tokenizer_files(directory)
    read = [name for name in names if _is_tokenizer_or_config(name, fast_files)]
    if weights:
        read += _weight_names(directory, names)
    if TEMPLATE_DIR in names:
        try:
            # A dangling link there transformers skips; one it finds but cannot read fails it.
            read += sorted(f"{TEMPLATE_DIR}/{entry.name}" for entry in os.scandir(directory / TEMPLATE_DIR)
                           if entry.name.endswith(".jinja") and os.path.exists(entry.path))
        except OSError as exc:
            return f"{directory / TEMPLATE_DIR} cannot be read ({_why(exc)})"
    for name in read:
        problem = _file_problem(directory, directory / name)
        if problem is not None:
            return problem
    return None


def _file_problem(directory: Path, path: Path) -> Optional[str]:
    """Why ``path`` cannot be opened for reading, or None."""
    try:
        os.stat(path)  # follows links: a dangling one, or a loop, fails here
    except OSError as exc:
        if path.is_symlink() and exc.errno == errno.ENOENT:
            # An HF cache snapshot whose blob is gone (or was never downloaded).
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            resolved = (path.parent / target) if not os.path.isabs(target) else Path(target)
            return (f"{path} is a dangling link to {target} ({os.path.normpath(resolved)} does not exist); "
                    "download or copy the file again")
        return f"{path} cannot be read ({_why(exc)})"
    if path.is_dir():
        return None
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


def _is_tokenizer_or_config(name: str, fast_files: Set[str]) -> bool:
    """Whether the server reads the top-level non-weight file ``name``."""
    if name in READ_NAMES or name in fast_files:
        return True
    if any(fnmatch.fnmatch(name, pattern) for pattern in VOCABULARY_PATTERNS):
        return True
    return name.startswith("chat_template") and name.endswith(".jinja")


def _fast_tokenizer_files(directory: Path) -> Set[str]:
    """The serializations tokenizer_config.json's ``fast_tokenizer_files`` names (transformers reads them)."""
    listed = read_tokenizer_config(directory).get("fast_tokenizer_files")
    return {name for name in listed if isinstance(name, str)} if isinstance(listed, list) else set()


def _weight_names(directory: Path, names: List[str]) -> List[str]:
    """The weight files the loader reads (its rule, :func:`weight_files`: the index's shards, else
    model.safetensors alone, else every *.safetensors); an index it cannot read is left to the
    loader's check, which names the problem."""
    if INDEX_FILE in names:
        try:
            weight_map = read_weight_map(directory)
        except (CheckpointFilesError, OSError):
            weight_map = None
        shards = set(weight_map.values()) if weight_map else set()
        return [INDEX_FILE, *sorted(shards & set(names))]
    if SINGLE_FILE in names:
        return [SINGLE_FILE]
    return [name for name in names if name.endswith(".safetensors")]
