"""The spellings of "every interface" a ``--host`` flag takes, named once.

Three places need them: a listener binds a wildcard as ``bind()`` spells it, a process on the same
machine reaches a wildcard-bound server through loopback, and a PD node that listens everywhere
must advertise a routable address instead.
"""

from __future__ import annotations

from typing import Tuple

# "" is uvicorn's and argparse's empty host; "[::]" is the URL spelling of IPv6's wildcard.
WILDCARD_HOSTS: Tuple[str, ...] = ("", "0.0.0.0", "::", "[::]")


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means every interface."""
    return host in WILDCARD_HOSTS


def bind_host(host: str) -> str:
    """``host`` as ``socket.bind`` takes it (a wildcard in its address form)."""
    return {"": "0.0.0.0", "[::]": "::"}.get(host, host)


def loopback_for(host: str) -> str:
    """The address a client on this machine uses to reach a server bound to ``host``."""
    if not is_wildcard(host):
        return host
    return "::1" if ":" in host else "127.0.0.1"
