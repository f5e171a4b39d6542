"""One PD request on the master: its node streams, the nodes it depends on, and bounded waits.

Both node streams of a segment (D's and P's) feed one queue; :meth:`RequestRun.next` waits for
the next event of one role with a deadline, while a failure from outside (the node was dropped
from the cluster, the server shuts down) wakes it at once, and the client is asked every
:data:`DISCONNECT_CHECK_SECONDS` whether it is still there.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Callable, Deque, Dict, List, Optional

from lightllm.server.pd.master.continuation import SegmentEnd
from lightllm.server.pd.master.node_selector import Placement
from lightllm.server.pd.protocol.node_info import DECODE, PREFILL, NodeInfo
from lightllm.server.pd.master.node_streams import STREAM_END, NodeCallError, NodeStream
from lightllm.server.manager_errors import ServerUnavailableError

DISCONNECT_CHECK_SECONDS = 0.5

# Put in the queue to wake a waiting request when it is failed from outside.
_WAKE = object()


class PdRequestFailed(ServerUnavailableError):
    """A PD request ended with an error (HTTP 503, or an error event mid-stream).

    ``reason`` is the ``lightllm_pd_failed_requests_total`` label; ``transfer_broken`` means
    the node asked for the transfer pair to be set up again; ``role`` / ``node_id`` name the
    node that could not be reached (``node_unreachable``; empty otherwise).
    """

    def __init__(self, message: str, code: str, reason: str, transfer_broken: bool = False, role: str = "",
                 node_id: str = ""):
        super().__init__(message, code)
        self.reason = reason
        self.transfer_broken = transfer_broken
        self.role = role
        self.node_id = node_id


class ClientGone(Exception):
    """The client disconnected; the request ends without an error to anyone."""


class RequestRun:
    """A request's streams and waits; ``nodes`` maps role -> the node it still depends on.

    ``high_priority``: the client's admission priority, sent to both nodes with every segment.
    ``previous_decode``: the decode node of the request's last dispatched segment.  The
    :class:`~.node_selector.Placement` of each role (:meth:`hold`) is released when the node's
    part ends (:meth:`release`) and at the latest when the streams are cancelled or closed.
    """

    def __init__(self, request_id: int, request: Any = None, high_priority: bool = False) -> None:
        self.request_id = request_id
        self.request = request
        self.high_priority = high_priority
        self.nodes: Dict[str, NodeInfo] = {}
        self.previous_decode: Optional[NodeInfo] = None
        self._placements: Dict[str, Placement] = {}
        self.failure: Optional[Exception] = None
        # How the last segment ended (set by the segment flow); None while it runs.
        self.segment_end: Optional[SegmentEnd] = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._buffers: Dict[str, Deque[Any]] = {PREFILL: collections.deque(), DECODE: collections.deque()}
        self._streams: List[NodeStream] = []
        # The current segment's prefill stream (the segment flow releases it after the hand-off).
        self.prefill_stream: Optional[NodeStream] = None
        self._next_check = time.monotonic() + DISCONNECT_CHECK_SECONDS
        # True once the client is known to be gone (a check saw it, or its response was torn down).
        self.client_gone = False

    async def client_disconnected(self) -> bool:
        """Ask the client now (not at the next poll) whether it is gone; remembers a yes.

        uvicorn stops reading a connection once its request body is in, so a client that
        closes its socket is only seen after something reads again: the first ask resumes
        reading, which is why :meth:`watch_client` asks once as the request starts.
        """
        if self.client_gone:
            return True
        if self.request is None:
            return False
        if await self.request.is_disconnected():
            self.client_gone = True
        return self.client_gone

    async def watch_client(self) -> None:
        """Start noticing the client's disconnect at once (see :meth:`client_disconnected`)."""
        await self.client_disconnected()

    async def require_client(self) -> None:
        """Raise :class:`ClientGone` if the client has left: before work that only it would read
        (a continuation segment), which must not be placed for nobody."""
        if await self.client_disconnected():
            raise ClientGone()

    def sink(self, role: str) -> Callable[[Any], None]:
        """Where ``role``'s stream puts its lines."""
        return lambda payload: self._queue.put_nowait((role, payload))

    def track(self, stream: NodeStream) -> NodeStream:
        """Remember ``stream`` so :meth:`close_streams` closes it."""
        self._streams.append(stream)
        return stream

    def release_stream(self, stream: NodeStream, within_s: float) -> None:
        """Stop reading ``stream`` but let its node end it (see :meth:`NodeStream.release`);
        :meth:`close_streams` no longer closes it."""
        if stream in self._streams:
            self._streams.remove(stream)
            stream.release(within_s)

    def fail(self, failure: Exception) -> bool:
        """End the request with ``failure`` unless it already failed; True if failed now."""
        if self.failure is not None:
            return False
        self.failure = failure
        self._queue.put_nowait(_WAKE)
        return True

    def hold(self, role: str, placement: Placement) -> None:
        """Keep ``placement`` of ``role`` until :meth:`release` (or the streams close)."""
        previous = self._placements.pop(role, None)
        if previous is not None:
            previous.release()
        self._placements[role] = placement

    def release(self, role: str) -> None:
        """The request no longer loads its ``role`` node (P handed off; D's segment ended)."""
        placement = self._placements.pop(role, None)
        if placement is not None:
            placement.release()

    def depends_on(self, node_id: str) -> Optional[str]:
        """The role in which this request still needs node ``node_id``, or None."""
        for role, node in self.nodes.items():
            if node.node_id == node_id:
                return role
        return None

    def cancel_streams(self) -> None:
        """Stop reading every stream now (their connections close in the background); the
        request no longer loads, or depends on, any node."""
        for stream in self._streams:
            stream.cancel()
        for role in list(self._placements):
            self.release(role)
        self.nodes = {}

    async def close_streams(self) -> None:
        """Close every stream (the nodes abort what still runs) and forget their queued lines."""
        self.cancel_streams()
        streams, self._streams = self._streams, []
        for stream in streams:
            await stream.close()
        for buffer in self._buffers.values():
            buffer.clear()
        while not self._queue.empty():
            self._queue.get_nowait()

    async def next(self, role: str, timeout_s: float, waiting_for: str,
                   other: Optional[Callable[[Any], None]] = None) -> Dict[str, Any]:
        """The next event line of ``role``'s stream, within ``timeout_s``.

        Lines of the other role are buffered, or given to ``other`` when set (which may raise).
        Raises :class:`PdRequestFailed` on a deadline, a stream that ended or failed, or an
        outside failure; :class:`ClientGone` when the client disconnected.
        """
        deadline = time.monotonic() + timeout_s
        buffer = self._buffers[role]
        while True:
            if self.failure is not None:
                raise self.failure
            if buffer:
                return self._line(role, buffer.popleft(), waiting_for)
            now = time.monotonic()
            if now >= deadline:
                node = self.nodes.get(role)
                where = node.describe() if node is not None else f"the {role} node"
                raise PdRequestFailed(
                    f"request {self.request_id}: {where} sent no {waiting_for} within {timeout_s:g} s",
                    "pd_timeout", "timeout",
                )
            if not self._queue.empty():
                item = self._queue.get_nowait()  # no task and timer per line while lines are waiting
            else:
                try:
                    item = await asyncio.wait_for(self._queue.get(), max(0.0, min(deadline, self._next_check) - now))
                except asyncio.TimeoutError:
                    item = None
            if self.request is not None and time.monotonic() >= self._next_check:
                self._next_check = time.monotonic() + DISCONNECT_CHECK_SECONDS
                await self.require_client()
            if item is None or item is _WAKE:
                continue
            source, payload = item
            if source != role and other is not None:
                other(payload)
            else:
                self._buffers[source].append(payload)

    def has_buffered(self, role: str) -> bool:
        """Whether lines of ``role`` wait in the buffer for a later :meth:`next`."""
        return bool(self._buffers[role])

    def keep(self, role: str, payload: Any) -> None:
        """Buffer ``payload`` of ``role`` for a later :meth:`next` (from an ``other`` callback)."""
        self._buffers[role].append(payload)

    def check(self, role: str, payload: Any, waiting_for: str) -> Dict[str, Any]:
        """``payload`` as an event line; raises as :meth:`next` does for an end or a failure."""
        return self._line(role, payload, waiting_for)

    def _line(self, role: str, payload: Any, waiting_for: str) -> Dict[str, Any]:
        if isinstance(payload, dict):
            return payload
        node = self.nodes.get(role)
        where = node.describe() if node is not None else f"the {role} node"
        if payload is STREAM_END:
            raise PdRequestFailed(f"request {self.request_id}: {where} ended its stream before the {waiting_for}",
                                  "pd_node_failed", "protocol")
        if isinstance(payload, NodeCallError):
            if payload.unreachable:
                raise PdRequestFailed(f"request {self.request_id}: {payload}", "pd_node_unreachable", "node_unreachable",
                                      role=role, node_id=payload.node.node_id)
            if payload.status is not None and 400 <= payload.status < 500 and payload.status != 409:
                # The node refused what the master sent (e.g. a longer context than it allows).
                raise ValueError(f"the {role} node refused the request: {payload}")
            raise PdRequestFailed(f"request {self.request_id}: {where} failed: {payload}", "pd_node_failed", "node_error")
        raise PdRequestFailed(f"request {self.request_id}: unexpected item from {where}: {payload!r}",
                              "pd_node_failed", "protocol")
