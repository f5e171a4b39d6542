"""glibc malloc settings of the server's children, and giving freed heap back when idle.

Why these numbers (measured on CPU with the small demo model, see docs/EN/memory.md):

* ``MALLOC_MMAP_THRESHOLD_`` high (4 GiB): activation tensors come from the heap instead of a
  fresh ``mmap`` each forward, which would pay page faults for every large tensor again; with
  glibc's defaults prefill took 85x the page faults and ~19% more CPU time per token.
* ``MALLOC_TRIM_THRESHOLD_`` moderate (256 MiB), not 4 GiB: with 4 GiB glibc never returns the
  top of the heap, so a process keeps forever the largest transient peak it ever had (a long
  resumed prefill, a big batch) and its RSS ratchets up from load run to load run.  256 MiB is
  above what a steady stream of forwards frees at the top (no more page faults than 4 GiB in a
  paired measurement), yet a rare large peak at the top is given back.
* Freed blocks *inside* the heap are never returned by the threshold alone; a process that has
  been idle for a while calls ``malloc_trim(0)`` (:class:`IdleMallocTrimmer`), which hands every
  free page back to the kernel.  The next forward faults them in again, so the wait is long
  (``LIGHTLLM_IDLE_MALLOC_TRIM``, 30 s by default): bursts a few seconds apart keep their working
  set (docs/EN/memory.md); a busy rank never trims.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from typing import Callable, Dict, MutableMapping, Optional

MMAP_THRESHOLD_BYTES = 1 << 32
TRIM_THRESHOLD_BYTES = 256 << 20


def child_malloc_env() -> Dict[str, str]:
    """The malloc variables the launcher gives its children (glibc reads them at process start)."""
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES)}


def apply_child_malloc_env(environ: MutableMapping[str, str]) -> Dict[str, str]:
    """Set the children's malloc variables in ``environ`` unless the user set them; returns what is in effect."""
    for name, value in child_malloc_env().items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in child_malloc_env()}


def _load_malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS): nothing to trim
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def malloc_trim() -> bool:
    """Return free heap pages of every arena to the kernel; False where glibc is absent."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


class IdleMallocTrimmer:
    """Calls ``malloc_trim`` once a process has been idle for ``idle_seconds`` after doing work.

    The owner calls :meth:`busy` whenever it did work and :meth:`idle` from its idle loop; a
    trim runs at most once per idle period, so an idle process does not trim over and over.
    ``idle_seconds`` may be ``inf``: never trim.
    """

    def __init__(
        self,
        idle_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        trim: Callable[[], bool] = malloc_trim,
    ):
        if not idle_seconds > 0:
            raise ValueError(f"idle_seconds must be > 0 (inf: never), got {idle_seconds}")
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._trim = trim
        self._dirty = False
        self._last_busy = clock()
        self.trims = 0

    def busy(self) -> None:
        """Note that work was done now."""
        self._dirty = True
        self._last_busy = self._clock()

    def idle(self) -> bool:
        """Trim if work was done and the process has been idle long enough; True when it trimmed."""
        if not self._dirty or self._clock() - self._last_busy < self.idle_seconds:
            return False
        self._dirty = False
        self._trim()
        self.trims += 1
        return True
