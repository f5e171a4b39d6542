"""Whether ``TRITON_INTERPRET`` asks Triton to run kernels in its CPU interpreter: one rule for the
launcher (which imports neither torch nor triton) and the rank's kernel launchers.

Triton (3.4 and later) reads the variable through ``triton.knobs.runtime.interpret``, that is
``getenv_bool`` in libtriton: true for ``1``, ``true``, ``on``, ``yes`` or ``y`` in any case, nothing
stripped; anything else (``0``, ``off``, `` 1``) is false.  test_triton_interpret.py checks these
spellings against the installed triton.  Triton before 3.4 compared the value to ``1`` alone.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

TRITON_INTERPRET_TRUE_VALUES = ("1", "true", "on", "yes", "y")


def triton_interpret_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when ``TRITON_INTERPRET`` (in ``environ``, default ``os.environ``) is set to a true value."""
    value = (os.environ if environ is None else environ).get("TRITON_INTERPRET", "")
    return value.lower() in TRITON_INTERPRET_TRUE_VALUES
