"""Byte-stable JSON writing for generated checkpoint files.

Generated checkpoints are compared byte for byte across runs, so every JSON file is
written with sorted keys, a fixed indent, a trailing newline and no timestamps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def json_bytes(obj: Any) -> bytes:
    """Serialise ``obj`` to UTF-8 JSON whose bytes depend only on its value."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` to ``path`` as deterministic JSON (see :func:`json_bytes`)."""
    Path(path).write_bytes(json_bytes(obj))
