"""A fixed pool of daemon threads running jobs in order, each job's result in a ``Future``.

Used where work must leave a loop that others wait on (the HTTP process's tokenization and body
parsing, a model rank's grammar compiles) but must never hold up the process's exit.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class DaemonWorkers:
    """A fixed pool of daemon threads running jobs in order.

    Unlike ``ThreadPoolExecutor``, whose threads the interpreter joins at exit after they have run
    every queued job, a job in progress (or queued) never delays the process's exit.
    Threads start with the first job. A job whose future was cancelled (e.g. its client left) is skipped.
    """

    def __init__(self, count: int, name: str) -> None:
        self._count = count
        self._name = name
        self._jobs: "queue.SimpleQueue[tuple[Future, Callable[[], Any]]]" = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], Any]) -> Future:
        """Queue ``job``; its result or exception lands in the returned future."""
        with self._lock:
            if not self._started:
                for index in range(self._count):
                    threading.Thread(target=self._work, name=f"{self._name}-{index}", daemon=True).start()
                self._started = True
        future: Future = Future()
        self._jobs.put((future, job))
        return future

    def _work(self) -> None:
        while True:
            future, job = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = job()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
                future.set_exception(exc)
            else:
                future.set_result(result)
