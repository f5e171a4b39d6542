"""Whether ``TRITON_INTERPRET`` asks Triton to run kernels in its CPU interpreter: one rule for the
launcher (which imports neither torch nor triton) and the rank's kernel launchers.

Triton (3.4 and later) reads the variable through ``triton.knobs.runtime.interpret``, that is
``getenv_bool`` in libtriton: true for ``1``, ``true``, ``on``, ``yes`` or ``y`` in any case, nothing
stripped; anything else (``0``, ``off``, `` 1``) is false.  Triton before 3.4 (requirements-gpu.txt
allows 3.1) compared the value to ``1`` alone, so with such a triton installed ``1`` is the only
true value: the rule must be the installed triton's, or a ``true`` the launcher lets through would
reach kernels that compile instead of interpreting.  The version comes from the package's metadata,
so triton is not imported.  test_triton_interpret.py checks these spellings against the installed
triton.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
from typing import Mapping, Optional

TRITON_INTERPRET_TRUE_VALUES = ("1", "true", "on", "yes", "y")
# Triton before 3.4: the variable had to be exactly "1".
LEGACY_TRUE_VALUES = ("1",)
_KNOBS_VERSION = (3, 4)


def true_values(triton_version: Optional[str]) -> tuple[str, ...]:
    """The values (compared lower-cased) that a triton of ``triton_version`` reads as true; None: not installed."""
    match = re.match(r"(\d+)\.(\d+)", triton_version or "")
    if match is not None and (int(match.group(1)), int(match.group(2))) < _KNOBS_VERSION:
        return LEGACY_TRUE_VALUES
    return TRITON_INTERPRET_TRUE_VALUES


# The distributions that install the ``triton`` module: PyPI's, and PyTorch's own builds (nightly, ROCm).
_TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm")


@functools.lru_cache(maxsize=1)
def _installed_triton_version() -> Optional[str]:
    for name in _TRITON_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def triton_interpret_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when ``TRITON_INTERPRET`` (in ``environ``, default ``os.environ``) is set to a value the
    installed triton reads as true."""
    value = (os.environ if environ is None else environ).get("TRITON_INTERPRET", "")
    return value.lower() in true_values(_installed_triton_version())
