"""free_port: ports for listeners started later, drawn where no other socket is handed them.

Four PD nodes started at once failed in CI with "Address already in use": the port picked for
the fourth had been handed by the kernel to another starting node's connection (ephemeral range)
before the fourth node bound it.
"""

from __future__ import annotations

import socket

import pytest
from ipv6_support import link_local_address, needs_link_local

from lightllm.utils import free_ports
from lightllm.utils.free_ports import LOWEST_PICKED_PORT, free_port, ports_outside_ephemeral_range, read_ephemeral_range


def test_ports_come_from_outside_the_kernels_ephemeral_range():
    ephemeral = read_ephemeral_range()
    if ephemeral is None:
        pytest.skip("this kernel does not publish its ephemeral port range")
    first, last = ephemeral
    for _ in range(50):
        port = free_port()
        assert not first <= port <= last
        assert port >= LOWEST_PICKED_PORT


def test_a_port_is_handed_out_once_per_process_even_before_it_is_bound():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


def test_a_port_taken_by_a_listener_is_not_handed_out(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        # Only the taken port and one other are candidates.
        monkeypatch.setattr(free_ports, "ports_outside_ephemeral_range",
                            lambda _ephemeral: range(taken, taken + 2) if taken < 65535 else range(taken - 1, taken + 1))
        monkeypatch.setattr(free_ports, "_handed_out_ports", set())
        for _ in range(20):
            assert free_port() != taken


def test_without_room_outside_the_range_it_falls_back_to_the_kernels_choice(monkeypatch):
    monkeypatch.setattr(free_ports, "read_ephemeral_range", lambda: (1024, 65535))
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.parametrize("ephemeral, expected", [
    ((32768, 60999), range(LOWEST_PICKED_PORT, 32768)),
    ((1024, 20000), range(20001, 65536)),
    ((1024, 65535), range(LOWEST_PICKED_PORT, LOWEST_PICKED_PORT)),
    (None, range(0)),
])
def test_the_candidates_are_the_larger_side_of_the_range(ephemeral, expected):
    assert ports_outside_ephemeral_range(ephemeral) == expected


def test_an_address_of_no_interface_here_is_an_error_not_a_port():
    with pytest.raises(OSError):
        free_port("192.0.2.1")  # TEST-NET-1: documentation only, never local


def test_an_ipv6_host_gets_a_port_it_can_bind():
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
        port = free_port("::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        sock.bind(("::1", port))


def test_threads_picking_at_once_never_get_the_same_port(monkeypatch):
    import threading

    # Few candidates, so that threads racing on one port would show.
    monkeypatch.setattr(free_ports, "ports_outside_ephemeral_range", lambda _ephemeral: range(20000, 20040))
    monkeypatch.setattr(free_ports, "_handed_out_ports", set())
    picked: list[int] = []
    barrier = threading.Barrier(8)

    def pick() -> None:
        barrier.wait()
        for _ in range(4):
            picked.append(free_port())

    threads = [threading.Thread(target=pick) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(picked) == 32 and len(set(picked)) == 32


@needs_link_local
def test_a_link_local_host_with_its_zone_gets_a_port():
    """A zoned --nccl_host with no --nccl_port ended start-up with a traceback: bind(("fe80::1%eth0",
    port)) drops the zone and fails with EINVAL; getaddrinfo's sockaddr carries it as the scope id."""
    host = link_local_address()
    for spelling in (host, f"[{host}]"):
        port = free_port(spelling)
        assert free_ports.can_bind(spelling, port)


def test_a_host_of_another_family_than_asked_is_an_oserror():
    """can_bind("::1", port, AF_INET) handed the IPv6 sockaddr to an IPv4 socket, whose bind raised
    TypeError, which no caller (they catch OSError) expected."""
    with pytest.raises(OSError):
        free_ports.can_bind("::1", 0, socket.AF_INET)
