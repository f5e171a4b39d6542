"""When each watched child process last showed progress in its main loop (the watchdog's input).

One float64 per watched process, in the order of the layout's ``heartbeat_processes``
(the launcher's :func:`~lightllm.server.launch.plan.child_process_names`: ``detokenization``,
``router``, ``model_rank0`` ... ``model_rank<tp-1>``), holding the ``time.monotonic()`` of its
last beat; 0.0 until its first.  ``time.monotonic()`` is CLOCK_MONOTONIC, one clock for the whole
machine on Linux, so a value written by one process compares with the launcher's own reading.

Who writes which field
----------------------
* Each watched process writes its own field and no other, through the :class:`HeartbeatStamp` it
  gets from :meth:`~lightllm.server.server_layout.ServerLayout.open_heartbeat`, before and right
  after each blocking wait of its main loop, so the work that follows a wait (a step, an
  admission round, a message) may last the whole timeout: the router around each poll (at most
  ``--schedule_time_interval``, 1 s), the detokenizer around each wait for a message (at most a
  second), a model rank around each wait for commands (rank 0 wakes every second while idle,
  the other ranks at each keep-alive of the TP command channel, every 5 s).  A beat is a single
  aligned 8-byte store, so the reader never sees half of one (aligned 64-bit stores are atomic
  on x86-64 and aarch64) and a beat costs well under a microsecond.
* The launcher creates the segment zeroed before any child starts and only reads it afterwards:
  its child watcher (:mod:`lightllm.server.launch.child_watch`) compares each field with the
  clock about five times a second (:mod:`lightllm.server.launch.watchdog` decides what is stale).

With ``--watchdog_timeout 0`` the layout watches no process: there is no segment and no beat.
"""

from __future__ import annotations

import struct
import time
from typing import Callable, List, Optional

import numpy as np

from lightllm.server.core.objs.shared_segment import SharedArraySegment

NEVER_BEAT = 0.0
# One field, read straight from the segment's buffer (native byte order, as numpy writes it).
_FIELD = struct.Struct("=d")


class ShmHeartbeats(SharedArraySegment):
    """The heartbeat fields of ``count`` processes in a shared-memory segment."""

    def __init__(self, name: str, count: int, create: bool):
        if count <= 0:
            raise ValueError(f"a heartbeat block holds at least one process, got {count}")
        super().__init__(name, np.dtype(np.float64), count, create)
        if create:
            self.array[:] = NEVER_BEAT
        self.count = count

    @staticmethod
    def segment_bytes(count: int) -> int:
        """Bytes of a block of ``count`` fields (for the launcher's /dev/shm check)."""
        return np.dtype(np.float64).itemsize * count

    def last_beat(self, slot: int) -> float:
        """The monotonic time of process ``slot``'s last beat (:data:`NEVER_BEAT` before its first, or
        once :meth:`close` unmapped the block: the launcher's watcher may read while the server stops).

        It keeps no view of the segment: a numpy view held across the read (a thread switch) made a
        concurrent :meth:`close` raise ``BufferError``, and the server's segments were left behind.
        The read itself is one C call, under the GIL.
        """
        buf = self._shm.buf  # None once closed
        if buf is None:
            return NEVER_BEAT
        try:
            return _FIELD.unpack_from(buf, slot * _FIELD.size)[0]
        except ValueError:  # released by a close between the two lines
            return NEVER_BEAT

    def snapshot(self) -> List[float]:
        """Every field, in slot order."""
        return [float(value) for value in self.array]

    def stamp(self, slot: int, clock: Callable[[], float] = time.monotonic) -> "HeartbeatStamp":
        """The writer of field ``slot`` (give it to the one process that owns the field)."""
        if not 0 <= slot < self.count:
            raise IndexError(f"heartbeat slot {slot} outside 0..{self.count - 1}")
        return HeartbeatStamp(self, slot, clock)


class HeartbeatStamp:
    """One process's field of a :class:`ShmHeartbeats` block: :meth:`beat` stores the clock in it.

    The stamp keeps the block mapped for the life of the process that holds it.
    """

    def __init__(self, block: ShmHeartbeats, slot: int, clock: Callable[[], float] = time.monotonic):
        self._block = block
        self._array = block.array
        self._slot = slot
        self._clock = clock

    def beat(self) -> None:
        """Record that this process's main loop is making progress (just before or after a wait)."""
        self._array[self._slot] = self._clock()


def _no_beat() -> None:
    """A process nobody watches has nothing to record."""


def beat_of(stamp: Optional[HeartbeatStamp]) -> Callable[[], None]:
    """``stamp.beat``, or a no-op for a process that is not watched (``stamp`` None): loops call it unconditionally."""
    return stamp.beat if stamp is not None else _no_beat
