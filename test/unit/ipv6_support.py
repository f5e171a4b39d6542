"""Whether this machine has an IPv6 loopback, for tests of IPv6 addresses on real sockets.

CI machines and containers may run without IPv6; those tests skip there instead of failing.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Optional

import pytest


def has_ipv6_loopback() -> bool:
    """True when a socket can bind ``::1`` here."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6_loopback = pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here")


def link_local_address() -> Optional[str]:
    """A link-local IPv6 address of this machine with its zone (``fe80::1%eth0``), or None.

    Read from Linux's /proc/net/if_inet6 (address, index, prefix, scope 0x20 = link, flags, name).
    """
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as table:
            rows = [line.split() for line in table]
    except OSError:
        return None
    for row in rows:
        if len(row) == 6 and row[3] == "20":
            return f"{ipaddress.IPv6Address(bytes.fromhex(row[0]))}%{row[5]}"
    return None


needs_link_local = pytest.mark.skipif(link_local_address() is None, reason="no link-local IPv6 address here")
