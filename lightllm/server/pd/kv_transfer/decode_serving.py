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

import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Dict, List, NoReturn, Optional, Tuple

import numpy as np

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.pd.kv_transfer.bounded_wait import ChannelFault
from lightllm.server.pd.kv_transfer.child_outbox import ChildOutbox
from lightllm.server.pd.kv_transfer.group_join import JoinedGroup, first_line, join_group
from lightllm.server.pd.kv_transfer.header import TransferHeader
from lightllm.server.pd.kv_transfer.messages import (
    CancelReceive,
    ChannelReady,
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


class _Worker:
    """The decode side's group: joins it, then receives what the prefill side announces."""

    def __init__(self, config: TransferConfig, cache: KVCacheMemoryManager, outbox: ChildOutbox,
                 reservations: Reservations, started: float) -> None:
        self.config, self.cache, self.outbox, self.reservations = config, cache, outbox, reservations
        self.started = started
        self.group: Optional[JoinedGroup] = None

    def stats(self) -> TransferStats:
        group = self.group
        if group is None:
            return TransferStats("decode", 0, 0, 0, 0)
        watcher = group.watcher
        return TransferStats("decode", group.link.receives_posted, group.link.receives_pending,
                             watcher.count if watcher else 0, watcher.idle_waits if watcher else 0)

    def run(self) -> None:
        config = self.config
        try:
            self.group = join_group(config, self.cache)
        except Exception as exc:  # noqa: BLE001 - any failure to join is reported, not raised
            self._fail(f"could not join the transfer group at {config.store_addr}:{config.store_port}: {exc}")
        self.outbox.send(ChannelReady(time.monotonic() - self.started))
        group = self.group
        assert group is not None and group.watcher is not None
        while True:
            try:
                announced = group.watcher.next()
            except ChannelFault as fault:
                self._fail(str(fault))
            except Exception as exc:  # noqa: BLE001 - a store failure of another kind is as fatal
                self._fail(f"the prefill node's store failed: {first_line(exc)}")
            if announced is None:
                continue  # a bounded wait ended empty: renewed without end while idle
            try:
                header = TransferHeader.from_bytes(announced)
            except ValueError as exc:  # the announcements are out of step: the pair is useless
                self._fail(f"bad header from the prefill side: {exc}")
            try:
                result = receive_kv(group.link, self.cache, header, self.reservations.take)
            except ChannelFault as fault:
                self._fail(str(fault), header.request_id)
            except Exception as exc:  # noqa: BLE001 - e.g. posting on a group whose peer left
                self._fail(f"the KV transfer failed: {first_line(exc)}", header.request_id)
            self.outbox.send(result)

    def _fail(self, reason: str, under_way: Optional[int] = None) -> NoReturn:
        ids = self.reservations.take_all() + ([] if under_way is None else [under_way])
        self.outbox.broken(ids, reason)
        # Skip interpreter teardown: the other thread may sit in a pipe read, and destroying
        # the group under a thread aborts noisily.  Every message was sent synchronously.
        os._exit(0)


def serve_decode(config: TransferConfig, conn: Connection, cache: KVCacheMemoryManager, outbox: ChildOutbox,
                 started: float) -> None:
    """Serve the owner's commands until :class:`Shutdown` or the owner's end of the pipe closes."""
    reservations = Reservations()
    worker = _Worker(config, cache, outbox, reservations, started)
    threading.Thread(target=worker.run, name="kv-transfer-decode", daemon=True).start()
    while True:
        deadline = reservations.next_deadline()
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
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
                outbox.send(TransferResult(command.request_id, False, 0.0, 0,
                                           f"request {command.request_id}: receive cancelled (the request ended "
                                           "before any KV arrived)", cancelled=True))
        elif isinstance(command, QueryStats):
            outbox.send(worker.stats())
        elif command is not None:
            outbox.send(TransferResult(getattr(command, "request_id", -1), False, 0.0, 0,
                                       f"the decode transfer process cannot run {type(command).__name__}"))
        for expired in reservations.expire(time.monotonic()):
            outbox.send(TransferResult(expired.request_id, False, expired.wait_s, 0,
                                       f"request {expired.request_id}: no KV arrived from the prefill side "
                                       f"within {expired.wait_s:g} s", expired=True))
