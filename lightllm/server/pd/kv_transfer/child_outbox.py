"""A transfer process's messages to its owner, sent from either of its two threads.

A transfer process reads its owner's commands on its main thread while a second thread joins
the group and moves KV (see :mod:`.decode_serving` and :mod:`.prefill_serving`); both report
results.  A ``Connection`` is not safe for two writers, so every message goes through one lock,
and a broken group's report (every failed request, then :class:`ChannelBroken`) goes out in one
piece: nothing the other thread sends can land between them or after them.
"""

from __future__ import annotations

import logging
import threading
from multiprocessing.connection import Connection
from typing import Iterable

from lightllm.server.pd.kv_transfer.messages import ChannelBroken, TransferResult

logger = logging.getLogger(__name__)


class ChildOutbox:
    """The owner's end of the pipe as the transfer process's threads write to it."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._closed = False

    def send(self, message: object) -> None:
        """Send one message; dropped once the group was reported broken or the owner is gone."""
        with self._lock:
            if not self._closed:
                self._send(message)

    def broken(self, request_ids: Iterable[int], reason: str) -> None:
        """Report ``request_ids`` failed, then the group broken; nothing is sent after this."""
        ids = list(dict.fromkeys(request_ids))
        # A peer that leaves while nothing is in flight is a normal shutdown of the pair.
        (logger.warning if ids else logger.info)("KV transfer group broken: %s", reason)
        with self._lock:
            if self._closed:
                return
            for request_id in ids:
                self._send(TransferResult(request_id, False, 0.0, 0, f"request {request_id}: {reason}"))
            self._send(ChannelBroken(reason))
            self._closed = True

    def _send(self, message: object) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, EOFError, OSError):
            pass  # the owner is gone; it no longer needs results
