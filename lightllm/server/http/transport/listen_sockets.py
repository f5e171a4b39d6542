"""The HTTP listening sockets, bound before anything loads.

A server started on a port that is taken used to load the whole model first and then fail in
uvicorn; binding the port as the first step of start-up makes that a one-line error within a
second (:class:`PortUnavailableError`, which the launcher turns into exit code 3, its
``EXIT_PORT_UNAVAILABLE``). The sockets are then served by the front door
(:mod:`lightllm.server.http.transport.front_door`) for the server's whole life.
"""

from __future__ import annotations

import ipaddress
import errno
import socket
from typing import List

from lightllm.server.argument_error import ArgumentError

# Matches uvicorn's default: connections the kernel completes before the front door accepts them.
LISTEN_BACKLOG = 2048
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


class PortUnavailableError(ArgumentError):
    """A port the server must listen on cannot be bound; the message names host and port."""


def is_loopback(host: str) -> bool:
    """True when ``host`` is reachable only from this machine (127.0.0.0/8, ::1, localhost, or a
    name that resolves to loopback addresses only, such as a machine name mapped in /etc/hosts)."""
    name = host.strip().strip("[]").lower()
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return _is_loopback_address(name)
    except ValueError:
        pass
    if not name:
        return False  # every address
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(_is_loopback_address(info[4][0].split("%")[0]) for info in infos)


def _is_loopback_address(text: str) -> bool:
    """Whether the IP address ``text`` is a loopback one (``ValueError`` when it is no address).

    An IPv4-mapped IPv6 address (``::ffff:127.0.0.1``) is its IPv4 part: Python's ``is_loopback``
    is False for every one of them, which warned "beyond loopback" for a loopback listener.
    """
    address = ipaddress.ip_address(text)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def display_address(host: str, port: int) -> str:
    """``host:port`` with IPv6 addresses in brackets; ``*:port`` for an empty host (every address)."""
    if not host:
        return f"*:{port}"
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def bind_listeners(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> List[socket.socket]:
    """Non-blocking sockets listening on every address ``host`` resolves to, at ``port``.

    ``0.0.0.0``/``::``/empty listen everywhere (as uvicorn does): ``::`` on one dual-stack socket,
    which IPv4 clients reach too (an IPv6-only one refused the IPv4 probes of load balancers);
    empty on an IPv4 and an IPv6-only socket. Raises :class:`PortUnavailableError` (one line
    naming the address) when any of them cannot be bound; none stays bound then.
    """
    bind_host = host.strip("[]") or None
    where = display_address(host, port)
    try:
        infos = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortUnavailableError(f"--host {host!r}: cannot resolve it to an address to listen on: {exc}") from None
    # Only beside an IPv4 socket of its own must an IPv6 one leave IPv4 alone (both bind the port).
    v6_only = any(family == socket.AF_INET for family, *_ in infos)
    sockets: List[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            # A server restarted on its port must not wait out the old one's TIME_WAIT connections.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6_only))
            try:
                sock.bind(address)
            except OSError as exc:
                # A name (localhost) may resolve to an address the machine lacks (::1 without IPv6).
                resolved = "" if address[0] == bind_host else f", address {address[0]}"
                raise PortUnavailableError(
                    f"cannot listen on {where} (--host/--port{resolved}): {exc.strerror or exc}; "
                    f"{_bind_hint(exc, address)}") from None
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _bind_hint(exc: OSError, address: tuple) -> str:
    """What to check for a failed bind of ``address`` (a socket address): the cause differs with the error."""
    port = address[1]
    if exc.errno == errno.EADDRNOTAVAIL:
        return "--host must be an address of this machine (or 0.0.0.0 / :: for every interface)"
    if exc.errno == errno.EACCES and 0 < port < 1024:
        return "ports below 1024 need privileges; choose a higher --port"
    if exc.errno == errno.EACCES:
        return "this process may not listen there"
    if exc.errno == errno.EINVAL:
        # Not a taken port: the address cannot be listened on as written. "--host fe80::1" said
        # "is another server running on this port?".
        return link_local_zone_hint(address, "--host") or "--host is no address this machine can listen on as written"
    return "is another server running on this port?"


def link_local_zone_hint(address: tuple, flag: str) -> str:
    """For an IPv6 link-local socket ``address`` without a zone (which bind refuses with EINVAL), how
    to write it with one, naming the interfaces of this machine that have it; "" for any other address.

    A link-local address is unique on one link only, so the kernel needs the interface (the zone,
    ``fe80::1%eth0``) to listen on it.
    """
    if len(address) < 4 or address[3]:
        return ""
    try:
        if not ipaddress.IPv6Address(address[0]).is_link_local:
            return ""
    except ValueError:
        return ""
    host = address[0]
    try:
        interfaces = socket.if_nameindex()
    except OSError:
        interfaces = []
    zones = []
    for index, name in interfaces:
        try:
            with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
                probe.bind((host, 0, 0, index))
            zones.append(name)
        except OSError:
            continue
    if zones:
        return ("a link-local address is listened on through its interface, written as its zone: "
                + " or ".join(f"{flag} {host}%{zone}" for zone in zones))
    return (f"a link-local address needs its zone, the interface it is on (as {flag} {host}%eth0 for eth0), but no "
            f"interface of this machine has {host}")
