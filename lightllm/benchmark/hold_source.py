"""health_latency's ``--hold_source``: its default for the server's address family, and the checks
that it can open a connection at all, made while parsing instead of after a run that measured nothing.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
from typing import Optional

# The held connections' source against an IPv4 server: a second loopback address, so the server
# counts them as another client than the streams and the probe (from 127.0.0.1).
IPV4_HOLD_SOURCE = "127.0.0.2"


def _ip_version(host: str) -> Optional[int]:
    """4 or 6 for an IP address, None for a host name."""
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return None


def check_hold_source(parser: argparse.ArgumentParser, args: argparse.Namespace, server_host: str) -> None:
    """Fill in the default ``--hold_source`` for the server's address family, and refuse one it cannot use.

    A source of the other family than the server opens no connection at all: the run used to take
    its full duration and only then say that no held connection could be opened.
    """
    server_version = _ip_version(server_host)
    if args.hold_source is None:
        if server_version == 6:
            parser.error(f"--hold against an IPv6 server ({args.url}) needs --hold_source: IPv6 has no second loopback "
                         f"address like IPv4's {IPV4_HOLD_SOURCE}; give an IPv6 address of this machine (::1 is "
                         f"the streams' own)")
        args.hold_source = IPV4_HOLD_SOURCE
    source_version = _ip_version(args.hold_source)
    if server_version is not None and source_version is not None and server_version != source_version:
        parser.error(f"--hold_source {args.hold_source} is an IPv{source_version} address and the server "
                     f"({args.url or server_host}) an IPv{server_version} one: give an IPv{server_version} source")
    try:
        # The family of the source itself: socket.socket() is IPv4 and refused every IPv6 source.
        family = socket.getaddrinfo(args.hold_source, 0, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family) as sock:
            sock.bind((args.hold_source, 0))
    except (OSError, UnicodeError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        parser.error(f"--hold_source {args.hold_source!r}: no connection can be opened from there ({why})")
