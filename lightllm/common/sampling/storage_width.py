"""The widths in which sampling numbers are stored, and the check that they survive storage.

The HTTP process writes every request into a fixed-layout shared-memory record
(:mod:`lightllm.server.core.objs.shm_req_buffer`) whose numeric fields are 32-bit floats and
32/64-bit integers; the model ranks read them back from there.  A value that is valid as a
Python float can still become ``inf`` (``1e39``) or ``0.0`` (``1e-300``) in a 32-bit float,
and a Python int can overflow an ``int32``.  Checking after the conversion, in the one place
every API goes through (:meth:`SamplingParams.validate`), means that whatever the HTTP side
accepts, the rank reads back as an equally valid value.

Float rule: the stored value must be finite and, unless the value is exactly 0, at least the
smallest *normal* float32 (about ``1.18e-38``) in magnitude.  Subnormal values are refused
as well because GPU kernels may flush them to zero, which turns a valid positive ``top_p``
or ``repetition_penalty`` into an invalid 0.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

MAX_STOP_TOKEN_IDS = 16
# logit_bias entries per request (OpenAI's own limit is 300 as well).
MAX_LOGIT_BIAS = 300
STOP_SEQUENCES_BYTES = 1024
# A structured-output grammar (llguidance's JSON form of a JSON schema), UTF-8 encoded.
GRAMMAR_BYTES = 16384

# The layout of the shared-memory record takes these dtypes from here, so the check and the
# storage cannot drift apart.
STORED_DTYPES: dict[str, type[np.generic]] = {
    "temperature": np.float32,
    "top_p": np.float32,
    "min_p": np.float32,
    "repetition_penalty": np.float32,
    "presence_penalty": np.float32,
    "frequency_penalty": np.float32,
    "exponential_decay_factor": np.float32,
    "top_k": np.int32,
    "max_new_tokens": np.int32,
    "min_new_tokens": np.int32,
    "logprobs": np.int32,
    "prompt_logprobs": np.int32,
    "exponential_decay_start": np.int32,
    "stop_token_ids": np.int32,
    "seed": np.int64,
    "logit_bias_ids": np.int32,
    "logit_bias_values": np.float32,
}


def check_stored_float(name: str, value: float, dtype: type[np.generic] = np.float32) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` keeps its meaning in ``dtype``."""
    info = np.finfo(dtype)
    largest, smallest = float(info.max), float(info.tiny)
    # Compare in Python floats: numpy's cast of 1e300 to float32 warns and gives inf.  A value
    # within the largest finite one never rounds up to inf, so this bound is the whole check.
    if not math.isfinite(value) or abs(value) > largest:
        raise ValueError(
            f"{name} must be at most {largest!r} in magnitude (it is stored as a {info.bits}-bit float), "
            f"got {value!r}"
        )
    if value != 0 and abs(float(dtype(value))) < smallest:
        raise ValueError(
            f"{name} must be at least {smallest!r} in magnitude when not 0 (it is stored as a "
            f"{info.bits}-bit float), got {value!r}"
        )


def check_stored_int(name: str, value: int, dtype: type[np.generic] = np.int32) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` fits the integer ``dtype``."""
    info = np.iinfo(dtype)
    if value > int(info.max):
        raise ValueError(f"{name} must be at most {int(info.max)} (it is stored as a {info.bits}-bit integer), got {value}")
    if value < int(info.min):
        raise ValueError(f"{name} must be at least {int(info.min)} (it is stored as a {info.bits}-bit integer), got {value}")


def check_stored_widths(values: dict[str, Any], error: Callable[[str], Exception]) -> None:
    """Check every field of ``values`` named in :data:`STORED_DTYPES` against its width.

    ``None`` values (unset optional fields) are skipped; list values are checked item by item.
    ``error`` turns a message into the exception to raise (so callers keep their own type).
    """
    for name, dtype in STORED_DTYPES.items():
        value = values.get(name)
        if value is None:
            continue
        items = value if isinstance(value, (list, tuple)) else [value]
        check = check_stored_float if np.issubdtype(dtype, np.floating) else check_stored_int
        for item in items:
            try:
                check(name, item, dtype)
            except ValueError as exc:
                raise error(str(exc)) from None
