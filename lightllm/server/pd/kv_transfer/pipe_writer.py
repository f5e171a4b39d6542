"""The owner's commands to its transfer process, written by a thread of their own.

A pipe holds about 64 KiB, and a command carries its request's slot list (8 bytes per token: a
few thousand-token prompts fill it).  Written from the rank's step loop, a pipe the transfer
process does not drain fast enough (it is stopped, wedged in C++, or still starting) would stop
the step loop itself, and with it every request of the rank, not only those of that pair: a
decode node's rank once froze for two minutes behind the pipe of a pair whose prefill node had
been killed.  So the step loop only queues; this thread writes, in order.  A write that fails
means the process is gone, which the owner's next ``poll`` sees.
"""

from __future__ import annotations

import queue
import threading
from multiprocessing.connection import Connection

_STOP = object()


class PipeWriter:
    """Writes messages to ``conn`` in the order :meth:`send` was called, never blocking the caller."""

    def __init__(self, conn: Connection, name: str) -> None:
        self._conn = conn
        self._queue: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, message: object) -> None:
        """Queue ``message`` for the transfer process."""
        self._queue.put(message)

    def close(self, timeout_s: float) -> None:
        """Stop after what is queued (at most ``timeout_s`` seconds; a write to a dead process fails at once)."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        gone = False
        while True:
            message = self._queue.get()
            if message is _STOP:
                return
            if gone:
                continue  # the owner's poll() fails what the process held
            try:
                self._conn.send(message)
            except (BrokenPipeError, EOFError, OSError):
                gone = True
