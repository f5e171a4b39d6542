"""A thread the server cannot live without: its death by an exception is reported, never silent.

Python's default for a thread that raises is a traceback on stderr while the process goes on.
For the HTTP front door (:mod:`lightllm.server.http.transport.front_door`) that meant a port left open that
nobody answered: every request, ``/health`` included, waited forever and the process never
exited. A :class:`FatalThread` instead logs one error line naming the cause, runs its owner's
cleanup (closing sockets, so clients are refused instead of left waiting) and calls the death
handler exactly once, whether the handler was set before or after the death.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable, Optional

DeathHandler = Callable[[str], None]


class FatalThread:
    """Runs ``target`` in a daemon thread named ``name``; an exception escaping it is fatal.

    ``stopping()`` tells a planned stop from a death: an exception while it is true (the owner
    closed the sockets under a thread it could not join in time) is logged at debug level only.
    ``cleanup()`` runs on the dying thread before the handler.
    """

    def __init__(self, target: Callable[[], None], name: str, what: str, logger: logging.Logger,
                 stopping: Callable[[], bool], cleanup: Callable[[], None]) -> None:
        self._target = target
        self._what = what
        self._logger = logger
        self._stopping = stopping
        self._cleanup = cleanup
        self.failure: Optional[str] = None  # the cause, one line, once the thread died
        self._handler: Optional[DeathHandler] = None
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread; call :meth:`set_death_handler` to hear of its death."""
        self.thread.start()

    def set_death_handler(self, handler: DeathHandler) -> None:
        """Call ``handler(cause)`` when the thread dies of an exception; at once if it already has."""
        with self._lock:
            self._handler = handler
            failure = self.failure
        if failure is not None:
            handler(failure)

    def _run(self) -> None:
        try:
            self._target()
        except BaseException as exc:  # noqa: BLE001 - whatever ends the thread must end the server
            if self._stopping():
                self._logger.debug("%s ended while stopping: %r", self._what, exc)
                return
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self._logger.error("the %s failed (%s); shutting the server down", self._what, cause)
        self._logger.debug("%s failure", self._what, exc_info=exc)  # the traceback, for a bug report
        try:
            self._cleanup()
        except Exception:  # noqa: BLE001 - best effort: the server is ending anyway
            self._logger.debug("%s cleanup failed", self._what, exc_info=True)
        with self._lock:
            self.failure = cause
            handler = self._handler
        if handler is not None:
            try:
                handler(cause)
            except Exception:  # noqa: BLE001 - the error line above already says what happened
                self._logger.exception("the %s's death handler failed", self._what)


def stop_own_process(cause: str) -> None:
    """A death handler for start-up: SIGTERM to this process, which the launcher turns into its cleanup."""
    os.kill(os.getpid(), signal.SIGTERM)
