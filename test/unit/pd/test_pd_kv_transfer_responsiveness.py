"""A transfer process answers its owner at all times, gives up on a dead peer at once and dies with its owner.

Real transfer processes over gloo, as in test_pd_kv_transfer.py.  The owner is a rank's step loop:
it must never wait on its transfer process (a full pipe to a process that does not read it froze
a decode node's rank for two minutes), a cancellation must be honoured while the process still
starts or joins its group, and such a join must end within its bound (a group whose other side
never came kept a hung decode node's reservations for a minute after it resumed), a prefill node that is gone must
break its pairs at once (a store connect retried a refused port for its whole timeout), an
aborted prefill request must not wait behind the sends queued ahead of it, and a transfer
process must not outlive the rank that started it (an orphan lived up to two minutes after its
node was killed).  The bounds below are generous; without these properties each wait would last
the connect timeout (60 s or more) or forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import lightllm
from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.pd.kv_transfer import KVTransferHandle, TransferStoreHost
from lightllm.server.pd.node.transfer_ports import TransferPortBlock

from pd_kv_transfer_support import collect, free_port, wait_ready

LAYERS, HEADS, HEAD_DIM, SIZE = 2, 2, 8, 4096
# Far beyond every bound asserted here: a process that waited for it would fail the test.
CONNECT_TIMEOUT_S = 120.0
BOUND_S = 20.0


def _cache() -> KVCacheMemoryManager:
    return KVCacheMemoryManager(SIZE, LAYERS, HEADS, HEAD_DIM, torch.float32, shareable=True)


class _Store:
    """A prefill rank's store on its held port, with no prefill transfer process of its own."""

    def __init__(self) -> None:
        self.ports = TransferPortBlock.reserve("127.0.0.1", 1)
        self.host = TransferStoreHost(self.ports.socket_for(0), timeout_s=30.0)

    def lonely_decode(self, group: str, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> KVTransferHandle:
        """A decode handle whose pair's prefill side started (its generation exists) but never joins."""
        self.host.next_generation(group)
        return KVTransferHandle("decode", _cache(), "127.0.0.1", self.host.port, group_name=group,
                                connect_timeout_s=connect_timeout_s)

    def close(self) -> None:
        self.host.close()
        self.ports.close()


def test_cancellations_are_honoured_while_the_group_is_joining_and_a_join_is_bounded() -> None:
    store = _Store()
    decode = store.lonely_decode("joining", connect_timeout_s=8.0)
    try:
        decode.receive(1, torch.arange(10), wait_s=CONNECT_TIMEOUT_S)
        decode.receive(2, torch.arange(10, 20), wait_s=CONNECT_TIMEOUT_S)
        decode.cancel_receive(2)
        cancelled = collect(decode, 1, timeout_s=BOUND_S)[2]  # at once, while the process starts and joins
        assert cancelled.cancelled and "receive cancelled" in cancelled.reason
        assert not decode.ready and decode.broken_reason is None
        # The peer never comes: the join gives up within its bound and fails what the handle held.
        failed = collect(decode, 1, timeout_s=BOUND_S)[1]
        assert not failed.ok and "could not join the transfer group" in (decode.broken_reason or "")
    finally:
        decode.close()
        store.close()


def test_a_refused_transfer_port_breaks_the_pair_at_once() -> None:
    port = free_port()  # nobody listens: the prefill node that held it is gone
    decode = KVTransferHandle("decode", _cache(), "127.0.0.1", port, group_name="gone",
                              connect_timeout_s=CONNECT_TIMEOUT_S)
    try:
        decode.receive(3, torch.arange(5))
        failed = collect(decode, 1, timeout_s=BOUND_S)[3]
        assert not failed.ok
        assert decode.broken_reason is not None and "refuses connections" in decode.broken_reason
    finally:
        decode.close()


def test_the_owner_never_waits_on_a_transfer_process_that_does_not_read() -> None:
    block = TransferPortBlock.reserve("127.0.0.1", 1)
    host = TransferStoreHost(block.socket_for(0), timeout_s=30.0)
    prefill = KVTransferHandle("prefill", _cache(), host.connect_host, host.port, group_name="full-pipe",
                               store_host=host)
    decode = KVTransferHandle("decode", _cache(), "127.0.0.1", host.port, group_name="full-pipe")
    submitted = threading.Event()

    def submit() -> None:
        # 40 receives of 2000 slots: 640 KB of commands, ten times what a pipe holds.
        for request_id in range(40):
            decode.receive(100 + request_id, torch.arange(2000), wait_s=CONNECT_TIMEOUT_S)
        submitted.set()

    try:
        wait_ready(prefill, decode)
        os.kill(decode.pid, signal.SIGSTOP)  # joined, then stopped: it reads nothing
        threading.Thread(target=submit, daemon=True).start()
        assert submitted.wait(BOUND_S), "the owner blocked on the transfer process's pipe"
        os.kill(decode.pid, signal.SIGCONT)
        decode.cancel_receive(139)
        assert collect(decode, 1, timeout_s=BOUND_S)[139].cancelled  # and it reads them all once it runs
    finally:
        os.kill(decode.pid, signal.SIGCONT)
        decode.close()
        prefill.close()
        host.close()
        block.close()


def test_requests_wait_in_the_handle_until_the_process_has_joined() -> None:
    """A process still starting or joining reads nothing: a request it holds could not be given
    back before it got there.  The handle keeps them, and releases them once the process is ready."""
    block = TransferPortBlock.reserve("127.0.0.1", 1)
    host = TransferStoreHost(block.socket_for(0), timeout_s=30.0)
    source, target = _cache(), _cache()
    source.k_buffer.copy_(torch.randn(source.k_buffer.shape))
    decode = KVTransferHandle("decode", target, "127.0.0.1", host.port, group_name="late")
    try:
        decode.receive(50, torch.arange(100, 110), wait_s=CONNECT_TIMEOUT_S)
        decode.receive(51, torch.arange(200, 210), wait_s=CONNECT_TIMEOUT_S)
        decode.cancel_receive(51)  # at once: the process never saw it
        assert collect(decode, 1, timeout_s=1.0)[51].cancelled
        prefill = KVTransferHandle("prefill", source, host.connect_host, host.port, group_name="late",
                                   store_host=host)
        try:
            wait_ready(prefill, decode)
            prefill.send(50, torch.arange(10))
            assert collect(prefill, 1)[50].ok and collect(decode, 1)[50].ok  # the held receive went out
            assert torch.equal(target.export_slots(torch.arange(100, 110)), source.export_slots(torch.arange(10)))
        finally:
            prefill.close()
    finally:
        decode.close()
        host.close()
        block.close()


def test_a_send_queued_behind_a_stuck_one_is_cancelled_at_once() -> None:
    block = TransferPortBlock.reserve("127.0.0.1", 1)
    host = TransferStoreHost(block.socket_for(0), timeout_s=30.0)
    source = _cache()
    prefill = KVTransferHandle("prefill", source, host.connect_host, host.port, group_name="queue",
                               store_host=host, timeout_s=BOUND_S * 3)
    decode = KVTransferHandle("decode", _cache(), "127.0.0.1", host.port, group_name="queue")
    try:
        wait_ready(prefill, decode)
        os.kill(decode.pid, signal.SIGSTOP)  # the first send waits for a verdict that does not come
        prefill.send(7, torch.arange(20))
        prefill.send(8, torch.arange(20, 40))
        prefill.cancel_send(8)
        cancelled = collect(prefill, 1, timeout_s=BOUND_S)[8]
        assert cancelled.cancelled and "send cancelled" in cancelled.reason
        assert prefill.in_flight == [7]  # the one under way reports itself
        os.kill(decode.pid, signal.SIGKILL)
        assert not collect(prefill, 1, timeout_s=BOUND_S * 4)[7].ok
    finally:
        prefill.close()
        decode.close()
        host.close()
        block.close()


_OWNER = """
import os, sys, time, torch
from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.pd.kv_transfer import KVTransferHandle, TransferStoreHost
from lightllm.server.pd.node.transfer_ports import TransferPortBlock
ports = TransferPortBlock.reserve("127.0.0.1", 1)
host = TransferStoreHost(ports.socket_for(0), timeout_s=30.0)
cache = KVCacheMemoryManager(64, 1, 1, 4, torch.float32, shareable=True)
# A prefill side waiting for a decode side that never comes: a long join.
handle = KVTransferHandle("prefill", cache, host.connect_host, host.port, group_name="orphan",
                          store_host=host, connect_timeout_s=float(sys.argv[1]))
print(handle.pid, os.fstat(ports.socket_for(0).fileno()).st_ino, flush=True)
time.sleep(600)
"""


def _socket_inodes(pid: int) -> set:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def test_a_transfer_process_ends_with_its_owner_and_never_holds_the_nodes_port(tmp_path: Path) -> None:
    # The owner imports this very lightllm (not whatever an installed copy points to).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(lightllm.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(CONNECT_TIMEOUT_S)], stdout=subprocess.PIPE,
                             text=True, cwd=tmp_path, env=env)
    try:
        child, listening = (int(field) for field in owner.stdout.readline().split())
        assert listening not in _socket_inodes(child)  # the node's held port stays the node's
        owner.kill()  # kill -9 of the rank: nothing stops the child on purpose
        owner.wait(10)
        deadline = time.monotonic() + BOUND_S
        while os.path.exists(f"/proc/{child}") and _state(child) != "Z":
            assert time.monotonic() < deadline, "the transfer process outlived its owner"
            time.sleep(0.1)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"
