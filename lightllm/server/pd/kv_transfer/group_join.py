"""How a transfer process joins its pair: the prefill rank's store, then the two-rank group.

Both sides are clients of the prefill rank's one TCP store (:mod:`.store_host`), under their
pair's key prefix and the prefill side's current generation.  Joining runs on the transfer
process's worker thread, never where the owner's commands are read, so a join that waits (for
a peer that is slow to start, or one that will never come) holds up no receive's lease and no
cancellation.

A refused connection ends the join at once: a prefill node listens on its transfer port from
start-up until it exits (:mod:`lightllm.server.pd.node.transfer_ports`), so a port that refuses
belongs to a node that is gone.  ``torch.distributed.TCPStore`` itself would retry a refused
connect for its whole timeout (60 s by default), which kept a decode node's transfer process
pointed at a killed prefill node for a minute and more.  A port that accepts but never answers
(a hung node) is still bounded by ``connect_timeout_s``, and the master tears such a pair down
when it drops the node.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.pd.kv_transfer.announce import AnnouncementWatcher
from lightllm.server.pd.kv_transfer.bounded_wait import wait_work
from lightllm.server.pd.kv_transfer.protocol import DECODE_RANK, PREFILL_RANK, Link
from lightllm.server.pd.kv_transfer.store_host import generation_key, generation_prefix
from lightllm.server.pd.kv_transfer.transfer_config import TransferConfig
from lightllm.server.run_mode import RunMode

# A refused connect is retried this long before the port counts as gone: covers a store that is
# being started in the same instant (tests start both handles of a pair back to back).
REFUSED_GRACE_S = 1.0
_RETRY_S = 0.05


class StoreUnreachable(ConnectionError):
    """The prefill rank's transfer store refuses connections or did not answer in time."""


@dataclass
class JoinedGroup:
    """A transfer process's end of its pair once joined.

    ``store`` is the pair's store under its generation prefix (the prefill side announces
    through it); ``watcher`` takes those announcements (decode side only).
    """

    store: dist.Store
    link: Link
    watcher: Optional[AnnouncementWatcher] = None


def connect_store(addr: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the TCP store at ``addr:port``; :class:`StoreUnreachable` when it refuses or stays silent.

    Probes the port with a plain connect first (the store server ignores a connection that
    closes without a request), so a refusal ends the wait after :data:`REFUSED_GRACE_S`.
    """
    deadline = time.monotonic() + timeout_s
    refused_since: Optional[float] = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise StoreUnreachable(f"the transfer store at {addr}:{port} did not accept a connection "
                                   f"within {timeout_s:g} s")
        try:
            with socket.create_connection((addr, port), timeout=min(remaining, 5.0)):
                break
        except ConnectionRefusedError:
            now = time.monotonic()
            refused_since = now if refused_since is None else refused_since
            if now - refused_since >= REFUSED_GRACE_S:
                raise StoreUnreachable(f"the transfer port {addr}:{port} refuses connections: the prefill "
                                       "node that held it is gone") from None
            time.sleep(_RETRY_S)
        except OSError:
            time.sleep(_RETRY_S)  # unreachable for now, or a connect that timed out: until the deadline
    remaining = max(deadline - time.monotonic(), 1.0)
    return dist.TCPStore(addr, port, None, False, timedelta(seconds=remaining))


def join_store(addr: str, port: int, group_name: str, generation: int, timeout_s: float) -> Tuple[dist.Store, str]:
    """The pair's store (a client of the prefill rank's) under its current generation, and that prefix.

    ``generation`` > 0 (prefill side) names the generation; 0 (decode side) follows the one the
    prefill side started last, waiting up to ``timeout_s`` for it to exist.
    """
    client = connect_store(addr, port, timeout_s)
    if generation <= 0:
        pair = dist.PrefixStore(group_name, client)
        pair.wait([generation_key()], timedelta(seconds=timeout_s))
        generation = int(pair.get(generation_key()))
    prefix = generation_prefix(group_name, generation)
    return dist.PrefixStore(prefix, client), prefix


def join_group(config: TransferConfig, cache: KVCacheMemoryManager) -> JoinedGroup:
    """Join the pair's two-rank group (gloo for a CPU cache, NCCL for a CUDA one); raises on any failure.

    Runs on the thread that will use the group: with NCCL the current device is per thread.
    """
    cuda = cache.device.type == "cuda"
    if cuda:
        torch.cuda.set_device(cache.device)
    rank = PREFILL_RANK if config.role == RunMode.PREFILL else DECODE_RANK
    addr, port, connect_timeout_s = config.store_addr, config.store_port, config.connect_timeout_s
    store, prefix = join_store(addr, port, config.group_name, config.generation, connect_timeout_s)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=connect_timeout_s))
    if cuda:
        # NCCL connects lazily: a first exchange makes "ready" mean ready.
        probe = torch.zeros(1, device=cache.device)
        wait_work(dist.all_reduce(probe, async_op=True), connect_timeout_s, "the peer to connect", True)
        # Point-to-point operations may get a communicator of their own, made at the first
        # one: make it now, while both sides join, not inside the first transfer.
        first = dist.isend(probe, DECODE_RANK) if rank == PREFILL_RANK else dist.irecv(probe, PREFILL_RANK)
        wait_work(first, connect_timeout_s, "the peer's first point-to-point exchange", True)
    watcher = None
    if config.role == RunMode.DECODE:
        # A connection of its own: a store client serves one request at a time, this one
        # spends its life in waits, and NCCL may need the group's store meanwhile.
        watcher = AnnouncementWatcher(dist.PrefixStore(prefix, connect_store(addr, port, connect_timeout_s)),
                                      config.announce_wait_s)
    link = Link(cache.device if cuda else torch.device("cpu"), cuda, config.timeout_s)
    return JoinedGroup(store, link, watcher)
