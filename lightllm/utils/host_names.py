"""Host names as flags give them and as URLs need them, and the one rule for which hosts are taken.

``--pd_master_ip`` and ``--nccl_host`` may be an IPv4 or IPv6 address (with or without the
brackets a URL puts around IPv6, and with a zone such as ``%eth0``) or a DNS host name; they are
checked at start-up, since a node otherwise registers with a URL it cannot build and says nothing
until it stops.  The PD contract's ``host:port`` (:mod:`lightllm.server.pd.protocol.host_port`)
reads its host part with the same :func:`host_problem`, less the zone (and it adds that an IPv6
host there must be bracketed, and refuses IPv6 link-local addresses): an address a node
advertises is dialled from other machines, where its zone names no interface (and a link-local
address without its zone cannot be dialled at all), while ``--pd_master_ip`` is dialled by the
node itself and ``--nccl_host`` is an address of this machine, so a zone there means what it says.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Optional

# A DNS host name: dot-separated labels of letters, digits and inner hyphens (RFC 1123).
_HOST_NAME = re.compile(r"^(?=.{1,253}$)(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?$")

# A host (bracketed IPv6, or anything without a colon) followed by ":port".
_WITH_PORT = re.compile(r"(\[[^\[\]]*\]|[^:\[\]]+):[0-9]{1,5}")

# The zone of a scoped IPv6 address: an interface name (eth0, enp3s0.100) or index.
_ZONE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def bare_host(host: str) -> str:
    """``host`` without the URL brackets an IPv6 address may be given in (``[::1]`` -> ``::1``)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_problem(host: str, allow_zone: bool = False) -> Optional[str]:
    """Why ``host`` is not a host this project takes (None when it is one).

    Taken: an IPv4 address, an IPv6 address (bare, or in URL brackets), a DNS host name; an IPv6
    address with a zone (``fe80::1%eth0``) only with ``allow_zone``, for a host this machine
    dials or listens on itself (``--pd_master_ip``, ``--nccl_host``), never for one it tells
    another machine; for the same reason, without ``allow_zone`` an IPv6 link-local address
    (``fe80::/10``) is refused even without a zone.  Refused: anything but an IPv6 address in
    brackets, unbalanced brackets, a zone in its URL escaping (``%25eth0``), and anything else
    that is neither an address nor a host name.
    """
    with_port = _WITH_PORT.fullmatch(host)
    if with_port is not None and host_problem(with_port.group(1), allow_zone) is None:
        # "[::1]:80" read as "unbalanced brackets", "localhost:80" as no host name at all.
        return "a host with a port: give the host alone (the port has its own flag)"
    bracketed = len(host) >= 2 and host.startswith("[") and host.endswith("]")
    if not bracketed and ("[" in host or "]" in host):
        return "unbalanced brackets"
    text = host[1:-1] if bracketed else host
    if "%" in text and _is_ipv6(text.partition("%")[0]):
        zone = text.partition("%")[2]
        # "fe80::1%25eth0" is how a URL writes zone eth0 (RFC 6874): taken as written, the zone is
        # "25eth0", an interface no machine has, and the failure came only at the first connect.
        # An all-digit zone is an interface index ("%25" may be index 25).  Said wherever a host
        # is read, a zone taken there or not: where none is, the zone reason alone hid the slip.
        url_escaped = zone.startswith("25") and not zone.isdigit()
        if not allow_zone:
            # Python's ipaddress (and httpx) take "fe80::1%eth0", but the zone names an interface
            # of one machine: another machine given this address has no such interface to use.
            reason = ("the zone names a network interface of one machine, so the address means nothing on another; "
                      "give a global or unique-local address")
            if url_escaped:
                return (f"an IPv6 zone starting %25 (%25 is its URL escaping: a host writes zone {zone[2:]} as "
                        f"%{zone[2:]}), and no address with a zone is taken here: {reason}")
            return f"an IPv6 address with a zone (%...): {reason}"
        if not _ZONE.fullmatch(zone):
            # ipaddress takes any text after "%"; a zone is an interface name or index.
            return "an IPv6 zone (after %) must be an interface name or index (letters, digits, '.', '_', '-')"
        if url_escaped:
            return "an IPv6 zone starting %25 (write the zone as %eth0 on the command line; %25 is its URL escaping)"
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        address = None
    if not allow_zone and isinstance(address, ipaddress.IPv6Address) and address.is_link_local:
        # Unique on one link only: a peer dials it through the interface its zone names, and an
        # advertised address carries no zone (the check above), so connect fails with EINVAL.
        # (A --host :: node reaching a link-local master learns such an address from its route.)
        return "a link-local address cannot be dialled from another machine; give a global or unique-local address"
    if bracketed:
        return None if address is not None and address.version == 6 else "only an IPv6 address goes in brackets"
    if address is not None:
        return None
    if not _HOST_NAME.fullmatch(host):
        return "not an IP address or a host name (letters, digits, '-' and '.', at most 253 characters)"
    if host.rstrip(".").rpartition(".")[2].isdigit():
        # "10.0.0.256" or "1234": meant as an IPv4 address and not a valid one (no top-level
        # domain is all digits, RFC 3696 2), and "1234" would even resolve, as 0.0.4.210.
        return "not an IPv4 address (four numbers of 0-255), and no host name (its last label is not all digits)"
    return None


def _is_ipv6(text: str) -> bool:
    """Whether ``text`` is an IPv6 address (without a zone)."""
    try:
        ipaddress.IPv6Address(text)
        return True
    except ValueError:
        return False


def url_host(host: str) -> str:
    """``host`` (bare) as the host part of a URL: an IPv6 address in brackets (``http://[::1]:8000``)."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host
