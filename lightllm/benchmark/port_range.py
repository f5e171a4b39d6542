"""The ports a benchmark launcher gives its servers when they must stay in one range (``--ports FIRST-LAST``).

Without a range a launcher picks any free port for each server's HTTP listener
(:func:`~lightllm.utils.free_ports.free_port`) and the servers pick their other ports
themselves.  On a shared host a tool may be allotted a range instead: then every port it gives a
process comes from :class:`PortRange` (each checked free before use, none handed out twice), and
the ports a server would otherwise pick itself (the TP rendezvous ``--nccl_port`` of a process of
more than one rank, a prefill node's ``--pd_transfer_port`` block of one port per rank) are given
from the range too (:func:`confined_port_flags`), unless its flags already set them.
"""

from __future__ import annotations

import re
import threading
from typing import Optional, Sequence

from lightllm.benchmark.deployment import flag_value
from lightllm.benchmark.server_process import ServerStartError
from lightllm.utils.free_ports import can_bind, read_ephemeral_range

# Ports below 1024 need privileges a benchmark should not have.
LOWEST_PORT = 1024
HIGHEST_PORT = 65535
# The server's --nccl_host default: where a TP rendezvous listens unless the flags say otherwise.
DEFAULT_NCCL_HOST = "127.0.0.1"
_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


class PortsExhaustedError(ServerStartError):
    """No free port (or block of ports) is left in the range; the message names the range."""


class PortRange:
    """Ports ``first`` to ``last`` (inclusive) that a launcher hands out, each checked free, none twice.

    Safe to share between the threads of a parallel launch.  Ports are handed out lowest first, so
    the free ports stay one run at the top of the range: a block of consecutive ports (a prefill
    node's transfer ports) fits wherever :meth:`check_room` counted room for it and no other program
    holds a port in the way, whatever order the launch threads ask in (ports drawn at random left
    holes no block fitted into: one start in five of a 5-port range failed that way).  A range
    belongs to one run: two runs given the same range both find its lowest ports free and race
    for them (random order only made that rarer), so give concurrent runs disjoint ranges.
    """

    def __init__(self, first: int, last: int) -> None:
        if not LOWEST_PORT <= first <= last <= HIGHEST_PORT:
            raise ValueError(f"must be FIRST-LAST with {LOWEST_PORT} <= FIRST <= LAST <= {HIGHEST_PORT}, "
                             f"got {first}-{last}")
        self.first = first
        self.last = last
        self._handed_out: set[int] = set()
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, text: str) -> "PortRange":
        """``"23200-23399"`` -> ``PortRange(23200, 23399)``; ``ValueError`` (one line) for anything else."""
        match = _RANGE.match(text)
        if match is None:
            raise ValueError(f"must be FIRST-LAST, two integers (e.g. 23200-23399), got {text!r}")
        return cls(int(match.group(1)), int(match.group(2)))

    def __len__(self) -> int:
        return self.last - self.first + 1

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"

    def ephemeral_overlap_warning(self, ephemeral: Optional[tuple[int, int]] = None) -> Optional[str]:
        """One warning line when the range overlaps the kernel's ephemeral range (None otherwise).

        A port there can be taken by any outgoing connection between its check and its server's bind
        (:mod:`lightllm.utils.free_ports` says why), so a start may fail with "Address already in use".
        """
        first, last = ephemeral or read_ephemeral_range() or (0, -1)
        if self.last < first or self.first > last:
            return None
        return (f"warning: --ports {self} overlaps the kernel's ephemeral port range {first}-{last}; an outgoing "
                "connection may take one of its ports before the server binds it (a start then fails with "
                f"'Address already in use'): a range below {first} avoids that")

    def check_room(self, needed: int, what: str) -> None:
        """Refuse (``ValueError``, one line) a range with fewer than ``needed`` ports for ``what``."""
        if needed > len(self):
            raise ValueError(f"--ports {self} holds {len(self)} ports, fewer than the {needed} {what} needs; "
                             "give a wider range")

    def take(self, host: str, count: int = 1, what: str = "a server") -> int:
        """The first of ``count`` consecutive ports, free on ``host`` now and never handed out before.

        Raises:
            PortsExhaustedError: no such block is left (the others were handed out or are taken).
            OSError: ``host`` is not an address of this machine.
        """
        with self._lock:
            for start in range(self.first, self.last - count + 2):
                block = range(start, start + count)
                if self._handed_out.isdisjoint(block) and all(can_bind(host, port) for port in block):
                    self._handed_out.update(block)
                    return start
        missing = f"{count} consecutive free ports" if count > 1 else "free port"
        raise PortsExhaustedError(f"--ports {self} has no {missing} left for {what} ({len(self._handed_out)} handed "
                                  "out to this run's servers, the others taken by other programs); give a wider range")


def tp_size(flags: Sequence[str]) -> int:
    """The ``--tp`` in ``flags`` (1 without one; a value the server cannot parse is its own refusal)."""
    text = flag_value(flags, "--tp")
    return int(text) if text is not None and text.isdigit() and int(text) > 0 else 1


def _own_ports(flags: Sequence[str], prefill_node: bool) -> tuple[int, int]:
    """How many rendezvous ports and transfer ports a model process with ``flags`` would pick itself."""
    tp = tp_size(flags)
    # One rank opens no rendezvous, and the server refuses --nccl_port with --tp 1.
    nccl = 1 if tp > 1 and flag_value(flags, "--nccl_port") is None else 0
    transfer = tp if prefill_node and flag_value(flags, "--pd_transfer_port") is None else 0
    return nccl, transfer


def ports_of_model_process(flags: Sequence[str], *, prefill_node: bool = False) -> int:
    """How many ports of a range a model process with ``flags`` takes: its HTTP port and :func:`confined_port_flags`'."""
    return 1 + sum(_own_ports(flags, prefill_node))


def confined_port_flags(ports: PortRange, host: str, flags: Sequence[str], *, prefill_node: bool = False,
                        what: str = "a server") -> list[str]:
    """The port flags to add to a model process with ``flags`` so that every port it would pick is in ``ports``.

    ``--nccl_port`` for a process of more than one TP rank (checked on its ``--nccl_host``, where
    the rendezvous listens), and for a prefill node its ``--pd_transfer_port`` block (one port per
    rank), each unless ``flags`` set it already.  The data connections torch.distributed opens
    between ranks (TP, and a PD pair's KV transfer group) still listen on ports the kernel picks.
    """
    nccl, transfer = _own_ports(flags, prefill_node)
    extra: list[str] = []
    if nccl:
        nccl_host = flag_value(flags, "--nccl_host") or DEFAULT_NCCL_HOST
        extra += ["--nccl_port", str(ports.take(nccl_host, what=f"{what}'s --nccl_port"))]
    if transfer:
        extra += ["--pd_transfer_port", str(ports.take(host, transfer, what=f"{what}'s --pd_transfer_port"))]
    return extra
