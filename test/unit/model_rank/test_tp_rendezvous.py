"""The TP rendezvous store listens on --nccl_host only, and the ranks still meet through it."""

from __future__ import annotations

import errno
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightllm.server.model_rank.tp_rendezvous import open_rendezvous_store
from lightllm.utils.free_ports import free_port


def _probe_other_loopback(port: int) -> str:
    """Bind 127.0.0.2:port: taken only if the store listens on every address, not 127.0.0.1 alone."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.2", port))
        except OSError as exc:
            return "taken" if exc.errno == errno.EADDRINUSE else f"error {exc.errno}"
        return "free"


def _rank(rank: int, port: int, results) -> None:
    store = open_rendezvous_store("127.0.0.1", port, rank, 2, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        results[rank] = (total.item(), _probe_other_loopback(port) if rank == 0 else "")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_store_listens_on_nccl_host_only_and_the_ranks_meet():
    port = free_port("127.0.0.1")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(port, results), nprocs=2, join=True)
        assert results[0][0] == results[1][0] == 3.0
        # torch's tcp:// rendezvous bound every interface: 127.0.0.2 was taken too.
        assert results[0][1] == "free"


def test_ipv6_brackets_are_accepted():
    if not socket.has_ipv6:
        return
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]
    except OSError:
        return  # no IPv6 loopback on this machine
    store = open_rendezvous_store("[::1]", port, 0, 1, timedelta(seconds=10))
    store.set("k", "v")
    assert store.get("k") == b"v"
