"""A prefill node's KV transfer ports, bound at start-up and held until the node exits.

TP rank r's transfer group meets at ``--pd_transfer_port`` + r, which the node advertises to
the master when it registers; the group itself is created only at the first transfer setup, and
again after every replacement.  A port that is merely checked free at start-up can be taken in
between: a free port from the kernel is odd, the next one even, and Linux hands even ports to
outgoing connections, so with TP > 1 any connection on the host (or one in TIME_WAIT) could take
rank 1's port and break every setup of the node.  So the node binds and listens on the whole
block before any process starts; each rank serves its one transfer store, which all of its pairs
join, on a copy of the listening socket it inherits (``TCPStore(master_listen_fd=...)``, see
pd/kv_transfer/store_host.py), so no one else can take it.
"""

from __future__ import annotations

import socket
from typing import Iterable, List, Optional

from lightllm.server.argument_error import ArgumentError
from lightllm.server.http.transport.listen_sockets import PortUnavailableError
from lightllm.utils.host_names import bare_host, url_host
from lightllm.utils.wildcard_hosts import bind_host, is_wildcard

_PORT_BLOCK_TRIES = 64
_LISTEN_BACKLOG = 64


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (``OSError`` when the port is taken)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # A node restarted on its port must not wait out the old one's TIME_WAIT connections.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and is_wildcard(host):
            # "::" is advertised as listening on both families (pd_node.advertised_host may hand an
            # IPv4 master an IPv4 transfer address); with net.ipv6.bindv6only=1 it would be IPv6 only.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(_LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def _listen_range(host: str, base: int, count: int) -> List[socket.socket]:
    """Listening sockets on ``base`` .. ``base + count - 1``, all or none."""
    sockets: List[socket.socket] = []
    try:
        for offset in range(count):
            sockets.append(_listen(host, base + offset))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class TransferPortBlock:
    """``count`` consecutive listening sockets; rank r's is :meth:`socket_for` (r)."""

    def __init__(self, sockets: List[socket.socket]):
        self._sockets = sockets
        self.base = sockets[0].getsockname()[1]  # TP rank 0's port

    @classmethod
    def reserve(cls, host: str, count: int, base: Optional[int] = None, avoid: Iterable[Optional[int]] = ()
                ) -> "TransferPortBlock":
        """Bind ``base`` .. ``base + count - 1`` on ``host`` (a free block when ``base`` is None).

        A free block never contains a port of ``avoid`` (the HTTP port and the rendezvous port,
        not yet bound at this point; None entries are skipped).
        Raises ``PortUnavailableError`` (an ``ArgumentError``; exit code 3) naming the port when a given
        block is taken.
        """
        # getaddrinfo and bind take an IPv6 address bare: "[::1]" (a --host the servers accept) is
        # no name they resolve.
        host = bare_host(bind_host(host))
        shown = url_host(host)  # "[::1]:18615", not the ambiguous "::1:18615"
        avoided = [port for port in avoid if port is not None]
        if base is not None:
            try:
                return cls(_listen_range(host, base, count))
            except OSError as exc:
                ports = f"{base}" if count == 1 else f"{base}..{base + count - 1} (TP rank r uses port + r)"
                raise PortUnavailableError(f"--pd_transfer_port {base}: cannot listen on {shown}:{ports}: "
                                    f"{exc.strerror or exc}") from None
        for _ in range(_PORT_BLOCK_TRIES):
            try:
                first = _listen(host, 0)  # held while the rest of the block is tried
            except OSError as exc:
                raise ArgumentError(f"cannot listen on {shown} for the KV transfer: {exc.strerror or exc}") from None
            base = first.getsockname()[1]
            try:
                if base + count - 1 <= 65535 and not any(base <= port < base + count for port in avoided):
                    return cls([first, *_listen_range(host, base + 1, count - 1)])
            except OSError:
                pass
            first.close()
        raise ArgumentError(f"found no {count} consecutive free ports on {shown}; pass --pd_transfer_port")

    def socket_for(self, rank: int) -> socket.socket:
        """TP rank ``rank``'s listening socket."""
        return self._sockets[rank]

    def close(self) -> None:
        """Release every port of the block."""
        for sock in self._sockets:
            sock.close()
