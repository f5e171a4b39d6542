"""Typed reads of single ``config.json`` values, each refusing a wrong one by its key.

Python's ``int()``, ``float()`` and ``bool()`` turn most wrong values into some right-looking
one: ``int(2.7)`` served two layers, ``bool("false")`` tied the embeddings, and ``x or default``
replaced an ``rms_norm_eps`` of 0.0 (which transformers uses as written) with the default.
transformers 5's strict config classes refuse most of these, but only in a child process after
every other one started, with a message that may name neither the key nor the file.  These
readers refuse them before any process starts, as transformers would read them otherwise.
"""

from __future__ import annotations

import math
from typing import Any, Dict

from lightllm.common.basemodel.model_config_error import ModelConfigError


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def config_integer(raw: Dict[str, Any], key: str, *, minimum: int = 1) -> int:
    """``raw[key]``, which must be a JSON integer of at least ``minimum`` (transformers refuses 2.0 too)."""
    value = raw.get(key)
    if not _is_integer(value) or value < minimum:
        wanted = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise ModelConfigError(f"config.json: {key} must be {wanted}, got {value!r}")
    return value


def config_flag(raw: Dict[str, Any], key: str, default: bool) -> bool:
    """``raw[key]`` as ``true``/``false``; ``default`` when the key is absent.  A string such as
    ``"false"`` or a number is refused: Python reads ``"false"`` as true."""
    if key not in raw:
        return default
    value = raw[key]
    if not isinstance(value, bool):
        raise ModelConfigError(f"config.json: {key} must be true or false, got {value!r}")
    return value


def config_float(raw: Dict[str, Any], key: str, default: float, *, integers: bool = True,
                 positive: bool = False) -> float:
    """``raw[key]`` as a finite number of at least 0 (above 0 when ``positive``); ``default`` when the
    key is absent or null.  ``integers=False`` refuses a JSON integer, as transformers' strict
    config classes do for a float field (``"rms_norm_eps": 0`` fails there)."""
    value = raw.get(key)
    if value is None:
        return default
    number = isinstance(value, float) or (integers and _is_integer(value))
    if not number or not math.isfinite(value) or value < 0 or (positive and value == 0):
        kind = "a positive number" if positive else "a number of at least 0"
        if not integers and _is_integer(value):
            kind += f" written with a decimal point or exponent ({float(value)!r}: transformers refuses an integer here)"
        raise ModelConfigError(f"config.json: {key} must be {kind}, got {value!r}")
    return float(value)
