"""Helpers shared by the PD KV transfer tests: free ports, handle pairs, waiting for results."""

from __future__ import annotations

import socket
import time
from typing import Dict, List, Tuple

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.pd.kv_transfer import KVTransferHandle, TransferResult

READY_TIMEOUT_S = 90.0


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_pair(
    source: KVCacheMemoryManager, target: KVCacheMemoryManager, **kwargs
) -> Tuple[KVTransferHandle, KVTransferHandle]:
    """A prefill handle over ``source`` and a decode handle over ``target``, joined."""
    port = free_port()
    prefill = KVTransferHandle("prefill", source, "127.0.0.1", port, **kwargs)
    decode = KVTransferHandle("decode", target, "127.0.0.1", port, **kwargs)
    wait_ready(prefill, decode)
    return prefill, decode


def wait_ready(*handles: KVTransferHandle) -> None:
    """Wait for every handle's group to be joined."""
    for handle in handles:
        assert handle.wait_ready(READY_TIMEOUT_S), f"{handle.role} transfer process not ready: {handle.broken_reason}"


def restart_pair(prefill: KVTransferHandle, decode: KVTransferHandle) -> None:
    """Replace both transfer processes (prefill first), on the same store: a new generation of the pair's keys."""
    generation = prefill.generation
    prefill.restart()
    decode.restart()
    assert prefill.generation == generation + 1
    wait_ready(prefill, decode)


def collect(handle: KVTransferHandle, count: int, timeout_s: float = 60.0) -> Dict[int, TransferResult]:
    """Poll ``handle`` until ``count`` results arrived (fails the test after ``timeout_s``)."""
    results: List[TransferResult] = []
    deadline = time.monotonic() + timeout_s
    while len(results) < count:
        assert time.monotonic() < deadline, f"{handle.role}: only {len(results)} of {count} results: {results}"
        results += handle.poll()
        time.sleep(0.005)
    return {r.request_id: r for r in results}
