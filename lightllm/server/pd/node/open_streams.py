"""The open PD streams of a node: each request's events pumped to its NDJSON answer, failable from outside.

A node request's events come from the node's service (:class:`~.service.PdNodeService`); a task
pumps them into a queue (:class:`NodeStream`), so that losing the master
(:meth:`PdStreams.fail_all`) or a new placement of the same request (:meth:`PdStreams.supersede`)
can end a stream that is waiting for its next event.  Ending a stream closes the service's
iterator, which aborts the request on the node and frees its KV.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Set, Union

from fastapi import Request

from lightllm.server.http.generation.client_presence import result_unless_gone
from lightllm.server.pd.protocol.node_events import ERROR, PdNodeEvent

logger = logging.getLogger(__name__)

# A stream's last item: its events ended.
END = object()
# Put in a stream's queue when its client (the master) went away.
GONE = object()
# How often a request checks whether the master is still connected (waiting for its first
# event, and while its stream is open).
FIRST_EVENT_POLL_SECONDS = 0.5


class NodeStream:
    """One node request's events, pumped by a task so the stream can be failed from outside."""

    def __init__(self, events: AsyncIterator[PdNodeEvent], request_id: int):
        self.request_id = request_id
        self._events = events
        self._queue: "asyncio.Queue[Union[PdNodeEvent, BaseException, object]]" = asyncio.Queue()
        self._pump = asyncio.get_running_loop().create_task(self._run(), name=f"pd-node-stream-{request_id}")

    async def _run(self) -> None:
        try:
            async for event in self._events:
                self._queue.put_nowait(event)
            self._queue.put_nowait(END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the master as an error line or status
            self._queue.put_nowait(exc)
        finally:
            # Closing the node's iterator aborts the request on the node and frees its KV.
            close = getattr(self._events, "aclose", None)
            if close is not None:
                await close()

    async def next(self) -> Union[PdNodeEvent, BaseException, object]:
        """The next event, a failure, ``END`` or ``GONE``."""
        return await self._queue.get()

    def abandon(self) -> None:
        """The client went away: stop the request and end the stream without a line."""
        self._queue.put_nowait(GONE)
        self._pump.cancel()

    def fail(self, message: str) -> None:
        """End the stream with an error line and stop the request (called on the event loop)."""
        self._queue.put_nowait(PdNodeEvent(kind=ERROR, message=message, error_kind="internal"))
        self._pump.cancel()

    async def close(self) -> None:
        """Stop the request if it still runs and wait until the node has let go of it."""
        self._pump.cancel()
        try:
            await self._pump
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - the abort path must not raise into the response
            logger.exception("request %d: closing its node stream failed", self.request_id)


class PdStreams:
    """The node's open PD streams, so losing the master can fail every one of them, and a new
    placement of a request can end the previous one under its id."""

    def __init__(self) -> None:
        self._open: Set[NodeStream] = set()

    def __len__(self) -> int:
        return len(self._open)

    def add(self, stream: NodeStream) -> None:
        """Track an open stream (until :meth:`discard`)."""
        self._open.add(stream)

    def discard(self, stream: NodeStream) -> None:
        """Stop tracking a stream that ended (no error if it is not tracked)."""
        self._open.discard(stream)

    def fail_all(self, message: str) -> int:
        """End every open stream with an error line and abort its request; returns how many."""
        streams = list(self._open)
        for stream in streams:
            stream.fail(message)
        return len(streams)

    def supersede(self, request_id: int) -> int:
        """End every open stream of ``request_id`` without a line and abort its request; returns how many.

        The master runs one placement of a request on a node at a time and gives the previous
        one up before it sends the next (a continuation segment, or the same segment placed
        again after its other node failed): a request that arrives under a live id replaces it.
        The master closed the old stream already, but this node would notice that only at its
        next disconnect check; ending it here starts its release at once, so the new
        placement's wait for the id does not depend on that check.
        """
        streams = [stream for stream in self._open if stream.request_id == request_id]
        for stream in streams:
            self._open.discard(stream)
            stream.abandon()
        return len(streams)


async def first_item(stream: NodeStream, request: Request) -> Any:
    """The stream's first item, or None when the client disconnects before it comes.

    The answer's status depends on the first item, so no byte is sent until then; a prefill
    node's first token may wait in the queue for long, and a master that gave up meanwhile must
    not leave the request running.
    """
    done, item = await result_unless_gone(asyncio.ensure_future(stream.next()), request, FIRST_EVENT_POLL_SECONDS)
    return item if done else None


async def watch_disconnect(stream: NodeStream, request: Request) -> None:
    """End ``stream`` once its client (the master) has gone, without waiting for its next item.

    A decode node's reservation waits for KV that never comes when the prefill node's first token
    already ended the request (a one-token request, a first token that is EOS); the master's
    closed stream is the only sign of that, and the stream would otherwise notice it only when it
    writes its next line, at the lease's expiry.  One task per stream, not a poll per token.
    """
    while True:
        await asyncio.sleep(FIRST_EVENT_POLL_SECONDS)
        if await request.is_disconnected():
            stream.abandon()
            return
