"""The PD master's HTTP client of the node control endpoints (``/pd/node/*``).

``transfer_setup`` is a JSON call; ``decode`` and ``prefill`` answer NDJSON streams, one event
object per line (docs/EN/pd_deployment.md and the node endpoints).  A :class:`NodeStream`
reads its stream in its own task and hands every line, as a ``dict``, to a sink; the end of the
stream as :data:`STREAM_END`; a failure (the node unreachable, an error answer before the
stream, a line that is not JSON) as a :class:`NodeCallError`.  The reader of the sink applies the
deadlines.  Closing a stream before its end closes the connection, which the node takes as the
master giving up: it aborts the request and frees its KV.  A stream the request no longer needs
but whose node should still end it by itself (a prefill node's stream after the hand-off: its
``handed_off`` line is on its way) is released instead (:meth:`NodeStream.release`): its lines
are dropped and the node ends it, so the node accounts for its request as what it was.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable, Dict, Optional, Set

import anyio
import httpx

from lightllm.server.http.middleware.auth import cluster_key_headers
from lightllm.server.pd.protocol.node_info import NodeInfo

logger = logging.getLogger(__name__)

# Handed to the sink when a stream ended normally (the node closed it).
STREAM_END = object()

# A node that cannot even accept the connection is down; this bounds how long that takes to see.
CONNECT_TIMEOUT_S = 5.0

Sink = Callable[[Any], None]


class NodeCallError(Exception):
    """A call to a node failed before, or instead of, a well-formed answer.

    Attributes: ``node`` (who), ``status`` (the HTTP status of an error answer, else None),
    ``code`` (the node's error code, if it sent one) and ``unreachable`` (no answer at all, or a
    node answering that it fails or stops: either way it serves nothing new).
    """

    def __init__(self, node: NodeInfo, message: str, status: Optional[int] = None, code: Optional[str] = None,
                 unreachable: bool = False):
        super().__init__(message)
        self.node = node
        self.status = status
        self.code = code
        self.unreachable = unreachable


def _within(seconds: Optional[float]) -> str:
    return f"within {seconds:g} s" if seconds is not None else "in time"


def _call_failure(node: NodeInfo, path: str, exc: httpx.HTTPError, timeout: httpx.Timeout) -> NodeCallError:
    """The :class:`NodeCallError` of a call that got no answer (``timeout``: the call's bounds).

    A timeout's own text is empty, and a node that accepted the connection was reached: it
    just did not answer in time, which is what the message must say.
    """
    if isinstance(exc, httpx.ConnectTimeout):
        why = f"could not be reached on {path}: no connection {_within(timeout.connect)}"
    elif isinstance(exc, httpx.TimeoutException):
        why = f"did not answer {path} {_within(timeout.read)}"
    else:
        detail = str(exc)
        why = f"could not be reached on {path}: {type(exc).__name__}{': ' + detail if detail else ''}"
    return NodeCallError(node, f"{node.describe()} {why}", unreachable=True)


# What a node answers while its process fails or stops (lightllm/server/launch/supervisor.py): it
# will serve nothing new, so it is passed over as a node that refused the connection would be.
NODE_STOPPING_CODES = frozenset({"server_failed", "server_shutting_down"})


def _answer_failure(node: NodeInfo, response: httpx.Response, body: bytes, on_refused: "RefusalListener"
                    ) -> NodeCallError:
    """The :class:`NodeCallError` of a non-200 answer; a stopping node's is ``unreachable`` and told."""
    message, code = _error_message(response, body)
    stopping = response.status_code == 503 and code in NODE_STOPPING_CODES
    if stopping:
        on_refused(node, message)
    return NodeCallError(node, message, response.status_code, code, unreachable=stopping)


def _error_message(response: httpx.Response, body: bytes) -> tuple[str, Optional[str]]:
    try:
        error = json.loads(body)["error"]
        return str(error["message"]), error.get("code")
    except Exception:  # noqa: BLE001 - a proxy's HTML page is still an error answer
        return f"HTTP {response.status_code}: {body[:200].decode('utf-8', 'replace')}", None


def _drop(payload: Any) -> None:
    """The sink of a released stream: nobody reads its lines any more."""


# Told of a node whose HTTP port refused a connection, or that answered it is failing or stopping:
# ``(node, what the call saw)``.
RefusalListener = Callable[[NodeInfo, str], None]


def _ignore_refusal(node: NodeInfo, why: str) -> None:
    """The refusal listener of a client nobody asked to be told."""


class NodeStream:
    """One NDJSON stream from a node, read in a background task into ``sink``.

    ``released`` is the owner's set of streams released and not yet ended (it holds them, so
    their tasks are not garbage collected and the owner can close them when it stops).
    ``on_refused`` is told when the node's port refuses the connection.
    """

    def __init__(self, client: httpx.AsyncClient, node: NodeInfo, path: str, body: Dict[str, Any], sink: Sink,
                 released: Optional[Set["NodeStream"]] = None, on_refused: RefusalListener = _ignore_refusal):
        self.node = node
        self.path = path
        self._on_refused = on_refused
        self._client = client
        self._body = body
        self._sink = sink
        self._task: Optional[asyncio.Task] = None
        self._cancel_requested = False
        # The reader's cancel scope (see cancel()); None until the reader runs.
        self._scope: Optional[anyio.CancelScope] = None
        self._released = released if released is not None else set()
        self._closer: Optional[asyncio.Task] = None

    def start(self) -> "NodeStream":
        """Send the request and start reading (on the running loop)."""
        self._task = asyncio.get_running_loop().create_task(self._read(), name=f"pd-{self.path}")
        return self

    async def _read(self) -> None:
        with anyio.CancelScope() as scope:
            self._scope = scope
            if self._cancel_requested:  # cancelled before the reader first ran
                scope.cancel()
            await self._read_lines()

    async def _read_lines(self) -> None:
        url = f"http://{self.node.http_address}{self.path}"
        try:
            async with self._client.stream("POST", url, json=self._body) as response:
                if response.status_code != 200:
                    self._sink(_answer_failure(self.node, response, await response.aread(), self._on_refused))
                    return
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    try:
                        event = json.loads(line)
                    except ValueError:
                        event = None
                    if not isinstance(event, dict):
                        self._sink(NodeCallError(self.node, f"{self.node.describe()} sent a line that is not a JSON "
                                                            f"object on {self.path}: {line[:200]!r}"))
                        return
                    self._sink(event)
            self._sink(STREAM_END)
        except httpx.HTTPError as exc:
            failure = _call_failure(self.node, self.path, exc, self._client.timeout)
            if isinstance(exc, httpx.ConnectError):
                self._on_refused(self.node, str(failure))
            self._sink(failure)

    def cancel(self) -> None:
        """Stop reading now; the reader closes the connection on its own (see :meth:`close`).

        Through the reader's anyio cancel scope, never ``Task.cancel()``: httpcore closes a
        connection (and hands it back to the pool) inside anyio-shielded sections, which hold off
        a scope's cancellation but not a task's. A task cancellation landing there (at the end of
        a stream the node just ended, as the master reacts to its last line) cut the close short
        and left the connection in the pool for good, the node's side closed (CLOSE-WAIT): one
        file descriptor lost per such request.
        """
        # A read whose data already arrived still completes under a scope's cancellation: its
        # lines are dropped, so nothing reaches the sink once the stream is stopped.
        self._sink = _drop
        if self._task is None or self._task.done() or self._cancel_requested:
            return
        self._cancel_requested = True
        if self._scope is not None:
            self._scope.cancel()

    def release(self, within_s: float) -> None:
        """Let the node end this stream by itself, within ``within_s`` seconds; its lines are dropped.

        For a stream the request no longer needs whose node still owes a last line (a prefill
        node's ``handed_off`` after the decode node confirmed the KV).  Closing it instead would
        abort the request there, and the node would count a hand-off that succeeded as an
        abort.  A node that has not ended it by then gets it closed (on a running event loop).
        """
        self._sink = _drop
        task = self._task
        if task is None or task.done() or self._cancel_requested or self._closer is not None:
            return
        self._released.add(self)
        self._closer = asyncio.get_running_loop().create_task(self._close_after(task, within_s),
                                                              name=f"pd-release-{self.path}")

    async def _close_after(self, task: asyncio.Task, within_s: float) -> None:
        try:
            done, _ = await asyncio.wait({task}, timeout=within_s)
            if not done:
                logger.warning("%s did not end its %s stream within %g s of its release; closing it",
                               self.node.describe(), self.path, within_s)
                await self.close()
        finally:
            self._released.discard(self)

    async def close(self) -> None:
        """Stop reading and wait until the connection is closed (the node aborts the request).

        ``asyncio.wait`` rather than ``await task``: a cancellation of the caller (the client's
        response being torn down) must not be forwarded into the reader while it closes the
        connection; cut short there, the connection would stay open and the node would keep
        generating into it.
        """
        task = self._task
        if task is None:
            return
        self.cancel()
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            logger.error("the stream reader of %s failed", self.node.describe(), exc_info=task.exception())


class NodeStreams:
    """The master's one HTTP client of every node (one connection per stream, never reused).

    ``cluster_key`` (``--pd_cluster_key``) goes with every call: the nodes' ``/pd/`` endpoints
    require it when the cluster has one. ``on_refused`` is told of every node whose port refused a
    connection (nothing listens there: the process is gone), before the caller sees the error.
    """

    def __init__(self, connect_timeout_s: float = CONNECT_TIMEOUT_S, cluster_key: Optional[str] = None,
                 on_refused: RefusalListener = _ignore_refusal) -> None:
        # Streams released to end by themselves (NodeStream.release), held until they do.
        self._released: Set[NodeStream] = set()
        self._on_refused = on_refused
        # No read timeout here: the request flow bounds every wait with its phase deadlines.
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            # Every stream on a fresh connection: a stream the master stops mid-body must never
            # leave a half-read connection in a pool for the next request (its stale bytes would
            # end that request's stream). A loopback connect costs far less than a token.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
            headers=cluster_key_headers(cluster_key),
            trust_env=False,
        )

    def stream(self, node: NodeInfo, path: str, body: Dict[str, Any], sink: Sink) -> NodeStream:
        """Open ``path`` on ``node`` with ``body``; its lines go to ``sink``."""
        return NodeStream(self._client, node, path, body, sink, self._released, self._on_refused).start()

    async def post_json(self, node: NodeInfo, path: str, body: Dict[str, Any], timeout_s: float) -> Dict[str, Any]:
        """POST ``body`` and return the JSON answer; :class:`NodeCallError` on any failure."""
        url = f"http://{node.http_address}{path}"
        timeout = httpx.Timeout(timeout_s)
        try:
            response = await self._client.post(url, json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            failure = _call_failure(node, path, exc, timeout)
            if isinstance(exc, httpx.ConnectError):
                self._on_refused(node, str(failure))
            raise failure from None
        if response.status_code != 200:
            raise _answer_failure(node, response, response.content, self._on_refused)
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise NodeCallError(node, f"{node.describe()} answered {path} with something other than a JSON object")
        return answer

    async def aclose(self) -> None:
        """Close every released stream still open, then every pooled connection."""
        for stream in list(self._released):
            await stream.close()
        await self._client.aclose()
