"""What both sides' worker threads share: joining the pair's group, moving one request's KV, and
ending the process on a fault with every request it holds reported failed.

Each side (:mod:`.prefill_serving`, :mod:`.decode_serving`) keeps what is its own: what it holds
(a send queue, a table of reservations), what it announces or waits for, and its statistics.
The replies its main thread sends for a cancelled request or a command it cannot run are here
too, so both sides word them alike.
"""

from __future__ import annotations

import abc
import os
import time
from typing import Callable, List, NoReturn, Optional

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.pd.kv_transfer.bounded_wait import ChannelFault, first_line
from lightllm.server.pd.kv_transfer.child_outbox import ChildOutbox
from lightllm.server.pd.kv_transfer.group_join import JoinedGroup, join_group
from lightllm.server.pd.kv_transfer.messages import ChannelReady, TransferResult
from lightllm.server.pd.kv_transfer.transfer_config import TransferConfig


class GroupWorker(abc.ABC):
    """One side's worker thread; subclasses say what it holds and how it runs once joined."""

    role = ""

    def __init__(self, config: TransferConfig, cache: KVCacheMemoryManager, outbox: ChildOutbox,
                 started: float) -> None:
        self.config, self.cache, self.outbox = config, cache, outbox
        self.started = started
        self.group: Optional[JoinedGroup] = None

    @abc.abstractmethod
    def held_request_ids(self) -> List[int]:
        """Unlist every request this side holds and has not started moving; their ids."""

    def join(self) -> JoinedGroup:
        """Join the pair's group, or fail the process saying why."""
        config = self.config
        try:
            self.group = join_group(config, self.cache)
        except Exception as exc:  # noqa: BLE001 - any failure to join is reported, not raised
            self.fail(f"could not join the transfer group at {config.store_addr}:{config.store_port}: {exc}")
        return self.group

    def announce_ready(self) -> None:
        """Tell the owner the group is joined (once per process)."""
        self.outbox.send(ChannelReady(time.monotonic() - self.started))

    def move(self, request_id: int, transfer: Callable[[], TransferResult]) -> None:
        """Run one request's ``transfer`` and report its result; a fault of the group fails the process."""
        try:
            result = transfer()
        except ChannelFault as fault:
            self.fail(str(fault), request_id)
        except Exception as exc:  # noqa: BLE001 - e.g. posting on a group whose peer left
            self.fail(f"the KV transfer failed: {first_line(exc)}", request_id)
        self.outbox.send(result)

    def fail(self, reason: str, under_way: Optional[int] = None) -> NoReturn:
        """Report the request under way and every held one failed, the group broken, and end the process."""
        ids = ([] if under_way is None else [under_way]) + self.held_request_ids()
        self.outbox.broken(ids, reason)
        # Skip interpreter teardown: the other thread may sit in a pipe read, and destroying the
        # group under a thread aborts noisily.  Every message was sent synchronously.
        os._exit(0)


def cancelled_result(request_id: int, what: str) -> TransferResult:
    """The reply to a cancel that took ``request_id`` off before its transfer started."""
    return TransferResult(request_id, False, 0.0, 0, f"request {request_id}: {what}", cancelled=True)


def refused_command(role: str, command: object) -> TransferResult:
    """The reply to a command this side cannot run (it names the command's request when it has one)."""
    return TransferResult(getattr(command, "request_id", -1), False, 0.0, 0,
                          f"the {role} transfer process cannot run {type(command).__name__}")
