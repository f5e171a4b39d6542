"""Several transfer pairs on one prefill rank's port, and announce-then-receive, with real processes over gloo.

A prefill rank serves one TCP store on its listening socket (as a node holds it from start-up);
each pair (epoch) has its own transfer process per side and its own two-rank group, joined under
its own key prefix.  Two decode peers must get byte-exact KV from interleaved requests, closing
one pair must leave the other working, an idle decode side must hold no pending receive (it
receives only what the prefill side announced in the store), and a prefill node whose store goes
away must break its decode peers' pairs.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

import pytest
import torch

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.pd.kv_transfer import KVTransferHandle, TransferStats, TransferStoreHost
from lightllm.server.pd.node.transfer_ports import TransferPortBlock

from pd_kv_transfer_support import collect, wait_ready

LAYERS, HEADS, HEAD_DIM, SIZE, PAGE = 2, 2, 8, 400, 16
TIMEOUT_S = 10.0


def _cache() -> KVCacheMemoryManager:
    return KVCacheMemoryManager(SIZE, LAYERS, HEADS, HEAD_DIM, torch.float32, shareable=True)


def _filled(seed: int) -> KVCacheMemoryManager:
    cache = _cache()
    gen = torch.Generator().manual_seed(seed)
    cache.k_buffer.copy_(torch.randn(cache.k_buffer.shape, generator=gen))
    cache.v_buffer.copy_(torch.randn(cache.v_buffer.shape, generator=gen))
    return cache


class PrefillRank:
    """A prefill rank's transfer side: its held port, its one store, its KV cache."""

    def __init__(self, seed: int = 0):
        self.ports = TransferPortBlock.reserve("127.0.0.1", 1)  # held like a node holds it from start-up
        self.host = TransferStoreHost(self.ports.socket_for(0), timeout_s=30.0)
        self.cache = _filled(seed)

    def handle(self, group_name: str, **kwargs) -> KVTransferHandle:
        return KVTransferHandle("prefill", self.cache, self.host.connect_host, self.host.port, page_size=PAGE,
                                timeout_s=TIMEOUT_S, group_name=group_name, store_host=self.host, **kwargs)

    def peer(self, cache: KVCacheMemoryManager, group_name: str, **kwargs) -> KVTransferHandle:
        """A decode rank's handle joining this rank's port."""
        return KVTransferHandle("decode", cache, "127.0.0.1", self.host.port, timeout_s=TIMEOUT_S,
                                group_name=group_name, **kwargs)

    def close(self) -> None:
        self.host.close()
        self.ports.close()


