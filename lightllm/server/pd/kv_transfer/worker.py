"""The KV transfer process: a child of one TP rank process, paired with the peer node's.

It joins its own two-rank torch.distributed group (rank 0 = prefill side, rank 1 = decode side;
gloo for CPU caches, NCCL for CUDA ones), never the rank's TP group, and serves :mod:`messages`
commands from its owner's pipe.  Both sides meet in the prefill rank's one TCP store
(:mod:`store_host`) as clients, under their pair's key prefix and the prefill side's current
generation.  Transfers are announced through that store (:mod:`announce`): the decode side
posts receives only for an announced transfer, so an idle pair holds nothing pending on its
group.  On a fault of the group or the store (timeout, dead peer) it fails everything it holds,
reports :class:`ChannelBroken` and exits; the owner starts a fresh one or drops the pair.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import random
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.pd.kv_transfer.announce import AnnouncementWatcher, Announcer
from lightllm.server.pd.kv_transfer.bounded_wait import ChannelFault, wait_work
from lightllm.server.pd.kv_transfer.header import TransferHeader
from lightllm.utils.process_utils import ignore_group_stop_signals
from lightllm.server.pd.kv_transfer.messages import (
    CancelReceive,
    ChannelBroken,
    ChannelReady,
    QueryStats,
    ReceiveKV,
    SendKV,
    Shutdown,
    TransferResult,
    TransferStats,
)
from lightllm.server.pd.kv_transfer.protocol import DECODE_RANK, PREFILL_RANK, Link, receive_kv, send_kv
from lightllm.server.pd.kv_transfer.store_host import generation_key, generation_prefix

logger = logging.getLogger(__name__)

# A header may overtake the ReceiveKV command that registers its slots (a store key and a
# pipe); wait this long for the command before refusing the header.
REGISTRATION_GRACE_S = 1.0


@dataclass(frozen=True)
class TransferConfig:
    """What a transfer process needs besides its cache and pipe."""

    role: str  # "prefill" or "decode"
    # The prefill rank's TCP store, which both sides join as clients.
    store_addr: str
    store_port: int
    # Prefix of every key the pair puts in the store: a decode side pointed at some other
    # store (a stale address, another rank's port) never matches keys and times out instead.
    group_name: str
    # Prefill side: the generation its owner counted for this start; decode side: 0, to follow
    # whatever generation the prefill side started last.
    generation: int
    page_size: int
    timeout_s: float
    connect_timeout_s: float
    failure_probability: float
    # Decode side: how long one wait for the next announcement lasts before it is renewed.
    announce_wait_s: float = 30.0


def run_transfer_process(config: TransferConfig, conn: Connection, cache: KVCacheMemoryManager) -> None:
    """Entry point of the child process."""
    ignore_group_stop_signals()  # stopped by a Shutdown message, or killed, by the rank that owns it
    torch.set_num_threads(1)
    start = time.monotonic()
    cuda = cache.device.type == "cuda"
    if cuda:
        torch.cuda.set_device(cache.device)
    rank = PREFILL_RANK if config.role == "prefill" else DECODE_RANK
    try:
        store, prefix = _join_store(config)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=store,
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=config.connect_timeout_s),
        )
        if cuda:
            # NCCL connects lazily: a first exchange makes "ready" mean ready.
            probe = torch.zeros(1, device=cache.device)
            wait_work(dist.all_reduce(probe, async_op=True), config.connect_timeout_s, "the peer to connect", True)
            # Point-to-point operations may get a communicator of their own, made at the first
            # one: make it now, while both sides join, not inside the first transfer.
            first = dist.isend(probe, DECODE_RANK) if rank == PREFILL_RANK else dist.irecv(probe, PREFILL_RANK)
            wait_work(first, config.connect_timeout_s, "the peer's first point-to-point exchange", True)
        if config.role == "decode":
            # A connection of its own: a store client serves one request at a time, this one
            # spends its life in waits, and NCCL may need the group's store meanwhile.
            watcher = AnnouncementWatcher(dist.PrefixStore(prefix, _client(config)), config.announce_wait_s)
    except Exception as exc:  # noqa: BLE001 - any failure to join is reported, not raised
        _broken(conn, [], f"could not join the transfer group at {config.store_addr}:{config.store_port}: {exc}")
        os._exit(0)
    link = Link(cache.device if cuda else torch.device("cpu"), cuda, config.timeout_s)
    _send_quiet(conn, ChannelReady(time.monotonic() - start))
    if config.role == "prefill":
        _serve_prefill(config, conn, cache, link, Announcer(store))
    else:
        _serve_decode(conn, cache, link, watcher)
    # Skip interpreter teardown: the announcement watcher may still sit in a store wait, and
    # destroying the group under a thread aborts noisily.  Every message was sent synchronously.
    os._exit(0)


def _client(config: TransferConfig) -> dist.TCPStore:
    # Connecting retries until the timeout, so a decode side may start before the prefill side's store.
    return dist.TCPStore(config.store_addr, config.store_port, None, False,
                         timedelta(seconds=config.connect_timeout_s))


def _join_store(config: TransferConfig) -> Tuple[dist.Store, str]:
    """The pair's store (a client of the prefill rank's) under its current generation, and that prefix."""
    client = _client(config)
    generation = config.generation
    if generation <= 0:
        pair = dist.PrefixStore(config.group_name, client)
        pair.wait([generation_key()], timedelta(seconds=config.connect_timeout_s))
        generation = int(pair.get(generation_key()))
    prefix = generation_prefix(config.group_name, generation)
    return dist.PrefixStore(prefix, client), prefix


def _stats(role: str, link: Link, announcements: int, idle_waits: int = 0) -> TransferStats:
    return TransferStats(role, link.receives_posted, link.receives_pending, announcements, idle_waits)


def _serve_prefill(
    config: TransferConfig, conn: Connection, cache: KVCacheMemoryManager, link: Link, announcer: Announcer
) -> None:
    rng = random.Random()
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):
            return  # the owner is gone
        if isinstance(command, Shutdown):
            announcer.close()
            return
        if isinstance(command, QueryStats):
            _send_quiet(conn, _stats("prefill", link, announcer.count))
            continue
        if not isinstance(command, SendKV):
            _send_quiet(conn, TransferResult(getattr(command, "request_id", -1), False, 0.0, 0,
                                             f"the prefill transfer process cannot run {type(command).__name__}"))
            continue
        corrupt = config.failure_probability > 0 and rng.random() < config.failure_probability
        try:
            result = send_kv(link, announcer, cache, command.request_id, command.slots, config.page_size, corrupt,
                             command.first_token)
        except ChannelFault as fault:
            _broken(conn, [command.request_id] + _drain_requests(conn), str(fault))
            return
        _send_quiet(conn, result)


def _serve_decode(conn: Connection, cache: KVCacheMemoryManager, link: Link, watcher: AnnouncementWatcher) -> None:
    headers: "queue.Queue[object]" = queue.Queue()
    next_header = threading.Event()
    wake_read, wake_write = multiprocessing.Pipe(duplex=False)
    threading.Thread(target=_watch_announcements, args=(watcher, headers, next_header, wake_write),
                     daemon=True).start()
    waiting: Dict[int, Tuple[ReceiveKV, float]] = {}  # request id -> (command, deadline)
    stopped = [False]  # a Shutdown (or the owner's end) was read, maybe while looking for slots

    def take(command: object) -> bool:
        if isinstance(command, Shutdown):
            stopped[0] = True
            return False
        if isinstance(command, ReceiveKV):
            waiting[command.request_id] = (command, time.monotonic() + command.wait_s)
        elif isinstance(command, CancelReceive):
            # Only a receive still waiting for its header: one under way finishes and reports itself.
            if waiting.pop(command.request_id, None) is not None:
                _send_quiet(conn, TransferResult(command.request_id, False, 0.0, 0,
                                                 f"request {command.request_id}: receive cancelled (the request "
                                                 "ended before any KV arrived)", cancelled=True))
        elif isinstance(command, QueryStats):
            _send_quiet(conn, _stats("decode", link, watcher.count, watcher.idle_waits))
        else:
            _send_quiet(conn, TransferResult(getattr(command, "request_id", -1), False, 0.0, 0,
                                             f"the decode transfer process cannot run {type(command).__name__}"))
        return True

    def drain(timeout: float) -> bool:
        try:
            while conn.poll(timeout):
                if not take(conn.recv()):
                    return False
                timeout = 0
        except (EOFError, OSError):
            stopped[0] = True
            return False
        return True

    def find_slots(request_id: int):
        deadline = time.monotonic() + REGISTRATION_GRACE_S
        while request_id not in waiting and time.monotonic() < deadline:
            if not drain(0.01):
                break
        entry = waiting.pop(request_id, None)
        return None if entry is None else entry[0].slots

    while True:
        # Sleep until a command or an announcement arrives, or the next receive may expire.
        now = time.monotonic()
        timeout = max(0.0, min(deadline for _, deadline in waiting.values()) - now) if waiting else None
        ready = multiprocessing.connection.wait([conn, wake_read], timeout=timeout)
        if wake_read in ready:
            wake_read.recv_bytes()
        if stopped[0] or not drain(0):
            return
        now = time.monotonic()
        for request_id, (command, deadline) in list(waiting.items()):
            if now > deadline:
                del waiting[request_id]
                _send_quiet(conn, TransferResult(request_id, False, command.wait_s, 0,
                                                 f"request {request_id}: no KV arrived from the prefill side "
                                                 f"within {command.wait_s:g} s", expired=True))
        try:
            item = headers.get_nowait()
        except queue.Empty:
            continue
        if isinstance(item, ChannelFault):
            _broken(conn, list(waiting), str(item))
            return
        try:
            header = TransferHeader.from_bytes(item)
        except ValueError as exc:  # the announcements are out of step: the pair is useless
            _broken(conn, list(waiting), f"bad header from the prefill side: {exc}")
            return
        try:
            result = receive_kv(link, cache, header, find_slots)
        except ChannelFault as fault:
            _broken(conn, list(waiting) + [header.request_id], str(fault))
            return
        _send_quiet(conn, result)
        if stopped[0]:
            return
        next_header.set()


def _watch_announcements(
    watcher: AnnouncementWatcher, headers: "queue.Queue[object]", next_header: threading.Event, wake: Connection
) -> None:
    # Bounded store waits, renewed while idle; the next one starts only after the transfer
    # announced last was handled, so announcements are taken one at a time, in order.
    while True:
        try:
            header = watcher.next()
        except ChannelFault as fault:
            headers.put(fault)
            wake.send_bytes(b"!")
            return
        if header is None:
            continue
        headers.put(header)
        wake.send_bytes(b"h")
        next_header.wait()
        next_header.clear()


def _drain_requests(conn: Connection) -> List[int]:
    ids: List[int] = []
    try:
        while conn.poll(0):
            command = conn.recv()
            if isinstance(command, (SendKV, ReceiveKV)):
                ids.append(command.request_id)
    except (EOFError, OSError):
        pass
    return ids


def _broken(conn: Connection, request_ids: List[int], reason: str) -> None:
    # A peer that leaves while nothing is in flight is a normal shutdown of the pair.
    log = logger.warning if request_ids else logger.info
    log("KV transfer group broken: %s", reason)
    for request_id in dict.fromkeys(request_ids):
        _send_quiet(conn, TransferResult(request_id, False, 0.0, 0, f"request {request_id}: {reason}"))
    _send_quiet(conn, ChannelBroken(reason))


def _send_quiet(conn: Connection, message: object) -> None:
    try:
        conn.send(message)
    except (BrokenPipeError, EOFError, OSError):
        pass  # the owner is gone; it no longer needs results
