"""The decode side of a transfer process: the owner's commands on one thread, the group on another.

The main thread reads the owner's pipe without pause: a :class:`ReceiveKV` registers its
reserved slots with a deadline (its lease), a :class:`CancelReceive` gives up a receive whose
header has not arrived, and a receive whose deadline passed is reported ``expired``.  The worker
thread joins the group and then, for each transfer the prefill side announces, takes the
request's slots and receives its pages.  Because the two are apart, nothing the group does (a
join that waits for a peer that never comes, a transfer from a hung peer) delays a lease or a
cancellation: the owner gets every request back at its lease at the latest, and at once when it
asks.  A receive whose header already arrived is under way and reports itself; its slots are no
longer listed, so nothing cancels or expires it while the worker may still write them.

On a fault of the group or the store (timeout, dead peer, a pair the prefill side closed) the
worker reports every request still listed, and the one under way, as failed, sends
:class:`ChannelBroken` and ends the process.
"""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Connection
from typing import Dict, List, Optional, Tuple

import numpy as np

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.pd.kv_transfer.bounded_wait import ChannelFault, first_line
from lightllm.server.pd.kv_transfer.child_outbox import ChildOutbox
from lightllm.server.pd.kv_transfer.group_worker import GroupWorker, cancelled_result, refused_command
from lightllm.server.pd.kv_transfer.header import TransferHeader
from lightllm.server.pd.kv_transfer.messages import (
    CancelReceive,
    QueryStats,
    ReceiveKV,
    Shutdown,
    TransferResult,
    TransferStats,
)
from lightllm.server.pd.kv_transfer.protocol import receive_kv
from lightllm.server.pd.kv_transfer.transfer_config import TransferConfig

# A header may overtake the ReceiveKV command that registers its slots (a store key and a
# pipe); wait this long for the command before refusing the header.
REGISTRATION_GRACE_S = 1.0
# Longest single wait on the owner's pipe.  A lease is any finite number of seconds (the
# master's prefill timeout plus a margin), but the pipe's poll refuses timeouts past about 24
# days (OverflowError), so a far deadline is waited for in steps of this size.
MAX_PIPE_WAIT_S = 3600.0


class Reservations:
    """Receives the owner registered and no transfer has taken yet, shared by both threads."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: Dict[int, Tuple[ReceiveKV, float]] = {}  # request id -> (command, deadline)

    def add(self, command: ReceiveKV) -> None:
        """List ``command``'s slots until a transfer takes them or ``command.wait_s`` passes."""
        with self._cond:
            self._waiting[command.request_id] = (command, time.monotonic() + command.wait_s)
            self._cond.notify_all()

    def cancel(self, request_id: int) -> bool:
        """Unlist a receive whose header has not arrived; False when none is listed."""
        with self._cond:
            return self._waiting.pop(request_id, None) is not None

    def take(self, request_id: int, grace_s: float = REGISTRATION_GRACE_S) -> Optional[np.ndarray]:
        """The slots of ``request_id``, unlisted (the transfer is now under way); None when it is
        not registered within ``grace_s``."""
        deadline = time.monotonic() + grace_s
        with self._cond:
            while request_id not in self._waiting:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._waiting.pop(request_id)[0].slots

    def expire(self, now: float) -> List[ReceiveKV]:
        """Unlist and return the receives whose deadline passed."""
        with self._cond:
            overdue = [rid for rid, (_, deadline) in self._waiting.items() if deadline <= now]
            return [self._waiting.pop(rid)[0] for rid in overdue]

    def next_deadline(self) -> Optional[float]:
        """The earliest deadline of a listed receive (None: none listed)."""
        with self._cond:
            return min((deadline for _, deadline in self._waiting.values()), default=None)

    def take_all(self) -> List[int]:
        """Unlist every receive (the group failed); their request ids."""
        with self._cond:
            ids = list(self._waiting)
            self._waiting.clear()
            return ids


class _Worker(GroupWorker):
    """The decode side's group: joins it, then receives what the prefill side announces."""

    role = "decode"

    def __init__(self, config: TransferConfig, cache: KVCacheMemoryManager, outbox: ChildOutbox,
                 reservations: Reservations, started: float) -> None:
        super().__init__(config, cache, outbox, started)
        self.reservations = reservations

    def held_request_ids(self) -> List[int]:
        return self.reservations.take_all()

    def stats(self) -> TransferStats:
        group = self.group
        if group is None:
            return TransferStats("decode", 0, 0, 0, 0)
        watcher = group.watcher
        return TransferStats("decode", group.link.receives_posted, group.link.receives_pending,
                             watcher.count if watcher else 0, watcher.idle_waits if watcher else 0)

    def run(self) -> None:
        group = self.join()
        self.announce_ready()
        assert group.watcher is not None
        while True:
            try:
                announced = group.watcher.next()
            except ChannelFault as fault:
                self.fail(str(fault))
            except Exception as exc:  # noqa: BLE001 - a store failure of another kind is as fatal
                self.fail(f"the prefill node's store failed: {first_line(exc)}")
            if announced is None:
                continue  # a bounded wait ended empty: renewed without end while idle
            try:
                header = TransferHeader.from_bytes(announced)
            except ValueError as exc:  # the announcements are out of step: the pair is useless
                self.fail(f"bad header from the prefill side: {exc}")
            self.move(header.request_id, lambda: receive_kv(group.link, self.cache, header, self.reservations.take))


def serve_decode(config: TransferConfig, conn: Connection, cache: KVCacheMemoryManager, outbox: ChildOutbox,
                 started: float) -> None:
    """Serve the owner's commands until :class:`Shutdown` or the owner's end of the pipe closes."""
    reservations = Reservations()
    worker = _Worker(config, cache, outbox, reservations, started)
    threading.Thread(target=worker.run, name="kv-transfer-decode", daemon=True).start()
    while True:
        deadline = reservations.next_deadline()
        timeout = None if deadline is None else min(MAX_PIPE_WAIT_S, max(0.0, deadline - time.monotonic()))
        try:
            command = conn.recv() if conn.poll(timeout) else None
        except (EOFError, OSError):
            return  # the owner is gone
        if isinstance(command, Shutdown):
            return
        if isinstance(command, ReceiveKV):
            reservations.add(command)
        elif isinstance(command, CancelReceive):
            # Only a receive still waiting for its header: one under way finishes and reports itself.
            if reservations.cancel(command.request_id):
                outbox.send(cancelled_result(command.request_id,
                                             "receive cancelled (the request ended before any KV arrived)"))
        elif isinstance(command, QueryStats):
            outbox.send(worker.stats())
        elif command is not None:
            outbox.send(refused_command(worker.role, command))
        for expired in reservations.expire(time.monotonic()):
            outbox.send(TransferResult(expired.request_id, False, expired.wait_s, 0,
                                       f"request {expired.request_id}: no KV arrived from the prefill side "
                                       f"within {expired.wait_s:g} s", expired=True))
