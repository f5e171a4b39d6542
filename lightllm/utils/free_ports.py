"""Ports for listeners that start a little later, picked where no other socket is handed them.

A launcher (a test, a benchmark tool, the server's default ``--nccl_port``) picks a port and a
server binds it seconds later, often in another process still importing torch.  A port from the
kernel's ephemeral range (what ``bind(0)`` returns) can be taken in between by any outgoing
connection or ``bind(0)`` on the machine, such as the gloo and NCCL rendezvous of servers starting
beside it, and the listener fails with "Address already in use".  So ports are drawn from outside
that range when there is room, checked bindable, and never handed out twice by one process.
"""

from __future__ import annotations

import errno
import random
import socket
import threading
from typing import Optional, Set, Tuple

from lightllm.utils.host_names import bare_host

# Where the kernel takes the ports of outgoing connections and of bind(0) from (Linux).
EPHEMERAL_RANGE_PATH = "/proc/sys/net/ipv4/ip_local_port_range"
# Ports below this are left to well-known and registered services.
LOWEST_PICKED_PORT = 10000
# Ports this process has handed out: each goes to one caller, even before the caller binds it.
_handed_out_ports: Set[int] = set()
_port_picker = random.SystemRandom()
# The launchers pick ports from several threads at once (a PD cluster's nodes start in parallel).
_pick_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago, for a listener started a little later.

    Drawn from outside the kernel's ephemeral range when there is room (the module docstring says
    why), else the kernel's choice; never one this process handed out before, from any thread.
    ``host`` may be an IPv4 or IPv6 address or a name.  Raises ``OSError`` when ``host`` does not
    resolve or is not an address of this machine.
    """
    family = address_family(host)
    candidates = ports_outside_ephemeral_range(read_ephemeral_range())
    with _pick_lock:
        for _ in range(min(len(candidates), 256)):
            port = _port_picker.choice(candidates)
            if port not in _handed_out_ports and can_bind(host, port, family):
                _handed_out_ports.add(port)
                return port
        while True:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind(_sockaddr(host, 0, family))
                port = sock.getsockname()[1]
            if port not in _handed_out_ports:
                _handed_out_ports.add(port)
                return port


def address_family(host: str) -> int:
    """``AF_INET`` or ``AF_INET6``: the family of ``host``'s first address (``OSError`` if it does not resolve)."""
    return socket.getaddrinfo(bare_host(host), None, type=socket.SOCK_STREAM)[0][0]


def _sockaddr(host: str, port: int, family: Optional[int] = None) -> tuple:
    """``host``:``port`` as ``bind`` takes it on a socket of ``family``, resolved by getaddrinfo.

    A (host, port) pair loses an IPv6 zone: ``bind(("fe80::1%eth0", port))`` fails with EINVAL,
    while getaddrinfo's sockaddr carries the zone as its scope id.  Resolved in ``family`` (any
    when None), so a host of the other family raises ``socket.gaierror`` (an ``OSError``) rather
    than handing an IPv6 sockaddr to an IPv4 socket, whose ``bind`` raises ``TypeError``.
    """
    return socket.getaddrinfo(bare_host(host), port, family or 0, socket.SOCK_STREAM)[0][4]


def read_ephemeral_range(path: str = EPHEMERAL_RANGE_PATH) -> Optional[Tuple[int, int]]:
    """The kernel's ephemeral port range (first, last), or None where it cannot be read."""
    try:
        with open(path, encoding="ascii") as handle:
            first, last = (int(field) for field in handle.read().split())
    except (OSError, ValueError):
        return None
    return first, last


def ports_outside_ephemeral_range(ephemeral: Optional[Tuple[int, int]]) -> range:
    """The larger of the port ranges at or above LOWEST_PICKED_PORT that ``ephemeral`` leaves free."""
    if ephemeral is None:
        return range(0)
    first, last = ephemeral
    below = range(LOWEST_PICKED_PORT, max(LOWEST_PICKED_PORT, first))
    above = range(max(LOWEST_PICKED_PORT, last + 1), 65536)
    return below if len(below) >= len(above) else above


def can_bind(host: str, port: int, family: Optional[int] = None) -> bool:
    """Whether a listener could bind ``host``:``port`` now; errors other than "taken" propagate."""
    with socket.socket(family or address_family(host), socket.SOCK_STREAM) as sock:
        try:
            sock.bind(_sockaddr(host, port, family))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True