def _stats_until(handle: KVTransferHandle, done: Callable[[TransferStats], bool], timeout_s: float = 30.0
                 ) -> TransferStats:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = handle.query_stats()
        assert stats is not None, f"{handle.role} transfer process gave no stats: {handle.broken_reason}"
        if done(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_one_prefill_rank_serves_two_decode_peers_on_one_port() -> None:
    rank = PrefillRank(seed=1)
    targets = {1: _cache(), 2: _cache()}
    senders = {e: rank.handle(f"pairs/epoch-{e}/rank-0") for e in targets}
    receivers = {e: rank.peer(targets[e], f"pairs/epoch-{e}/rank-0") for e in targets}
    try:
        wait_ready(*senders.values(), *receivers.values())
        # One port, one store, but one transfer process (and group) per pair and side.
        assert {h.store_port for h in (*senders.values(), *receivers.values())} == {rank.host.port}
        assert len({h.pid for h in (*senders.values(), *receivers.values())}) == 4
        gen = torch.Generator().manual_seed(5)
        src_perm = torch.randperm(SIZE, generator=gen)
        dst_perms = {e: torch.randperm(SIZE, generator=gen) for e in targets}
        moves = {}  # request id -> (epoch, src, dst)
        offset = 0
        for request_id, tokens in enumerate([3, PAGE, 2 * PAGE + 1, 40, 1, 57]):
            epoch = 1 + request_id % 2  # interleaved between the two peers
            src, dst = src_perm[offset : offset + tokens], dst_perms[epoch][offset : offset + tokens]
            moves[request_id] = (epoch, src, dst)
            offset += tokens
        for request_id, (epoch, _, dst) in moves.items():
            receivers[epoch].receive(request_id, dst)
        for request_id, (epoch, src, _) in moves.items():
            senders[epoch].send(request_id, src, first_token=100 + request_id)
        for epoch in targets:
            count = sum(1 for e, _, _ in moves.values() if e == epoch)
            sent, received = collect(senders[epoch], count), collect(receivers[epoch], count)
            for request_id, (e, src, dst) in moves.items():
                if e != epoch:
                    assert request_id not in received
                    continue
                assert sent[request_id].ok and received[request_id].ok, (sent[request_id], received[request_id])
                assert received[request_id].first_token == 100 + request_id
                assert torch.equal(targets[epoch].export_slots(dst), rank.cache.export_slots(src))
        # Each decode peer received only its own pair's announcements.
        for epoch in targets:
            stats = receivers[epoch].query_stats()
            assert stats.announcements == 3 and stats.receives_pending == 0
            assert senders[epoch].query_stats().announcements == 3
    finally:
        for handle in (*senders.values(), *receivers.values()):
            handle.close()
        rank.close()


def test_closing_one_pair_leaves_the_other_working() -> None:
    rank = PrefillRank(seed=2)
    targets = {1: _cache(), 2: _cache()}
    senders = {e: rank.handle(f"close/epoch-{e}/rank-0") for e in targets}
    receivers = {e: rank.peer(targets[e], f"close/epoch-{e}/rank-0") for e in targets}
    try:
        wait_ready(*senders.values(), *receivers.values())
        receivers[1].receive(10, torch.arange(20))  # waits on the pair about to go
        senders[1].close()  # the prefill side of epoch 1 torn down
        lost = collect(receivers[1], 1)[10]
        assert not lost.ok and "the prefill side closed the pair" in lost.reason
        assert "closed the pair" in receivers[1].broken_reason
        # The other pair on the same port and store is untouched.
        assert receivers[2].broken_reason is None and senders[2].broken_reason is None
        receivers[2].receive(11, torch.arange(100, 130))
        senders[2].send(11, torch.arange(30))
        assert collect(senders[2], 1)[11].ok and collect(receivers[2], 1)[11].ok
        assert torch.equal(targets[2].export_slots(torch.arange(100, 130)), rank.cache.export_slots(torch.arange(30)))
        # A decode side torn down: the prefill side's next send on that pair fails, the other pair still works.
        receivers[2].close()
        senders[2].send(12, torch.arange(5))
        failed = collect(senders[2], 1)[12]
        assert not failed.ok
        # A fresh pair (a new epoch) on the same store works next to the old ones.
        sender3, receiver3 = rank.handle("close/epoch-3/rank-0"), rank.peer(targets[1], "close/epoch-3/rank-0")
        senders[3], receivers[3] = sender3, receiver3
        wait_ready(sender3, receiver3)
        receiver3.receive(13, torch.arange(200, 210))
        sender3.send(13, torch.arange(50, 60))
        assert collect(sender3, 1)[13].ok and collect(receiver3, 1)[13].ok
        assert torch.equal(targets[1].export_slots(torch.arange(200, 210)),
                           rank.cache.export_slots(torch.arange(50, 60)))
    finally:
        for handle in (*senders.values(), *receivers.values()):
            handle.close()
        rank.close()


def test_an_idle_decode_side_posts_no_receive_until_a_transfer_is_announced() -> None:
    rank = PrefillRank(seed=3)
    target = _cache()
    sender = rank.handle("idle/epoch-1/rank-0")
    receiver = rank.peer(target, "idle/epoch-1/rank-0", announce_wait_s=0.2)
    try:
        wait_ready(sender, receiver)
        # Several bounded store waits ended empty: the decode side is idle, waiting on the store.
        idle = _stats_until(receiver, lambda s: s.idle_waits >= 3)
        assert idle.idle_waits >= 3, idle
        assert (idle.receives_posted, idle.receives_pending, idle.announcements) == (0, 0, 0)
        # A reservation alone posts nothing either: only an announcement does.
        receiver.receive(1, torch.arange(40))
        reserved = _stats_until(receiver, lambda s: s.idle_waits >= idle.idle_waits + 2)
        assert (reserved.receives_posted, reserved.receives_pending, reserved.announcements) == (0, 0, 0)
        sender.send(1, torch.arange(100, 140))
        assert collect(sender, 1)[1].ok and collect(receiver, 1)[1].ok
        after = receiver.query_stats()
        # Three pages of KV were received, then nothing stays posted.
        assert after.announcements == 1 and after.receives_posted == 3 and after.receives_pending == 0, after
        sent = sender.query_stats()
        assert sent.announcements == 1 and sent.receives_posted == 2 and sent.receives_pending == 0  # verdict, ack
        again = _stats_until(receiver, lambda s: s.idle_waits >= after.idle_waits + 2)
        assert (again.receives_posted, again.receives_pending) == (3, 0)
    finally:
        sender.close()
        receiver.close()
        rank.close()


def test_a_prefill_node_whose_store_goes_away_breaks_its_decode_peers() -> None:
    rank = PrefillRank(seed=4)
    target = _cache()
    sender = rank.handle("gone/epoch-1/rank-0")
    receiver = rank.peer(target, "gone/epoch-1/rank-0")
    try:
        wait_ready(sender, receiver)
        receiver.receive(1, torch.arange(10))
        # The prefill node dies: its transfer process without a word, then the rank's store.
        os.kill(sender.pid, signal.SIGKILL)
        rank.host.close()
        lost = collect(receiver, 1)[1]
        assert not lost.ok and "the prefill node's store failed" in lost.reason, lost
        assert "store failed" in receiver.broken_reason
    finally:
        sender.close()
        receiver.close()
        rank.close()


def test_a_handle_refuses_a_store_host_on_the_decode_side_or_another_port() -> None:
    rank = PrefillRank()
    try:
        with pytest.raises(ValueError, match="only a prefill KV transfer handle uses the rank's store host"):
            KVTransferHandle("decode", _cache(), "127.0.0.1", rank.host.port, store_host=rank.host)
        with pytest.raises(ValueError, match=f"the rank's transfer store is on port {rank.host.port}, not 1"):
            KVTransferHandle("prefill", rank.cache, "127.0.0.1", 1, store_host=rank.host)
    finally:
        rank.close()
