"""Host names as flags give them and as URLs need them.

``--pd_master_ip`` may be an IPv4 or IPv6 address (with or without the brackets a URL puts
around IPv6) or a DNS host name; it is checked at start-up, since a node otherwise registers
with a URL it cannot build and says nothing until it stops.  The PD contract's ``host:port``
(:mod:`lightllm.server.pd.protocol.host_port`) holds its hosts to the same rule, so it lives
here, below both.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Optional

# A DNS host name: dot-separated labels of letters, digits and inner hyphens (RFC 1123).
_HOST_NAME = re.compile(r"^(?=.{1,253}$)(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?$")


def bare_host(host: str) -> str:
    """``host`` without the URL brackets an IPv6 address may be given in (``[::1]`` -> ``::1``)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_problem(host: str) -> Optional[str]:
    """Why ``host`` is not an IP address or a DNS host name (None when it is one)."""
    text = bare_host(host)
    try:
        ipaddress.ip_address(text)
        return None
    except ValueError:
        pass
    if text != host:
        return "not an IPv6 address inside the brackets"
    if not _HOST_NAME.fullmatch(host):
        return "not an IP address or a host name (letters, digits, '-' and '.', at most 253 characters)"
    if host.rstrip(".").rpartition(".")[2].isdigit():
        # "10.0.0.256" or "1234": meant as an IPv4 address and not a valid one (no top-level
        # domain is all digits, RFC 3696 2), and "1234" would even resolve, as 0.0.4.210.
        return "not an IPv4 address (four numbers of 0-255), and no host name (its last label is not all digits)"
    return None


def url_host(host: str) -> str:
    """``host`` (bare) as the host part of a URL: an IPv6 address in brackets (``http://[::1]:8000``)."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host
