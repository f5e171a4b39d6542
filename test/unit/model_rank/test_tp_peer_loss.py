"""A rank whose collective fails because its peer rank died logs one warning, not a crash traceback.

Real torch.distributed (gloo) between two spawned processes: one exits, the other's all_reduce
fails, and the failure is recognised as the peer's loss; a crash of the rank's own making is not.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from datetime import timedelta
from typing import Any

from lightllm.server.model_rank.tp_peer_loss import lost_tp_peer
from lightllm.utils.free_ports import free_port


def _rank(rank: int, port: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    tensor = torch.ones(4)
    if rank == 1:
        dist.all_reduce(tensor)  # both alive: the group works
        os._exit(0)  # the peer goes away without a word, as a killed rank does
    try:
        # The first collective may itself meet the peer's exit (it leaves as soon as its own part is done).
        for _ in range(50):
            dist.all_reduce(tensor)
        results.send(("no error", ""))
    except Exception as exc:  # noqa: BLE001 - the failure is what the test reads
        # A pipe's send is done when it returns; a queue's feeder thread would die with os._exit.
        results.send((lost_tp_peer(exc), str(exc)[:300]))
    os._exit(0)


def test_a_collective_whose_peer_died_is_recognised() -> None:
    ctx = mp.get_context("spawn")
    results, sender = ctx.Pipe(duplex=False)
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, sender), daemon=True) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        assert results.poll(120), "rank 0 reported nothing"
        recognised, message = results.recv()
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert recognised is True, message


def test_an_error_of_the_ranks_own_is_not_a_lost_peer() -> None:
    try:
        raise RuntimeError("Connection reset by peer")  # the words, but not from torch.distributed
    except RuntimeError as exc:
        assert not lost_tp_peer(exc)
    try:
        raise ValueError("shape mismatch in the attention kernel")
    except ValueError as exc:
        assert not lost_tp_peer(exc)
