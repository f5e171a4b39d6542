"""The torch.distributed rendezvous address (``--nccl_host``, ``--nccl_port``), checked before anything starts.

Rank 0 listens there and the other ranks connect, all on this machine. Unchecked, a host that
does not resolve ended the start with a traceback (``socket.gaierror`` while picking a free port)
and leaked shared memory, and with ``--tp 2`` the ranks retried the rendezvous for minutes; a taken
``--nccl_port`` surfaced only after the model processes started, as a rank's ``EADDRINUSE``.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import socket

from lightllm.server.argument_error import ArgumentError
from lightllm.server.http.transport.listen_sockets import PortUnavailableError, link_local_zone_hint
from lightllm.utils.host_names import bare_host, host_problem, url_host


def check_nccl_rendezvous(args: argparse.Namespace) -> None:
    """Refuse a ``--nccl_host`` this machine cannot listen on, or a ``--nccl_port`` that is taken.

    A malformed host is a flag error (:class:`ArgumentError`, exit 2); one that does not resolve,
    is not an address of this machine, or whose port is taken is :class:`PortUnavailableError`
    (exit 3), as for ``--host``. The port is bound and released at once: a port taken between
    this check and the rendezvous still fails there, but an operator's mistake is caught here.
    """
    host = args.nccl_host
    # An address of this machine, listened on and dialled here alone: a zone names its interface.
    problem = host_problem(host, allow_zone=True)
    if problem:
        raise ArgumentError(f"--nccl_host {host!r}: {problem}")
    if _is_unspecified(bare_host(host)):
        # torch's TCP store binds what it is given: a wildcard opens the rendezvous (which takes
        # no key) on every interface, where the ranks only ever connect on this machine.
        raise ArgumentError(f"--nccl_host {host!r} is a wildcard: the rendezvous store would listen on every "
                            "interface; give the address the ranks reach it on (e.g. 127.0.0.1 or ::1)")
    # With one rank there is no rendezvous: the port is never listened on, so it may be taken.
    port = (args.nccl_port or 0) if args.tp > 1 else 0
    try:
        infos = socket.getaddrinfo(bare_host(host), port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise PortUnavailableError(f"--nccl_host {host!r}: cannot resolve it to an address: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # As torch's TCP store binds: a port left in TIME_WAIT by an earlier server is usable.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if port and exc.errno in (errno.EADDRINUSE, errno.EACCES):
                raise PortUnavailableError(
                    f"cannot listen on {url_host(bare_host(host))}:{args.nccl_port} (--nccl_port): {exc.strerror or exc}; is another "
                    "server or torch.distributed job using it? Give another --nccl_port, or none for a free one"
                ) from None
            hint = link_local_zone_hint(address, "--nccl_host") if exc.errno == errno.EINVAL else ""
            raise PortUnavailableError(f"--nccl_host {host!r}: cannot listen there ({exc.strerror or exc}); " + (
                hint or "the model ranks meet on this machine, so give one of its addresses")) from None


def _is_unspecified(host: str) -> bool:
    """Whether ``host`` (bare) is an any-address (0.0.0.0, ::, or another spelling of either)."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False
