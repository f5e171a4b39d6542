"""Rank 0 -> the other tensor-parallel ranks: each step's commands, and nothing while idle.

Only rank 0 reads the router's and the HTTP side's messages, yet every rank must apply the same
commands in the same order before the same step, or their scheduling (and so their collectives)
would diverge.  :class:`TpCommandChannel` carries those commands over a gloo group of its own:

* rank 0 sends one message per loop in which the ranks have something to do: new commands, or a
  step to run because requests are running or KV transfers are in flight (``commands`` may then
  be empty);
* when rank 0 is idle it sends nothing and the other ranks block inside :meth:`receive`, so an
  idle server runs no collectives and no polling loop on those ranks;
* a gloo receive gives up after the group's timeout, so an idle rank 0 sends a small keep-alive
  every :data:`KEEPALIVE_SECONDS`; the timeout then only fires when rank 0 is truly gone or hung;
* shutdown is a message too, so the other ranks leave their loop instead of timing out;
* :meth:`TpCommandChannel.wait_for_ranks` is the one collective that carries no message: every
  rank calls it at the same point, and it returns once all of them got there.

A send returns once every other rank has taken the message in (gloo's broadcast root waits for
each receiver to post its receive), not once they have applied it: rank 0 may run a step and
publish it while another rank still admits the same requests.  A step that sampled keeps them
together (its forward's collectives need every rank), and where no such step does, the rank loop
waits with :meth:`~TpCommandChannel.wait_for_ranks` (:mod:`.record_read_fence`: rank 0 publishes
no request's finish before every rank has read that request's shared-memory record).

The group is gloo even when the model's group is NCCL: a follower's pending receive is then a
CPU socket wait, and NCCL never sees a collective it has to hold open.  With TP = 1 there is no
channel (:meth:`TpCommandChannel.open` returns None), so a single rank pays nothing.

Wire format: every message starts with one fixed-size frame (kind, payload length, and the
payload itself when it fits), so a typical step costs one small broadcast; a payload that does
not fit follows in a second broadcast of exactly its length.  Payloads are pickles, which is
fine because both ends run the same code in processes of one server.
"""

from __future__ import annotations

import enum
import pickle
import struct
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

# How long an idle rank 0 stays silent before it sends a keep-alive.  It must stay far below
# CHANNEL_TIMEOUT so a slow or busy host never turns a quiet period into a timeout; it is short
# enough that the other ranks still wake now and then (they give freed memory back then) and long
# enough that an idle server costs a few collectives a minute instead of fifty a second.
KEEPALIVE_SECONDS = 5.0
# A receive (or rank 0's send, which waits for the receivers to take the message, or a
# wait_for_ranks) that waits this long concludes that the other side is gone or hung and fails;
# the supervisor then stops the server.  Far above the keep-alive period so only a rank that
# stopped looping gets there, and above the launcher's start-up wait (900 s) because one rank may
# reach its loop long before another loads its shard.
CHANNEL_TIMEOUT = timedelta(minutes=30)
# The first frame of every message; a step's few commands fit, so one broadcast carries them.
FRAME_BYTES = 4096

_HEADER = struct.Struct("<BQ")  # kind, payload length in bytes
_INLINE_BYTES = FRAME_BYTES - _HEADER.size


class MessageKind(enum.IntEnum):
    """What a channel message asks the other ranks to do."""

    STEP = 1  # apply ``commands`` (possibly none), then run the loop's step
    KEEPALIVE = 2  # nothing: rank 0 is idle and alive
    SHUTDOWN = 3  # leave the loop


@dataclass(frozen=True)
class TpMessage:
    """One message as a follower receives it."""

    kind: MessageKind
    commands: List[Any] = field(default_factory=list)


