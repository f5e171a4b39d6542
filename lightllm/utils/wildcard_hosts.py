"""The spellings of "every interface" a ``--host`` flag takes, named once.

Three places need them: a listener binds a wildcard as ``bind()`` spells it, a process on the same
machine reaches a wildcard-bound server through loopback, and a PD node that listens everywhere
must advertise a routable address instead.
"""

from __future__ import annotations

import ipaddress

from lightllm.utils.host_names import bare_host


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means every interface: "" (uvicorn's and argparse's empty host) or an
    unspecified address in any spelling, bare or in URL brackets (0.0.0.0, ::, [::], ::0, 0:0:0:0:0:0:0:0).

    One rule, ipaddress's ``is_unspecified`` (as ``--nccl_host``'s check reads it): a list of
    spellings missed "::0" and "0::", which a PD node then advertised as its address.
    """
    if host == "":
        return True
    bare = bare_host(host)
    try:
        return ipaddress.ip_address(bare).is_unspecified
    except ValueError:
        return False


def bind_host(host: str) -> str:
    """``host`` as ``socket.bind`` takes it (a wildcard in its address form: 0.0.0.0 or ::)."""
    if not is_wildcard(host):
        return host
    return "::" if ":" in host else "0.0.0.0"


def loopback_for(host: str) -> str:
    """The address a client on this machine uses to reach a server bound to ``host``."""
    if not is_wildcard(host):
        return host
    return "::1" if ":" in host else "127.0.0.1"
