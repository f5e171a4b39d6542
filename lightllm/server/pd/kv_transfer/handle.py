"""The rank process's side of its KV transfer process: commands out, results in, never blocking.

Typical use on a prefill rank::

    handle = KVTransferHandle("prefill", kv_cache, host, port, page_size=256, store_host=store_host)
    handle.send(request_id, context.slots(req, start, end))   # after the step's handoffs
    for result in handle.poll():                              # once per step
        backend.transfer_done(result.request_id, result.ok)

and on a decode rank ``handle.receive(request_id, slots)`` after ``reserve_prefilled``, then
``admit_prefilled`` / ``transfer_failed`` on the polled results.  One handle serves one pair
(one peer node, one epoch); a rank paired with several peers holds one handle per pair, and a
prefill rank's handles share its one :class:`~.store_host.TransferStoreHost`.  When a handle
reports :attr:`broken_reason` (its group failed) every request it held has been reported failed;
the owner calls :meth:`restart` on both sides, or drops the pair.

No method waits on the transfer process (except :meth:`wait_ready` and :meth:`query_stats`, for
start-up and tests): until the process has joined its group the handle keeps requests back
itself, where a cancellation takes effect at once (:mod:`.held_commands`); after that commands
are written by a thread of the handle's own (:mod:`.pipe_writer`), and the process reads them at
all times, even while it moves another request's KV. The process ends by itself when the process
that started the handle is gone (:mod:`.owner_watch`); start handles from a thread that lives as
long as they do (a rank's step loop).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from typing import Iterator, List, Optional, Sequence, Union

import numpy as np
import torch
import torch.multiprocessing as torch_mp

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.pd.transfer_defaults import (
    CONNECT_TIMEOUT_FLOOR_S,
    DEFAULT_PD_KV_PAGE_SIZE,
    DEFAULT_PD_TRANSFER_TIMEOUT_S,
)
from lightllm.server.pd.kv_transfer.held_commands import HeldCommands
from lightllm.server.pd.kv_transfer.messages import (
    CancelReceive,
    CancelSend,
    ChannelBroken,
    ChannelReady,
    QueryStats,
    ReceiveKV,
    SendKV,
    Shutdown,
    TransferResult,
    TransferStats,
)
from lightllm.server.pd.kv_transfer.pipe_writer import PipeWriter
from lightllm.server.pd.kv_transfer.store_host import TransferStoreHost
from lightllm.server.pd.kv_transfer.transfer_config import TransferConfig
from lightllm.server.pd.kv_transfer.worker import run_transfer_process
from lightllm.server.run_mode import PD_NODE_MODES, RunMode

logger = logging.getLogger(__name__)

ROLES = PD_NODE_MODES
# How many reported requests a handle remembers, to tell a late refusal of one from a stray result:
# far more than can end between a cancel and the peer's header for it.
_ENDED_REMEMBERED = 4096


class KVTransferHandle:
    """Owns one KV transfer process for one TP rank and one pair, and talks to it through a pipe.

    ``role`` is ``"prefill"`` (rank 0 of the transfer group) or ``"decode"`` (rank 1).  Both
    sides join the prefill rank's TCP store at ``store_addr:store_port`` as clients: a prefill
    handle is given the rank's ``store_host`` (shared by all its pairs; ``store_addr`` and
    ``store_port`` must then name it), or without one starts and owns a host of its own bound to
    ``store_addr:store_port``.  ``kv_cache`` must have shareable buffers (``shareable=True`` or
    :meth:`KVCacheMemoryManager.share_buffers`).  ``page_size`` is the tokens per page on the
    wire (the intended ``--pd_kv_page_size``; only the prefill side's value is used, the decode
    side follows the header).  Every wait on the peer is bounded by ``timeout_s``; joining the
    group by ``connect_timeout_s``.  A decode-side receive fails when no KV for it starts
    arriving within ``receive_wait_s``.  Both sides must pass the same ``group_name`` (the prefix
    of the pair's store keys).  ``announce_wait_s`` bounds each of the decode side's waits for the
    next announced transfer (renewed while idle; a dead prefill node ends it at once).
    ``failure_probability``: the share of a prefill side's transfers made to fail, for tests
    (``LIGHTLLM_PD_TRANSFER_FAILURE_PROBABILITY``, read once into
    :class:`~lightllm.server.model_rank.rank_config.PdRankSettings`); the decode side ignores it.
    """

    def __init__(
        self,
        role: str,
        kv_cache: KVCacheMemoryManager,
        store_addr: str,
        store_port: int,
        page_size: int = DEFAULT_PD_KV_PAGE_SIZE,
        timeout_s: float = DEFAULT_PD_TRANSFER_TIMEOUT_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_FLOOR_S,
        receive_wait_s: float = 60.0,
        group_name: str = "lightllm-kv",
        store_host: Optional[TransferStoreHost] = None,
        announce_wait_s: float = 30.0,
        failure_probability: float = 0.0,
    ):
        if role not in ROLES:
            raise ValueError(f"KV transfer role must be one of {ROLES}, got {role!r}")
        if store_host is not None and role != RunMode.PREFILL:
            raise ValueError("only a prefill KV transfer handle uses the rank's store host")
        if page_size <= 0:
            raise ValueError(f"KV transfer page size must be positive, got {page_size}")
        if timeout_s <= 0 or connect_timeout_s <= 0 or receive_wait_s <= 0 or announce_wait_s <= 0:
            raise ValueError("KV transfer timeouts must be positive")
        if not 0.0 <= failure_probability <= 1.0:
            raise ValueError(f"KV transfer failure probability must be in [0, 1], got {failure_probability!r}")
        self.role = role
        self._view = kv_cache.transfer_view()
        self._store_addr = store_addr
        self._page_size = page_size
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._receive_wait_s = receive_wait_s
        self._announce_wait_s = announce_wait_s
        # Only the sending (prefill) side corrupts a payload.
        self._failure_probability = failure_probability if role == RunMode.PREFILL else 0.0
        self._group_name = group_name
        self._store_host = store_host
        self._owns_store_host = False
        self._ctx = torch_mp.get_context("spawn")
        self._process = None
        self._conn = None
        self._writer: Optional[PipeWriter] = None
        self._held = HeldCommands()  # requests kept back until the process is ready
        self._in_flight: dict = {}  # request id -> bytes announced (0 until known)
        # The latest requests whose result was reported: a late refusal of one of them is expected.
        self._ended: "OrderedDict[int, None]" = OrderedDict()
        self._results: List[TransferResult] = []
        self._stats: Optional[TransferStats] = None
        self.ready = False
        self.broken_reason: Optional[str] = None
        self.generation = 0  # prefill side: which start of the pair's group this is
        self._start(store_port)

    # --- commands ---------------------------------------------------------------------------
    def send(self, request_id: int, slots: Union[torch.Tensor, Sequence[int]], first_token: int = -1) -> None:
        """Prefill side: send the KV in ``slots`` (token order) as ``request_id``.

        ``first_token`` travels in the header; the decode side's result carries it.
        """
        self._require("prefill", "send")
        self._submit(SendKV(request_id, _as_array(slots), int(first_token)))

    def receive(
        self, request_id: int, slots: Union[torch.Tensor, Sequence[int]], wait_s: Optional[float] = None
    ) -> None:
        """Decode side: write ``request_id``'s KV into the reserved ``slots`` when it arrives."""
        self._require("decode", "receive")
        self._submit(ReceiveKV(request_id, _as_array(slots), self._receive_wait_s if wait_s is None else wait_s))

    def cancel_receive(self, request_id: int) -> None:
        """Decode side: give up ``request_id``'s receive if its KV has not started arriving.

        Its result comes through :meth:`poll` as usual: ``cancelled``, or the transfer's own when
        it was already under way.
        """
        self._require("decode", "cancel_receive")
        self._cancel(CancelReceive(request_id))

    def cancel_send(self, request_id: int) -> None:
        """Prefill side: take ``request_id``'s send off the queue if it has not started.

        Its result comes through :meth:`poll` as usual: ``cancelled``, or the transfer's own when
        it was already under way.
        """
        self._require("prefill", "cancel_send")
        self._cancel(CancelSend(request_id))

    def _cancel(self, command: Union[CancelReceive, CancelSend]) -> None:
        request_id = command.request_id
        if self._held.take_back(request_id):
            # The process never saw it: nothing can touch its KV any more.
            verb = "receive" if isinstance(command, CancelReceive) else "send"
            self._finish(TransferResult(request_id, False, 0.0, 0, f"request {request_id}: {verb} cancelled (the "
                                        "request ended before its KV transfer started)", cancelled=True))
        elif request_id in self._in_flight and self._writer is not None and self.broken_reason is None:
            self._writer.send(command)

    def poll(self) -> List[TransferResult]:
        """Finished transfers since the last call (never blocks)."""
        self._read_pipe()
        if self._process is not None and not self._process.is_alive():
            self._read_pipe()
            reason = self.broken_reason or f"the KV transfer process exited with code {self._process.exitcode}"
            self.broken_reason = reason
            self._fail_in_flight(reason)
        results, self._results = self._results, []
        return results

    @property
    def in_flight(self) -> List[int]:
        """Requests submitted and not yet reported."""
        return list(self._in_flight)

    @property
    def pid(self) -> Optional[int]:
        """The transfer process's pid (None when stopped)."""
        return None if self._process is None else self._process.pid

    # --- lifecycle --------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until the group is joined (for startup and tests only)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready and self.broken_reason is None and time.monotonic() < deadline:
            if self._conn is not None and self._conn.poll(0.05):
                self._read_pipe()
            elif self._process is not None and not self._process.is_alive():
                self.poll()
        return self.ready

    def restart(self, store_port: Optional[int] = None) -> None:
        """Replace the transfer process and its group; both sides of the pair must restart.

        The prefill side restarts first: its new process joins under a new generation of the
        pair's keys, which the decode side's new process follows.  ``store_port`` (default: the
        same) moves a prefill handle's own store host, or a decode handle, to another port.
        Results already reported by the old process are kept; requests it still held are
        reported failed by the next :meth:`poll`.
        """
        self._stop()
        self._fail_in_flight("the KV transfer process was replaced")
        self._start(self.store_port if store_port is None else store_port)

    def close(self) -> None:
        """Stop the transfer process; requests still held are reported failed by :meth:`poll`."""
        self._stop()
        self._fail_in_flight("the KV transfer process was stopped")
        if self._owns_store_host and self._store_host is not None:
            self._store_host.close()
            self._store_host = None

    def query_stats(self, timeout_s: float = 10.0) -> Optional[TransferStats]:
        """Ask the transfer process what it posted and waits on; None without an answer in time.

        Blocks up to ``timeout_s`` (diagnostics and tests only); other messages read meanwhile
        are kept for :meth:`poll`.
        """
        if self._conn is None or self._writer is None:
            return None
        self._stats = None
        self._writer.send(QueryStats())
        deadline = time.monotonic() + timeout_s
        while self._stats is None and time.monotonic() < deadline:
            if self._conn.poll(0.05):
                self._read_pipe()
            elif self._process is not None and not self._process.is_alive():
                break
        return self._stats

    # --- internals --------------------------------------------------------------------------
    def _start(self, store_port: int) -> None:
        generation, store_addr = 0, self._store_addr
        if self.role == RunMode.PREFILL:
            host = self._prefill_store_host(store_port)
            store_addr = host.connect_host
            # Counted before the process starts, so a decode side restarted after this call
            # follows the new group, never the keys the old one left.
            generation = host.next_generation(self._group_name)
        config = TransferConfig(self.role, store_addr, store_port, self._group_name, generation,
                                self._page_size, self._timeout_s, self._connect_timeout_s, self._failure_probability,
                                self._announce_wait_s, owner_pid=os.getpid())
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=run_transfer_process, args=(config, child, self._view),
                                    name=f"kv-transfer-{self.role}", daemon=True)
        with _quiet_store_timeouts():
            process.start()
        child.close()
        self._process, self._conn = process, parent
        self._writer = PipeWriter(parent, f"kv-transfer-{self.role}-pipe")
        self.ready, self.broken_reason = False, None
        self.store_port = store_port
        self.generation = generation

    def _prefill_store_host(self, store_port: int) -> TransferStoreHost:
        host = self._store_host
        if host is not None and host.port == store_port and not host.closed:
            return host
        if host is not None and not self._owns_store_host:
            if host.closed:
                raise ValueError("the rank's transfer store is closed")
            raise ValueError(f"the rank's transfer store is on port {host.port}, not {store_port}")
        if host is not None:
            host.close()
        self._store_host = TransferStoreHost(host=self._store_addr, port=store_port,
                                             timeout_s=self._connect_timeout_s)
        self._owns_store_host = True
        return self._store_host

    def _stop(self) -> None:
        if self._conn is not None:
            self._read_pipe()
        if self._process is not None:
            if self._process.is_alive() and self._writer is not None:
                self._writer.send(Shutdown())
                self._process.join(0.2)
            if self._process.is_alive():
                # A process stuck on its peer is not unblocked by aborting the group: kill it.
                self._process.kill()
            self._process.join(5.0)
            self._read_pipe()
        if self._writer is not None:
            # The process is gone, so a write still blocked on its full pipe fails at once.
            self._writer.close(1.0)
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn, self._writer = None, None, None
        self.ready = False

    def _submit(self, command: Union[SendKV, ReceiveKV]) -> None:
        if command.request_id in self._in_flight:
            raise ValueError(f"request {command.request_id} already has a KV transfer in flight")
        self._in_flight[command.request_id] = 0
        if self.broken_reason is not None or self._writer is None:
            self._finish(TransferResult(command.request_id, False, 0.0, 0,
                                        f"request {command.request_id}: KV transfer unavailable "
                                        f"({self.broken_reason or 'stopped'}); restart it"))
            return
        if not self.ready:
            self._held.hold(command)  # until the process has joined its group (see held_commands.py)
            return
        # Queued, never written here: the caller is a rank's step loop (see pipe_writer.py).  A
        # process that is gone is noticed by the next poll(), which fails what it held.
        self._writer.send(command)

    def _read_pipe(self) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            while conn.poll(0):
                message = conn.recv()
                if isinstance(message, TransferResult):
                    self._finish(message)
                elif isinstance(message, ChannelReady):
                    self.ready = True
                    if self._writer is not None:
                        for command in self._held.release():
                            self._writer.send(command)
                elif isinstance(message, ChannelBroken):
                    self.broken_reason = message.reason
                elif isinstance(message, TransferStats):
                    self._stats = message
        except (EOFError, OSError):
            pass

    def _finish(self, result: TransferResult) -> None:
        if self._in_flight.pop(result.request_id, None) is None:
            if result.unreserved and result.request_id in self._ended:
                # Its receive ended first (cancelled, expired) and was reported then.
                logger.debug("request %s: KV refused after its receive ended", result.request_id)
            else:  # a request this handle never had: worth a look
                logger.warning("KV transfer result for unknown request %s dropped", result.request_id)
            return
        self._ended.pop(result.request_id, None)  # a reused id counts from its latest end
        self._ended[result.request_id] = None
        if len(self._ended) > _ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        self._results.append(result)

    def _fail_in_flight(self, reason: str) -> None:
        self._held.clear()
        for request_id in list(self._in_flight):
            self._finish(TransferResult(request_id, False, 0.0, 0, f"request {request_id}: {reason}"))

    def _require(self, role: str, verb: str) -> None:
        if self.role != role:
            raise ValueError(f"a {self.role} KV transfer handle cannot {verb}; only a {role} one can")


@contextlib.contextmanager
def _quiet_store_timeouts() -> Iterator[None]:
    """Start a transfer process with torch's C++ warnings off, unless the user chose a level.

    Every bounded wait of an idle decode side for the next announcement ends in a store timeout,
    which c10d logs as two warnings; errors still show, and faults reach the owner as messages.
    The spawned child reads its environment as it imports torch, so setting it around the start is enough.
    """
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        yield
    finally:
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


def _as_array(slots: Union[torch.Tensor, Sequence[int]]) -> np.ndarray:
    if isinstance(slots, torch.Tensor):
        return slots.detach().to("cpu", torch.int64).numpy().copy()
    return np.asarray(slots, dtype=np.int64)
