"""A named shared-memory segment viewed as a numpy array: the common part of every shm object."""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np


class SharedArraySegment:
    """Creates (launcher) or attaches to (children) a segment and maps a numpy array over it.

    Attaching registers the segment with the resource tracker that spawned children share with
    the launcher; the launcher's :meth:`unlink` at shutdown unregisters it once.
    """

    def __init__(self, name: str, dtype: np.dtype, length: int, create: bool):
        self.name = name
        size = np.dtype(dtype).itemsize * length
        self._shm = shared_memory.SharedMemory(name=name, create=create, size=size if create else 0)
        self.array = np.ndarray((length,), dtype=dtype, buffer=self._shm.buf)

    def close(self) -> None:
        """Unmap the segment (does not remove it)."""
        self.array = None  # drop the numpy view before closing the buffer
        self._shm.close()

    def unlink(self) -> None:
        """Remove the segment from the system (the creating process, at shutdown)."""
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass
