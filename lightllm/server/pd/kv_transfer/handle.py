"""The rank process's side of its KV transfer process: commands out, results in, never blocking.

Typical use on a prefill rank::

    handle = KVTransferHandle("prefill", kv_cache, store_addr, port, page_size=256)
    handle.send(request_id, context.slots(req, start, end))   # after the step's handoffs
    for result in handle.poll():                              # once per step
        backend.transfer_done(result.request_id, result.ok)

and on a decode rank ``handle.receive(request_id, slots)`` after ``reserve_prefilled``, then
``admit_prefilled`` / ``transfer_failed`` on the polled results.  When a handle reports
:attr:`broken_reason` (its group failed) every request it held has been reported failed; the
owner calls :meth:`restart` with a fresh port on both sides.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import List, Optional, Sequence, Union

import numpy as np
import torch
import torch.multiprocessing as torch_mp

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.pd.kv_transfer.messages import (
    ChannelBroken,
    ChannelReady,
    ReceiveKV,
    SendKV,
    Shutdown,
    TransferResult,
)
from lightllm.server.pd.kv_transfer.worker import TransferConfig, run_transfer_process
from lightllm.utils.envs_utils import pd_transfer_failure_probability
from lightllm.server.run_mode import PD_NODE_MODES

logger = logging.getLogger(__name__)

ROLES = PD_NODE_MODES


class KVTransferHandle:
    """Owns one KV transfer process for one TP rank and talks to it through a pipe.

    ``role`` is ``"prefill"`` (rank 0 of the transfer group; hosts the TCP store at
    ``store_addr:store_port``) or ``"decode"`` (rank 1; connects to it).  ``kv_cache`` must have
    shareable buffers (``shareable=True`` or :meth:`KVCacheMemoryManager.share_buffers`).
    ``page_size`` is the tokens per page on the wire (the intended ``--pd_kv_page_size``; only
    the prefill side's value is used, the decode side follows the header).  Every wait on the
    peer is bounded by ``timeout_s``; joining the group by ``connect_timeout_s``.  A decode-side
    receive fails when no KV for it starts arriving within ``receive_wait_s``.  Both sides must
    pass the same ``group_name`` (the prefix of the pair's store keys).  ``listen_socket``
    (prefill side only) is a socket already listening on ``store_port`` that every transfer
    process of this handle serves its store on, so the port stays held between them.
    """

    def __init__(
        self,
        role: str,
        kv_cache: KVCacheMemoryManager,
        store_addr: str,
        store_port: int,
        page_size: int = 256,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 60.0,
        receive_wait_s: float = 60.0,
        group_name: str = "lightllm-kv",
        listen_socket: Optional[socket.socket] = None,
    ):
        if role not in ROLES:
            raise ValueError(f"KV transfer role must be one of {ROLES}, got {role!r}")
        if listen_socket is not None and role != "prefill":
            raise ValueError("only a prefill KV transfer handle serves the pair's store on a listening socket")
        if page_size <= 0:
            raise ValueError(f"KV transfer page size must be positive, got {page_size}")
        if timeout_s <= 0 or connect_timeout_s <= 0 or receive_wait_s <= 0:
            raise ValueError("KV transfer timeouts must be positive")
        self.role = role
        self._view = kv_cache.transfer_view()
        self._store_addr = store_addr
        self._page_size = page_size
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._receive_wait_s = receive_wait_s
        self._group_name = group_name
        self._listen_socket = listen_socket
        self._ctx = torch_mp.get_context("spawn")
        self._process = None
        self._conn = None
        self._in_flight: dict = {}  # request id -> bytes announced (0 until known)
        self._results: List[TransferResult] = []
        self.ready = False
        self.broken_reason: Optional[str] = None
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

    def restart(self, store_port: int) -> None:
        """Replace the transfer process and its group (new TCP store port).

        Results already reported by the old process are kept; requests it still held are
        reported failed by the next :meth:`poll`.
        """
        self._stop()
        self._fail_in_flight("the KV transfer process was replaced")
        self._start(store_port)

    def close(self) -> None:
        """Stop the transfer process; requests still held are reported failed by :meth:`poll`."""
        self._stop()
        self._fail_in_flight("the KV transfer process was stopped")

    # --- internals --------------------------------------------------------------------------
    def _start(self, store_port: int) -> None:
        listen_socket = self._listen_socket
        if listen_socket is not None and listen_socket.getsockname()[1] != store_port:
            raise ValueError(f"the listening socket is on port {listen_socket.getsockname()[1]}, not {store_port}")
        # Only the sending (prefill) side corrupts a payload; the launcher checked the value at start-up.
        failure_probability = pd_transfer_failure_probability() if self.role == "prefill" else 0.0
        config = TransferConfig(self.role, self._store_addr, store_port, self._group_name, listen_socket,
                                self._page_size, self._timeout_s, self._connect_timeout_s, failure_probability)
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=run_transfer_process, args=(config, child, self._view),
                                    name=f"kv-transfer-{self.role}", daemon=True)
        process.start()
        child.close()
        self._process, self._conn = process, parent
        self.ready, self.broken_reason = False, None
        self.store_port = store_port

    def _stop(self) -> None:
        if self._conn is not None:
            self._read_pipe()
        if self._process is not None:
            if self._process.is_alive() and self._conn is not None:
                try:
                    self._conn.send(Shutdown())
                except (BrokenPipeError, OSError):
                    pass
                self._process.join(0.2)
            if self._process.is_alive():
                # A process stuck on its peer is not unblocked by aborting the group: kill it.
                self._process.kill()
            self._process.join(5.0)
            self._read_pipe()
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None
        self.ready = False

    def _submit(self, command: Union[SendKV, ReceiveKV]) -> None:
        if command.request_id in self._in_flight:
            raise ValueError(f"request {command.request_id} already has a KV transfer in flight")
        self._in_flight[command.request_id] = 0
        if self.broken_reason is not None or self._conn is None:
            self._finish(TransferResult(command.request_id, False, 0.0, 0,
                                        f"request {command.request_id}: KV transfer unavailable "
                                        f"({self.broken_reason or 'stopped'}); restart it"))
            return
        try:
            self._conn.send(command)
        except (BrokenPipeError, OSError) as exc:
            self._finish(TransferResult(command.request_id, False, 0.0, 0,
                                        f"request {command.request_id}: the KV transfer process is gone ({exc})"))

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
                elif isinstance(message, ChannelBroken):
                    self.broken_reason = message.reason
        except (EOFError, OSError):
            pass

    def _finish(self, result: TransferResult) -> None:
        if self._in_flight.pop(result.request_id, None) is None:
            logger.warning("KV transfer result for unknown request %s dropped", result.request_id)
            return
        self._results.append(result)

    def _fail_in_flight(self, reason: str) -> None:
        for request_id in list(self._in_flight):
            self._finish(TransferResult(request_id, False, 0.0, 0, f"request {request_id}: {reason}"))

    def _require(self, role: str, verb: str) -> None:
        if self.role != role:
            raise ValueError(f"a {self.role} KV transfer handle cannot {verb}; only a {role} one can")


def _as_array(slots: Union[torch.Tensor, Sequence[int]]) -> np.ndarray:
    if isinstance(slots, torch.Tensor):
        return slots.detach().to("cpu", torch.int64).numpy().copy()
    return np.asarray(slots, dtype=np.int64)
