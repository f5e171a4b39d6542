"""Transfer announcements through the pair's store: the decode side receives only what was announced.

The prefill side puts each request's header (:meth:`TransferHeader.to_bytes`) under the next
key ``announce/<seq>`` of its pair's store prefix and only then waits for the decode side's
verdict; the decode side waits for key ``announce/<seq>`` with a bounded ``store.wait`` in a
loop, takes the header (deleting the key once that transfer is over) and only then posts the
receives of that request on the pair's group.  So an idle pair has no receive (no collective) pending: with NCCL a receive left
posted for long would be killed by its watchdog, and the store wait is a plain TCP request to the
prefill rank's store server.

When its owner stops it, the prefill side announces :data:`CLOSED` instead of a header, so the
decode side learns at once that the pair was torn down (or replaced) and fails what it waits for.
A dead prefill node shows as the store connection failing.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from lightllm.server.pd.kv_transfer.bounded_wait import ChannelFault, first_line

CLOSED = b"closed"


def announce_key(seq: int) -> str:
    """The store key of the ``seq``-th announcement of a pair's group."""
    return f"announce/{seq}"


class Announcer:
    """Prefill side: announces the pair's transfers in order."""

    def __init__(self, store: dist.Store):
        self._store = store
        self.count = 0  # announcements made (the next one's sequence number)

    def announce(self, header: bytes) -> None:
        """Publish the next transfer's header; :class:`ChannelFault` when the store failed."""
        try:
            self._store.set(announce_key(self.count), header)
        except RuntimeError as exc:
            raise ChannelFault(f"could not announce a transfer in the pair's store: {first_line(exc)}") from exc
        self.count += 1

    def close(self) -> None:
        """Tell the decode side that no more transfers come on this group (best effort)."""
        try:
            self._store.set(announce_key(self.count), CLOSED)
        except RuntimeError:
            pass  # the store is gone, which the decode side sees as well


class AnnouncementWatcher:
    """Decode side: takes the pair's announcements in order, waiting ``wait_s`` at most per call."""

    def __init__(self, store: dist.Store, wait_s: float):
        if wait_s <= 0:
            raise ValueError(f"the announcement wait must be positive, got {wait_s}")
        self._store = store
        self._wait = timedelta(seconds=wait_s)
        self.count = 0  # announcements taken (the next one's sequence number)
        self.idle_waits = 0  # waits that ended with no announcement
        self._taken: Optional[str] = None  # the key taken last, deleted at the next call

    def next(self) -> Optional[bytes]:
        """The next header, or None when none was announced within the wait.

        Raises :class:`ChannelFault` when the store failed (the prefill node is gone) or the
        prefill side closed the pair.
        """
        key = announce_key(self.count)
        try:
            if self._taken is not None:
                # Deleted here, after the transfer it announced, not on that transfer's path: the
                # prefill rank's store keeps nothing per finished request.
                self._store.delete_key(self._taken)
                self._taken = None
            self._store.wait([key], self._wait)
        except dist.DistStoreError as exc:
            if "timeout" not in str(exc).lower():
                raise ChannelFault(f"the prefill node's store failed: {first_line(exc)}") from exc
            self.idle_waits += 1
            return None
        except RuntimeError as exc:
            raise ChannelFault(f"the prefill node's store failed: {first_line(exc)}") from exc
        try:
            header = self._store.get(key)
        except RuntimeError as exc:
            raise ChannelFault(f"the prefill node's store failed: {first_line(exc)}") from exc
        self.count += 1
        self._taken = key
        if header == CLOSED:
            raise ChannelFault("the prefill side closed the pair (torn down or replaced)")
        return header
