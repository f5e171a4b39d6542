"""Cancelling a server launch that is still in progress.

A launch runs in threads of its own (one per deployment, one per PD node) while the caller's
thread waits.  A Ctrl-C or SIGTERM only interrupts the waiting thread: the launch threads
would go on to start their servers with nobody left to stop them.  A :class:`LaunchGuard` is
the one object every part of a launch shares: each server process is recorded the moment it
is spawned, and :meth:`LaunchGuard.cancel` stops every recorded process, makes every process
recorded later stop at once, and makes every waiting launch step give up
(:class:`LaunchCancelled`).  One guard belongs to one launch; nothing here is global.
"""

from __future__ import annotations

import threading
from typing import Protocol


class LaunchCancelled(Exception):
    """The launch was cancelled (its caller was interrupted or another part of it failed)."""


class StoppableProcess(Protocol):
    """What the guard needs of a spawned server process."""

    def terminate(self) -> None:
        """Ask the process to stop (SIGTERM) without waiting."""

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the process and everything it started; wait until they are gone."""


class LaunchGuard:
    """Records the processes of one launch and cancels it as a whole.

    Thread-safe: launch threads call :meth:`record`, :meth:`check` and :meth:`sleep`; the
    thread that waits for them calls :meth:`cancel`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._processes: list[StoppableProcess] = []

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancelled.is_set()

    def record(self, process: StoppableProcess) -> None:
        """Track a process just spawned; if the launch is already cancelled, stop it and raise.

        Raises:
            LaunchCancelled: the guard was cancelled before (the process is stopped first).
        """
        with self._lock:
            # Checked under the lock cancel() takes: a process is either in cancel()'s list
            # or sees the flag here, so none slips between the two.
            cancelled = self._cancelled.is_set()
            if not cancelled:
                self._processes.append(process)
        if cancelled:
            process.stop()
            raise LaunchCancelled("the launch was cancelled")

    def check(self) -> None:
        """Raise :class:`LaunchCancelled` once the launch is cancelled."""
        if self._cancelled.is_set():
            raise LaunchCancelled("the launch was cancelled")

    def sleep(self, seconds: float) -> None:
        """Sleep up to ``seconds``; wake and raise :class:`LaunchCancelled` as soon as it is cancelled."""
        if self._cancelled.wait(seconds):
            raise LaunchCancelled("the launch was cancelled")

    def cancel(self, timeout_s: float = 60.0) -> None:
        """Cancel the launch: stop every recorded process (and, via :meth:`record`, any later one).

        Every process gets its SIGTERM before the first wait, so their shutdowns overlap.
        Idempotent.
        """
        with self._lock:
            self._cancelled.set()
            processes = list(self._processes)
        for process in processes:
            process.terminate()
        for process in processes:
            process.stop(timeout_s)
