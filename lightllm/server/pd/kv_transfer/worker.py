"""The KV transfer process: a child of one TP rank process, paired with the peer node's.

It joins its own two-rank torch.distributed group (rank 0 = prefill side, serving the pair's
TCP store; rank 1 = decode side; gloo for CPU caches, NCCL for CUDA ones), never the rank's TP
group, and serves :mod:`messages` commands from its owner's pipe.  On a fault of the group
(timeout, dead peer) it fails everything it holds, reports :class:`ChannelBroken` and exits;
the owner starts a fresh one.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import random
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.pd.kv_transfer.bounded_wait import ChannelFault, wait_work
from lightllm.server.pd.kv_transfer.messages import (
    ChannelBroken,
    ChannelReady,
    ReceiveKV,
    SendKV,
    Shutdown,
    TransferResult,
)
from lightllm.server.pd.kv_transfer.protocol import DECODE_RANK, PREFILL_RANK, Link, receive_header, receive_kv, send_kv

logger = logging.getLogger(__name__)

# An idle decode side waits for the next header this long; a dead peer ends the wait at once
# (the connection closes), and a transfer in progress is bounded by timeout_s instead.
IDLE_WAIT_S = 7 * 24 * 3600.0
# A header may overtake the ReceiveKV command that registers its slots (two independent
# pipes); wait this long for the command before refusing the header.
REGISTRATION_GRACE_S = 1.0


@dataclass(frozen=True)
class TransferConfig:
    """What a transfer process needs besides its cache and pipe."""

    role: str  # "prefill" or "decode"
    store_addr: str
    store_port: int
    # Prefix of every key the pair puts in its store: a decode side pointed at some other
    # store (a stale address, another group's port) never matches keys and times out instead.
    group_name: str
    # Prefill side: the node's listening socket for store_port (see pd/transfer_ports.py);
    # None binds store_port here.
    listen_socket: Optional[socket.socket]
    page_size: int
    timeout_s: float
    connect_timeout_s: float
    failure_probability: float


def run_transfer_process(config: TransferConfig, conn: Connection, cache: KVCacheMemoryManager) -> None:
    """Entry point of the child process."""
    torch.set_num_threads(1)
    start = time.monotonic()
    cuda = cache.device.type == "cuda"
    if cuda:
        torch.cuda.set_device(cache.device)
    rank = PREFILL_RANK if config.role == "prefill" else DECODE_RANK
    try:
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=_open_store(config, rank),
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=config.connect_timeout_s),
        )
        if cuda:
            # NCCL connects lazily: a first exchange makes "ready" mean ready.
            probe = torch.zeros(1, device=cache.device)
            wait_work(dist.all_reduce(probe, async_op=True), config.connect_timeout_s, "the peer to connect", True)
    except Exception as exc:  # noqa: BLE001 - any failure to join is reported, not raised
        _broken(conn, [], f"could not join the transfer group at {config.store_addr}:{config.store_port}: {exc}")
        os._exit(0)
    link = Link(cache.device if cuda else torch.device("cpu"), cuda, config.timeout_s)
    _send_quiet(conn, ChannelReady(time.monotonic() - start))
    if config.role == "prefill":
        _serve_prefill(config, conn, cache, link)
    else:
        _serve_decode(conn, cache, link)
    # Skip interpreter teardown: the header listener may still sit in a gloo wait, and
    # destroying the group under it aborts noisily.  Every message was sent synchronously.
    os._exit(0)


def _open_store(config: TransferConfig, rank: int) -> dist.Store:
    """The pair's rendezvous: the prefill side serves a TCP store, the decode side connects to it."""
    timeout = timedelta(seconds=config.connect_timeout_s)
    if rank == PREFILL_RANK:
        fd = None if config.listen_socket is None else config.listen_socket.fileno()
        store = dist.TCPStore(config.store_addr, config.store_port, 2, True, timeout, master_listen_fd=fd)
    else:
        store = dist.TCPStore(config.store_addr, config.store_port, 2, False, timeout)
    return dist.PrefixStore(config.group_name, store)


def _serve_prefill(config: TransferConfig, conn: Connection, cache: KVCacheMemoryManager, link: Link) -> None:
    rng = random.Random()
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):
            return  # the owner is gone
        if isinstance(command, Shutdown):
            return
        if not isinstance(command, SendKV):
            _send_quiet(conn, TransferResult(getattr(command, "request_id", -1), False, 0.0, 0,
                                             f"the prefill transfer process cannot run {type(command).__name__}"))
            continue
        corrupt = config.failure_probability > 0 and rng.random() < config.failure_probability
        try:
            result = send_kv(link, cache, command.request_id, command.slots, config.page_size, corrupt,
                             command.first_token)
        except ChannelFault as fault:
            _broken(conn, [command.request_id] + _drain_requests(conn), str(fault))
            return
        _send_quiet(conn, result)


def _serve_decode(conn: Connection, cache: KVCacheMemoryManager, link: Link) -> None:
    headers: "queue.Queue[object]" = queue.Queue()
    next_header = threading.Event()
    wake_read, wake_write = multiprocessing.Pipe(duplex=False)
    threading.Thread(target=_listen_for_headers, args=(link, headers, next_header, wake_write), daemon=True).start()
    waiting: Dict[int, Tuple[ReceiveKV, float]] = {}  # request id -> (command, deadline)

    def take(command: object) -> bool:
        if isinstance(command, Shutdown):
            return False
        if isinstance(command, ReceiveKV):
            waiting[command.request_id] = (command, time.monotonic() + command.wait_s)
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
        # Sleep until a command or a header arrives (or a receive may have expired).
        ready = multiprocessing.connection.wait([conn, wake_read], timeout=0.1)
        if wake_read in ready:
            wake_read.recv_bytes()
        if not drain(0):
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
            result = receive_kv(link, cache, item, find_slots)
        except ChannelFault as fault:
            _broken(conn, list(waiting) + [int(item[2].item())], str(fault))
            return
        except ValueError as exc:  # not a header: the stream is out of step, the group is useless
            _broken(conn, list(waiting), f"bad header from the prefill side: {exc}")
            return
        _send_quiet(conn, result)
        next_header.set()


def _listen_for_headers(
    link: Link, headers: "queue.Queue[object]", next_header: threading.Event, wake: Connection
) -> None:
    # The only wait that may be long: nothing is in flight until a header arrives.
    while True:
        buffer, work = receive_header(link)
        try:
            wait_work(work, IDLE_WAIT_S, "the next request header", link.polled)
        except ChannelFault as fault:
            headers.put(fault)
            wake.send_bytes(b"!")
            return
        headers.put(buffer)
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
