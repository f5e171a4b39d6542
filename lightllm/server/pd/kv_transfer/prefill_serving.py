"""The prefill side of a transfer process: the owner's commands on one thread, the sends on another.

The main thread reads the owner's pipe without pause and queues each :class:`SendKV`; the worker
thread joins the group and sends the queued requests one at a time, in order.  A
:class:`CancelSend` takes a request off the queue while its send has not started (its request
was aborted on the node: the master that wanted the KV is gone, or the decode side gave up), so
an aborted request never waits behind the transfers queued ahead of it; it is reported
``cancelled``.  A send already under way finishes and reports itself.  :class:`Shutdown` lets
the send under way finish, announces to the decode side that the pair is closed, and ends.

On a fault of the group (timeout, dead peer) the worker reports the request under way and every
queued one as failed, sends :class:`ChannelBroken` and ends the process.
"""

from __future__ import annotations

import collections
import random
import threading
from multiprocessing.connection import Connection
from typing import Deque, List, Optional

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.pd.kv_transfer.announce import Announcer
from lightllm.server.pd.kv_transfer.child_outbox import ChildOutbox
from lightllm.server.pd.kv_transfer.group_worker import GroupWorker, cancelled_result, refused_command
from lightllm.server.pd.kv_transfer.messages import CancelSend, QueryStats, SendKV, Shutdown, TransferStats
from lightllm.server.pd.kv_transfer.protocol import send_kv
from lightllm.server.pd.kv_transfer.transfer_config import TransferConfig


class SendQueue:
    """Sends the owner asked for and the worker has not started, shared by both threads."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: Deque[SendKV] = collections.deque()
        self._closing = False

    def put(self, command: SendKV) -> None:
        """Queue ``command`` behind the others."""
        with self._cond:
            self._queue.append(command)
            self._cond.notify_all()

    def cancel(self, request_id: int) -> bool:
        """Take ``request_id``'s send off the queue; False when it is not queued (under way or done)."""
        with self._cond:
            for command in self._queue:
                if command.request_id == request_id:
                    self._queue.remove(command)
                    return True
            return False

    def close(self) -> None:
        """No more sends: the worker ends once the one under way is done."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def next(self) -> Optional[SendKV]:
        """The next send (it is under way from now on), waiting for one; None once closed."""
        with self._cond:
            while not self._queue and not self._closing:
                self._cond.wait()
            return None if self._closing else self._queue.popleft()

    def take_all(self) -> List[int]:
        """Empty the queue (the group failed); the request ids it held."""
        with self._cond:
            ids = [command.request_id for command in self._queue]
            self._queue.clear()
            return ids


class _Worker(GroupWorker):
    """The prefill side's group: joins it, then sends the queued requests in order."""

    role = "prefill"

    def __init__(self, config: TransferConfig, cache: KVCacheMemoryManager, outbox: ChildOutbox, sends: SendQueue,
                 started: float) -> None:
        super().__init__(config, cache, outbox, started)
        self.sends = sends
        self.announcer: Optional[Announcer] = None

    def held_request_ids(self) -> List[int]:
        return self.sends.take_all()

    def stats(self) -> TransferStats:
        group, announcer = self.group, self.announcer
        if group is None or announcer is None:
            return TransferStats("prefill", 0, 0, 0, 0)
        return TransferStats("prefill", group.link.receives_posted, group.link.receives_pending, announcer.count, 0)

    def run(self) -> None:
        config = self.config
        group = self.join()
        announcer = self.announcer = Announcer(group.store)
        self.announce_ready()
        rng = random.Random()
        while True:
            command = self.sends.next()
            if command is None:
                announcer.close()
                return
            corrupt = config.failure_probability > 0 and rng.random() < config.failure_probability
            self.move(command.request_id, lambda: send_kv(group.link, announcer, self.cache, command.request_id,
                                                          command.slots, config.page_size, corrupt,
                                                          command.first_token))


def serve_prefill(config: TransferConfig, conn: Connection, cache: KVCacheMemoryManager, outbox: ChildOutbox,
                  started: float) -> None:
    """Serve the owner's commands until :class:`Shutdown` or the owner's end of the pipe closes."""
    sends = SendQueue()
    worker = _Worker(config, cache, outbox, sends, started)
    thread = threading.Thread(target=worker.run, name="kv-transfer-prefill", daemon=True)
    thread.start()
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):
            return  # the owner is gone
        if isinstance(command, Shutdown):
            # The send under way finishes (bounded by its own waits) and the pair is announced
            # closed; the owner kills a process that takes longer than it is willing to wait.
            sends.close()
            thread.join(config.timeout_s)
            return
        if isinstance(command, SendKV):
            sends.put(command)
        elif isinstance(command, CancelSend):
            if sends.cancel(command.request_id):
                outbox.send(cancelled_result(command.request_id,
                                             "send cancelled (the request was aborted before its KV transfer started)"))
        elif isinstance(command, QueryStats):
            outbox.send(worker.stats())
        else:
            outbox.send(refused_command(worker.role, command))
