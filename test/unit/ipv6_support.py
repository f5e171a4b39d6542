"""Whether this machine has an IPv6 loopback, for tests of IPv6 addresses on real sockets.

CI machines and containers may run without IPv6; those tests skip there instead of failing.
"""

from __future__ import annotations

import socket

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
