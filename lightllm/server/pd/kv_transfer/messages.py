"""The small messages between a rank process and its KV transfer process.

Commands go down a pipe (rank -> transfer process), results come back up the same pipe; both
are plain picklable dataclasses, so nothing large ever crosses it: the KV itself is read from
and written to the shared cache by the transfer process.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SendKV:
    """Prefill side: send the KV in ``slots`` (in token order) as request ``request_id``."""

    request_id: int
    slots: np.ndarray
    first_token: int = -1  # travels in the header to the decode side


@dataclass(frozen=True)
class ReceiveKV:
    """Decode side: write request ``request_id``'s KV, when it arrives, into ``slots``.

    ``wait_s`` bounds how long the transfer process waits for the prefill side to start
    sending this request before reporting it failed.
    """

    request_id: int
    slots: np.ndarray
    wait_s: float


@dataclass(frozen=True)
class CancelReceive:
    """Decode side: give up request ``request_id``'s receive if none of its KV has arrived yet.

    Its request ended first (the prefill node's first token finished it, or the client left), so
    no KV will come, and the reservation should not wait for the lease.  The receive is reported
    as a failed result with ``cancelled``; a header that arrives for it later is refused, as for an
    expired receive.  A receive already under way is left to finish.
    """

    request_id: int


@dataclass(frozen=True)
class CancelSend:
    """Prefill side: take request ``request_id``'s send off the queue if it has not started.

    Its request was aborted on the node (the master that wanted its KV is gone, or gave it up),
    so it must not wait behind the sends queued ahead of it.  The send is reported as a failed
    result with ``cancelled``; a send already under way is left to finish and reports itself.
    """

    request_id: int


@dataclass(frozen=True)
class Shutdown:
    """Stop the transfer process after the current transfer."""


@dataclass(frozen=True)
class QueryStats:
    """Ask the transfer process for its :class:`TransferStats` (diagnostics and tests)."""


@dataclass(frozen=True)
class TransferStats:
    """What a transfer process has done and is waiting on, as counters since it started.

    ``receives_posted`` counts the point-to-point receives it posted on its group,
    ``receives_pending`` those not yet completed: an idle decode side has none, since it posts
    receives only for an announced transfer.  ``announcements`` counts transfers announced
    (prefill side) or taken (decode side); ``idle_waits`` counts the decode side's bounded
    waits on the pair's store that ended with no announcement.
    """

    role: str
    receives_posted: int
    receives_pending: int
    announcements: int
    idle_waits: int


@dataclass(frozen=True)
class TransferResult:
    """The outcome of one request's transfer, as seen by one side.

    ``ok`` on the prefill side means the decode side acknowledged a verified payload, so the
    prefill KV may be freed; on the decode side it means the KV is in the reserved slots.
    ``first_token`` (decode side, ok results) is the prefill node's first token from the header.
    ``expired`` (decode side) marks a receive whose KV did not start arriving within its wait
    (a PD reservation's lease ran out); ``cancelled`` one given up by :class:`CancelReceive` or
    :class:`CancelSend` before it started.  ``unreserved`` (decode side) marks KV refused because
    no receive waited for it: the receive had already ended (cancelled or expired, and reported
    so) when the prefill side sent, a race of every request that ends as its transfer begins.
    """

    request_id: int
    ok: bool
    seconds: float
    bytes: int
    reason: str = ""
    first_token: int = -1
    expired: bool = False
    cancelled: bool = False
    unreserved: bool = False


@dataclass(frozen=True)
class ChannelReady:
    """The transfer process joined its two-rank group (sent once per process)."""

    seconds: float


@dataclass(frozen=True)
class ChannelBroken:
    """The transfer process's group is unusable (timeout, dead peer); it exits after this.

    Every request it still held is reported failed before this message; the owner replaces
    the process with :meth:`KVTransferHandle.restart` (or drops the pair).
    """

    reason: str
