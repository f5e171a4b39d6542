"""A prefill node's KV transfer ports: held from start-up, each served by its rank's one transfer store.

Real sockets and real transfer processes (gloo over loopback); the handles are the ones the
ranks use.
"""

from __future__ import annotations

import socket

import pytest
import torch

from ipv6_support import needs_ipv6_loopback
from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.argument_error import ArgumentError
from lightllm.server.pd.kv_transfer import KVTransferHandle, TransferStoreHost
from lightllm.server.pd.node import transfer_ports
from lightllm.server.pd.node.transfer_ports import TransferPortBlock

from pd_kv_transfer_support import collect, wait_ready

LAYERS, HEADS, HEAD_DIM, SIZE = 2, 2, 4, 64


def _cache() -> KVCacheMemoryManager:
    return KVCacheMemoryManager(SIZE, LAYERS, HEADS, HEAD_DIM, torch.float32, shareable=True)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_block_listens_on_consecutive_ports_until_closed() -> None:
    block = TransferPortBlock.reserve("127.0.0.1", 3)
    base = block.base
    assert [block.socket_for(rank).getsockname()[1] for rank in range(3)] == [base, base + 1, base + 2]
    assert not any(_bindable(port) for port in range(base, base + 3))
    for rank in range(3):  # listening, so a peer's connection is accepted (queued) at once
        with socket.create_connection(("127.0.0.1", base + rank), timeout=5):
            pass
    block.close()
    # Released: a node restarting on these ports listens on them again.  (A plain bind without
    # SO_REUSEADDR can still fail for a moment on a TIME_WAIT left by the connections above,
    # which the node's own sockets are made to ignore.)
    again = TransferPortBlock.reserve("127.0.0.1", 3, base)
    assert [sock.getsockname()[1] for sock in (again.socket_for(rank) for rank in range(3))] == [base, base + 1, base + 2]
    again.close()


def test_a_taken_port_is_named() -> None:
    held = TransferPortBlock.reserve("127.0.0.1", 1)
    try:
        with pytest.raises(ArgumentError, match=rf"--pd_transfer_port {held.base - 1}: cannot listen on "
                                                rf"127.0.0.1:{held.base - 1}..{held.base} \(TP rank r uses port \+ r\): .*in use"):
            TransferPortBlock.reserve("127.0.0.1", 2, held.base - 1)
        with pytest.raises(ArgumentError, match=rf"--pd_transfer_port {held.base}: cannot listen on 127.0.0.1:{held.base}: "):
            TransferPortBlock.reserve("127.0.0.1", 1, held.base)
    finally:
        held.close()


@pytest.mark.parametrize("given", ["http", "rendezvous"])
def test_a_free_block_never_contains_the_http_or_rendezvous_port(monkeypatch, given: str) -> None:
    # The kernel's first free port is made to be the avoided port itself (free: it was just ours);
    # a block starting there is let go and the next one taken.
    http_port = TransferPortBlock.reserve("127.0.0.1", 1)
    http_port.close()
    real_listen, offered = transfer_ports._listen, []

    def first_offer_overlaps(host: str, port: int) -> socket.socket:
        if port == 0 and not offered:
            offered.append(real_listen(host, http_port.base))
            return offered[0]
        return real_listen(host, port)

    monkeypatch.setattr(transfer_ports, "_listen", first_offer_overlaps)
    avoid = (http_port.base, None) if given == "http" else (None, http_port.base)
    block = TransferPortBlock.reserve("127.0.0.1", 2, avoid=avoid)
    assert offered and offered[0].fileno() == -1  # the overlapping offer was closed
    assert http_port.base not in (block.base, block.base + 1)
    block.close()


def _move(prefill: KVTransferHandle, decode: KVTransferHandle, request_id: int, source, target) -> None:
    decode.receive(request_id, torch.arange(10, 20))
    prefill.send(request_id, torch.arange(0, 10))
    sent, received = collect(prefill, 1)[request_id], collect(decode, 1)[request_id]
    assert sent.ok and received.ok, (sent, received)
    assert torch.equal(target.export_slots(torch.arange(10, 20)), source.export_slots(torch.arange(0, 10)))


