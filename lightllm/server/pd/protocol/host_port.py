"""The one ``host:port`` rule of the PD contract: how an address is written, and how it is read back.

A node advertises its HTTP endpoint and (a prefill node) its KV transfer port as ``host:port``;
the master calls the first as a URL and hands the second to the decode node, whose ranks connect
to it with plain sockets and ``torch.distributed.TCPStore``.  So one written form has to serve
both readers: an IPv6 host goes in brackets (``[fd00::1]:7000``, as a URL needs it, and the only
way its own colons stay apart from the port's), and every reader gets the host back without
them (a socket is given ``fd00::1``; ``[fd00::1]`` resolves to nothing).

The rule, strict on purpose since a bad address otherwise surfaces only as a connect that times
out on another machine:

* the host is one :func:`~lightllm.utils.host_names.host_problem` takes without ``allow_zone``
  (an IPv4 address, a DNS host name, or an IPv6 address in brackets; no zone, ``%eth0``, since it
  names an interface of one machine and the address is dialled from others, and nothing else in
  brackets), with one addition: an IPv6 address without
  brackets is refused (which colon starts the port?);
* the port is a decimal number in [1, 65535], written without sign or leading zeros.
"""

from __future__ import annotations

import re
from typing import Tuple

from lightllm.utils.host_names import bare_host, host_problem

PORT_MIN, PORT_MAX = 1, 65535
# Canonical decimal: "08000" or "+80" would read as some port, but not as the one a reader
# printing it back would write, so they are refused rather than guessed at.
_PORT = re.compile(r"[1-9][0-9]{0,4}")
_EXAMPLES = "10.0.0.1:7000, node-1.example:7000 or [fd00::1]:7000"


class HostPortError(ValueError):
    """A value that is not a ``host:port`` of the PD contract; the message says what is wrong."""


def parse_host_port(value: object) -> Tuple[str, int]:
    """``host:port`` -> ``(host, port)``, the host bare (``[::1]:7000`` -> ``("::1", 7000)``).

    Raises :class:`HostPortError` saying what is wrong with ``value`` (callers prefix the field).
    """
    if not isinstance(value, str):
        raise HostPortError(f"must be a 'host:port' string, got {value!r}")
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise HostPortError(f"must be 'host:port' (e.g. {_EXAMPLES}), got {value!r}")
    if ":" in host and "[" not in host and "]" not in host:
        raise HostPortError(f"must be 'host:port' with an IPv6 host in brackets (e.g. [fd00::1]:7000), got {value!r}")
    # The flags' rule (--pd_master_ip, --nccl_host) less the zone they take: this host is dialled
    # from other machines, where the zone names no interface.
    problem = host_problem(host)
    if problem:
        raise HostPortError(f"must be 'host:port' with a valid host ({problem}), got {value!r}")
    bare = bare_host(host)
    if not _PORT.fullmatch(port) or not PORT_MIN <= int(port) <= PORT_MAX:
        raise HostPortError(f"must be 'host:port' with a port in [{PORT_MIN}, {PORT_MAX}] (decimal, no leading "
                            f"zeros), got {value!r}")
    return bare, int(port)


def format_host_port(host: str, port: int) -> str:
    """``host`` and ``port`` written as :func:`parse_host_port` reads them (an IPv6 host bracketed).

    ``host`` may be bare or already bracketed.  Raises :class:`HostPortError` for a pair the
    parser would refuse, so a node cannot advertise an address its peers cannot read.
    """
    problem = host_problem(host)
    if problem:
        # Checked on ``host`` as given: "[1.2.3.4]" unbracketed would read as a valid "1.2.3.4".
        raise HostPortError(f"host {host!r}: {problem}")
    bare = bare_host(host)
    text = f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"
    parse_host_port(text)
    return text
