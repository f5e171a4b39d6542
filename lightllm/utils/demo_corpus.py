"""Training text for the demo tokenizer, taken from the Python standard library on disk.

The demo checkpoint must be reproducible offline, so the tokenizer is trained on source
files that ship with the interpreter itself.  The file list is fixed and sorted so that
the same interpreter always yields the same corpus (and therefore the same tokenizer).
Different Python patch releases ship slightly different files, so byte-identical output
is promised per interpreter installation, not across Python versions.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import List, Sequence

# Pure-Python modules present in every CPython from 3.8 on: prose-heavy docstrings plus
# ordinary code, which is the mix chat prompts and code prompts in tests contain.
STDLIB_CORPUS_FILES: tuple[str, ...] = (
    "argparse.py",
    "bisect.py",
    "calendar.py",
    "collections/__init__.py",
    "contextlib.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "inspect.py",
    "json/decoder.py",
    "json/encoder.py",
    "logging/__init__.py",
    "pathlib.py",
    "random.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tempfile.py",
    "textwrap.py",
    "threading.py",
    "typing.py",
)

# Below this the BPE trainer cannot reach the larger vocabulary sizes with real merges.
MIN_CORPUS_CHARS = 200_000


def stdlib_dir() -> Path:
    """Directory holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(
    root: Path | None = None,
    files: Sequence[str] = STDLIB_CORPUS_FILES,
    min_chars: int = MIN_CORPUS_CHARS,
) -> List[str]:
    """Return the text of each corpus file, in sorted file order.

    Files missing from a trimmed-down Python installation are skipped; the corpus as a
    whole must still hold at least ``min_chars`` characters.

    Raises:
        ValueError: if ``files`` is empty or the readable files hold too little text.
    """
    if not files:
        raise ValueError("files must name at least one corpus file")
    base = stdlib_dir() if root is None else Path(root)
    texts: List[str] = []
    for rel in sorted(files):
        path = base / rel
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8"))
    total = sum(len(t) for t in texts)
    if total < min_chars:
        raise ValueError(
            f"corpus under {base} holds {total} characters from {len(texts)} of {len(files)} files; "
            f"at least min_chars={min_chars} are needed to train the demo tokenizer"
        )
    return texts