def test_the_ranks_store_serves_the_held_port_for_every_pair_and_only_its_own_group_meets_it() -> None:
    source, target = _cache(), _cache()
    source.k_buffer.copy_(torch.randn(source.k_buffer.shape))
    source.v_buffer.copy_(torch.randn(source.v_buffer.shape))
    block = TransferPortBlock.reserve("127.0.0.1", 1)
    port = block.base
    store = TransferStoreHost(block.socket_for(0))  # the rank's one store, on the held socket
    kwargs = dict(page_size=4, timeout_s=10.0)
    try:
        assert store.port == port
        for epoch in (1, 2):  # a new setup: both processes replaced, the port and the store held throughout
            group = f"lightllm-kv/epoch-{epoch}/rank-0"
            prefill = KVTransferHandle("prefill", source, "127.0.0.1", port, group_name=group, store_host=store,
                                       **kwargs)
            decode = KVTransferHandle("decode", target, "127.0.0.1", port, group_name=group, **kwargs)
            wait_ready(prefill, decode)
            target.k_buffer.zero_()
            _move(prefill, decode, 100 + epoch, source, target)
            prefill.close()
            decode.close()
            assert not _bindable(port)
        # A decode side of another epoch (or pointed at some other group's keys) never joins:
        # both sides give up within the connect bound instead of pairing.
        prefill = KVTransferHandle("prefill", source, "127.0.0.1", port, group_name="lightllm-kv/epoch-3/rank-0",
                                   store_host=store, connect_timeout_s=3.0, **kwargs)
        stale = KVTransferHandle("decode", target, "127.0.0.1", port, group_name="lightllm-kv/epoch-2/rank-0",
                                 connect_timeout_s=3.0, **kwargs)
        for handle in (prefill, stale):
            assert not handle.wait_ready(60)
            assert "could not join the transfer group" in handle.broken_reason, handle.broken_reason
        prefill.close()
        stale.close()
    finally:
        store.close()
        block.close()


def test_the_store_serves_a_copy_of_the_held_socket_so_the_port_outlives_it() -> None:
    block = TransferPortBlock.reserve("127.0.0.1", 1)
    try:
        store = TransferStoreHost(block.socket_for(0))
        store.close()
        assert not _bindable(block.base)  # the node's own socket still holds the port
        again = TransferStoreHost(block.socket_for(0))  # and serves a store again
        prefill = KVTransferHandle("prefill", _cache(), "127.0.0.1", block.base, group_name="again",
                                   store_host=again)
        decode = KVTransferHandle("decode", _cache(), "127.0.0.1", block.base, group_name="again")
        wait_ready(prefill, decode)
        prefill.close()
        decode.close()
        again.close()
        with pytest.raises(ValueError, match="only a prefill KV transfer handle uses the rank's store host"):
            KVTransferHandle("decode", _cache(), "127.0.0.1", block.base, store_host=again)
    finally:
        block.close()



@needs_ipv6_loopback
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_host_bare_or_bracketed_listens_and_a_taken_port_is_named_bracketed(host: str) -> None:
    """A prefill node with --host [::1] exited 3: the bracketed host went to getaddrinfo as a name."""
    block = TransferPortBlock.reserve(host, 1)
    try:
        assert block.socket_for(0).family == socket.AF_INET6
        with socket.create_connection(("::1", block.base), timeout=5):
            pass
        with pytest.raises(ArgumentError, match=rf"cannot listen on \[::1\]:{block.base}: "):
            TransferPortBlock.reserve(host, 1, block.base)
    finally:
        block.close()


@needs_ipv6_loopback
@pytest.mark.parametrize("host", ["::", "::0"])
def test_an_ipv6_wildcard_transfer_port_takes_ipv4_too(host: str, monkeypatch) -> None:
    """advertised_host tells an IPv4 master an IPv4 address for --host ::, but the transfer socket
    left IPV6_V6ONLY to the kernel: with net.ipv6.bindv6only=1 it took IPv6 connections only."""
    set_before_bind = []

    class Recording(socket.socket):
        # This machine's default may already be 0: what matters is that _listen sets it itself.
        def setsockopt(self, level, option, value, *rest):
            set_before_bind.append((level, option, value))
            return super().setsockopt(level, option, value, *rest)

    monkeypatch.setattr(socket, "socket", Recording)
    with transfer_ports._listen(host, 0) as sock:
        assert (socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0) in set_before_bind
        assert sock.family == socket.AF_INET6
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
        with socket.create_connection(("127.0.0.1", sock.getsockname()[1]), timeout=5):
            pass


@needs_ipv6_loopback
def test_a_specific_ipv6_transfer_port_is_left_as_the_kernel_sets_it() -> None:
    with transfer_ports._listen("::1", 0) as sock:
        assert sock.family == socket.AF_INET6