class TpCommandChannel:
    """Rank 0's per-step commands to the other TP ranks over a dedicated gloo group.

    Every rank of the group constructs one (rank 0 sends with :meth:`send_step`,
    :meth:`keep_alive` and :meth:`send_shutdown`; the others call :meth:`receive`).  ``group``
    must contain every rank, with rank 0 as the sender.  ``clock`` is only for the keep-alive
    schedule (tests pass their own).
    """

    def __init__(
        self,
        rank: int,
        group: Any,
        keepalive_seconds: float = KEEPALIVE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        if keepalive_seconds <= 0:
            raise ValueError(f"keepalive_seconds must be > 0, got {keepalive_seconds}")
        self.rank = rank
        self.is_sender = rank == 0
        self.group = group
        self.keepalive_seconds = keepalive_seconds
        self._clock = clock
        self._frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        self._frame_view = self._frame.numpy()  # shares memory with the tensor
        self._last_send = clock()
        # Messages sent (rank 0) or received (the others) by kind, for tests and diagnostics.
        self.counts: Dict[MessageKind, int] = {kind: 0 for kind in MessageKind}
        self.waits = 0  # calls of wait_for_ranks, likewise

    @classmethod
    def open(
        cls,
        rank: int,
        tp: int,
        timeout: timedelta = CHANNEL_TIMEOUT,
        keepalive_seconds: float = KEEPALIVE_SECONDS,
    ) -> Optional["TpCommandChannel"]:
        """The channel of this rank (a new gloo group over the default one), or None when ``tp`` is 1.

        Every rank must call this at the same point of its start-up, after
        ``init_process_group``: creating a group is collective.
        """
        if tp <= 1:
            return None
        if keepalive_seconds * 4 > timeout.total_seconds():
            raise ValueError(f"the keep-alive period ({keepalive_seconds} s) must be well below the channel timeout "
                             f"({timeout.total_seconds()} s)")
        return cls(rank, dist.new_group(backend="gloo", timeout=timeout), keepalive_seconds)

    # --- rank 0 ---------------------------------------------------------------------------------
    def send_step(self, commands: List[Any]) -> None:
        """Ask the other ranks to apply ``commands`` (in order) and run one loop iteration."""
        payload = pickle.dumps(commands, protocol=pickle.HIGHEST_PROTOCOL) if commands else b""
        self._send(MessageKind.STEP, payload)

    def seconds_until_keepalive(self) -> float:
        """How long rank 0 may stay silent from now on (0 when a keep-alive is due)."""
        return max(0.0, self._last_send + self.keepalive_seconds - self._clock())

    def keep_alive(self) -> bool:
        """Send a keep-alive if rank 0 has been silent for the keep-alive period; True when sent."""
        if self.seconds_until_keepalive() > 0:
            return False
        self._send(MessageKind.KEEPALIVE, b"")
        return True

    def send_shutdown(self) -> None:
        """Tell the other ranks to leave their loop."""
        self._send(MessageKind.SHUTDOWN, b"")

    def _send(self, kind: MessageKind, payload: bytes) -> None:
        if not self.is_sender:
            raise RuntimeError(f"rank {self.rank} cannot send on the TP command channel (only rank 0 does)")
        frame = self._frame_view
        _HEADER.pack_into(frame, 0, int(kind), len(payload))
        inline = payload[:_INLINE_BYTES]
        frame[_HEADER.size:_HEADER.size + len(inline)] = memoryview(inline)
        dist.broadcast(self._frame, src=0, group=self.group)
        if len(payload) > _INLINE_BYTES:
            rest = torch.frombuffer(bytearray(payload[_INLINE_BYTES:]), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
        self._last_send = self._clock()
        self.counts[kind] += 1

    # --- every rank ----------------------------------------------------------------------------
    def wait_for_ranks(self) -> None:
        """Return once every rank of the group has called this (a barrier on the channel's group).

        Every rank must call it at the same point of the same loop iteration: it shares the
        group with the messages, whose order it must not cross.
        """
        dist.barrier(group=self.group)
        self.waits += 1

    # --- the other ranks ------------------------------------------------------------------------
    def receive(self) -> TpMessage:
        """Block until rank 0's next message (a gloo receive: no CPU while waiting)."""
        if self.is_sender:
            raise RuntimeError("rank 0 sends on the TP command channel; it does not receive")
        dist.broadcast(self._frame, src=0, group=self.group)
        frame = self._frame_view
        raw_kind, length = _HEADER.unpack_from(frame, 0)
        kind = MessageKind(raw_kind)
        payload = frame[_HEADER.size:_HEADER.size + min(length, _INLINE_BYTES)].tobytes()
        if length > _INLINE_BYTES:
            rest = torch.empty(length - _INLINE_BYTES, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            payload += rest.numpy().tobytes()
        self.counts[kind] += 1
        return TpMessage(kind, pickle.loads(payload) if payload else [])
