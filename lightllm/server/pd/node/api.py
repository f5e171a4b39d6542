"""The control endpoints of a PD prefill or decode node, called by the PD master only.

Mounted through ``create_app(..., extra_routers=[...])`` on nodes started with
``--run_mode prefill|decode`` (see docs/EN/pd_deployment.md for the flow):

* ``POST /pd/node/transfer_setup`` ``{"epoch", "peer_node_id", "prefill_transfer_address"}``
  -> ``{"epoch"}`` once rank 0 applied it.  A node holds one such pair per connected peer.
* ``POST /pd/node/transfer_teardown`` ``{"epoch"}`` -> ``{"epoch", "known"}``: drop that pair
  (its peer left); idempotent, an epoch the node does not know answers ``"known": false``.
* ``POST /pd/node/decode`` (decode nodes) and ``POST /pd/node/prefill`` (prefill nodes): a
  request as JSON (:mod:`lightllm.server.pd.protocol.stream_lines`), answered with an NDJSON stream
  (``application/x-ndjson``, one JSON object per line, each with an ``"event"`` key).  The
  other role's path answers 404 naming the role that serves it.  A draining node (it got
  SIGTERM) answers a new request with a ``busy`` line saying so.  A request whose id is still
  open here replaces it (:meth:`PdStreams.supersede`): the master sends a new placement of a
  request only after giving the previous one up.

The endpoints call the node's :class:`~lightllm.server.pd.node.service.PdNodeService`, never
the request manager directly.

Errors found before a stream starts (an invalid body, a request the node refuses, a node
shutting down) are the API's usual ``{"error": {...}}`` bodies with their HTTP status; once the
stream has started they are an ``error`` line.  A stream the master closes early, and every
stream when the node loses its master (:meth:`PdStreams.fail_all`), stops its request on the
node: the node's request iterator is closed, which aborts the request and frees its KV.

A PD node serves no public generation: :func:`public_api_refusal_router` answers the native and
OpenAI generation endpoints with a 400 that points to the master (a decode node cannot prefill
a prompt alone and a prefill node never decodes).  ``/health``, ``/metrics`` and
``/v1/models`` keep working.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Optional, Set, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from lightllm.server.http.body import parse_body, parse_body_off_loop
from lightllm.server.http.errors import (
    INVALID_REQUEST,
    NOT_FOUND,
    SERVICE_UNAVAILABLE,
    APIError,
    JSONErrorRoute,
    manager_error,
)
from lightllm.server.pd.protocol.node_events import PdNodeEvent
from lightllm.server.manager_errors import ServerBusyError, ServerUnavailableError
from lightllm.server.pd.node.metrics import PdNodeMetrics
from lightllm.server.pd.protocol.membership import TRANSFER_TEARDOWN_PATH
from lightllm.server.pd.protocol.stream_lines import (
    NDJSON_MEDIA_TYPE,
    DecodeBody,
    PrefillBody,
    TransferSetupBody,
    error_fields,
    event_line,
    ndjson,
    request_spec_of,
)
from lightllm.server.run_mode import RunMode

logger = logging.getLogger("lightllm.pd.node_api")

TRANSFER_SETUP_PATH = "/pd/node/transfer_setup"
DECODE_PATH = "/pd/node/decode"
PREFILL_PATH = "/pd/node/prefill"
ROLE_PATHS = {"decode": DECODE_PATH, "prefill": PREFILL_PATH}
# The public generation endpoints a PD node refuses.
PUBLIC_GENERATION_PATHS = ("/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions")
PD_NODE_CODE = "pd_node_not_public"
# Events after which a node stream ends (a finishing token ends it when the iterator ends).
_LAST_KINDS = frozenset({"busy", "segment_end", "error", "handed_off"})
_END = object()
# Put in a stream's queue when its client (the master) went away.
_GONE = object()
# How often a request checks whether the master is still connected (waiting for its first
# event, and while its stream is open).
FIRST_EVENT_POLL_SECONDS = 0.5


class TransferTeardownBody(BaseModel):
    """``POST /pd/node/transfer_teardown``: drop this node's KV transfer pair of ``epoch``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    epoch: int = Field(ge=0)


class _NodeStream:
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
            self._queue.put_nowait(_END)
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
        """The next event, a failure, or ``_END``."""
        return await self._queue.get()

    def abandon(self) -> None:
        """The client went away: stop the request and end the stream without a line."""
        self._queue.put_nowait(_GONE)
        self._pump.cancel()

    def fail(self, message: str) -> None:
        """End the stream with an error line and stop the request (called on the event loop)."""
        self._queue.put_nowait(PdNodeEvent(kind="error", message=message, error_kind="internal"))
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
        self._open: Set[_NodeStream] = set()

    def __len__(self) -> int:
        return len(self._open)

    def add(self, stream: _NodeStream) -> None:
        self._open.add(stream)

    def discard(self, stream: _NodeStream) -> None:
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


async def _first_item(stream: _NodeStream, request: Request) -> Any:
    """The stream's first item, or None when the client disconnects before it comes.

    The answer's status depends on the first item, so no byte is sent until then; a prefill
    node's first token may wait in the queue for long, and a master that gave up meanwhile must
    not leave the request running.
    """
    getter = asyncio.ensure_future(stream.next())
    while True:
        done, _ = await asyncio.wait({getter}, timeout=FIRST_EVENT_POLL_SECONDS)
        if done:
            return getter.result()
        if await request.is_disconnected():
            getter.cancel()
            return None


async def _watch_disconnect(stream: _NodeStream, request: Request) -> None:
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


def _failure_message(exc: BaseException) -> str:
    if isinstance(exc, (ServerUnavailableError, ServerBusyError, ValueError, TimeoutError)):
        return str(exc) or type(exc).__name__
    return "internal error on the PD node; see the node log"


def _error_status(exc: BaseException) -> APIError:
    if isinstance(exc, TimeoutError):
        return APIError(503, str(exc) or "timed out", SERVICE_UNAVAILABLE, None, "pd_node_timeout")
    return manager_error(exc)  # logs unexpected exceptions


def _wrong_role(node_role: str, path: str, other_role: str) -> Response:
    message = f"This is a PD {node_role} node; {path} is served by {other_role} nodes"
    return APIError(404, message, NOT_FOUND, None, "wrong_pd_role").to_response()


def pd_node_router(node: Any, run_mode: str, streams: Optional[PdStreams] = None) -> APIRouter:
    """An APIRouter with the node control endpoints of a ``run_mode`` (prefill|decode) node.

    ``node`` is the node's :class:`~lightllm.server.pd.node.service.PdNodeService` (or one
    with its ``transfer_setup``, ``transfer_teardown``, ``generate``, ``metrics_registry``,
    ``vocab_size`` and ``max_req_total_len``); ``streams`` collects the open streams so the caller can fail them
    when the master is lost.
    """
    if run_mode not in ROLE_PATHS:
        raise ValueError(f"PD node endpoints exist for run modes prefill and decode, not {run_mode!r}")
    streams = streams if streams is not None else PdStreams()
    metrics = PdNodeMetrics(node.metrics_registry, run_mode)
    is_prefill = run_mode == RunMode.PREFILL
    router = APIRouter(route_class=JSONErrorRoute)

    async def transfer_setup(request: Request) -> Response:
        body = parse_body(await request.body(), TransferSetupBody)
        try:
            await node.transfer_setup(body.epoch, body.prefill_transfer_address)
        except ValueError as exc:
            raise APIError(400, str(exc), INVALID_REQUEST, None, "pd_transfer_setup_refused") from None
        except Exception as exc:  # noqa: BLE001 - the master must learn why and may retry
            logger.error("KV transfer setup for epoch %d with %s (%s) failed: %s", body.epoch, body.peer_node_id,
                         body.prefill_transfer_address, exc, exc_info=not isinstance(exc, (TimeoutError, RuntimeError)))
            message = f"KV transfer setup for epoch {body.epoch} failed on this {run_mode} node: {exc}"
            raise APIError(503, message, SERVICE_UNAVAILABLE, None, "pd_transfer_setup_failed") from None
        logger.info("KV transfer set up for epoch %d (peer %s, prefill transfer address %s)", body.epoch,
                    body.peer_node_id, body.prefill_transfer_address)
        return JSONResponse({"epoch": body.epoch})

    async def transfer_teardown(request: Request) -> Response:
        body = parse_body(await request.body(), TransferTeardownBody)
        try:
            known = await node.transfer_teardown(body.epoch)
        except ValueError as exc:
            raise APIError(400, str(exc), INVALID_REQUEST, "epoch", "pd_transfer_teardown_refused") from None
        except Exception as exc:  # noqa: BLE001 - the master must learn why and may retry
            logger.error("KV transfer teardown of epoch %d failed: %s", body.epoch, exc,
                         exc_info=not isinstance(exc, RuntimeError))
            message = f"KV transfer teardown of epoch {body.epoch} failed on this {run_mode} node: {exc}"
            raise APIError(503, message, SERVICE_UNAVAILABLE, None, "pd_transfer_teardown_failed") from None
        return JSONResponse({"epoch": body.epoch, "known": known})

    async def node_request(request: Request) -> Response:
        body_type = PrefillBody if is_prefill else DecodeBody
        # A long prompt's ids make a large body: decoded off the event loop, like a public request's.
        body = await parse_body_off_loop(await request.body(), body_type)
        spec = request_spec_of(body, node.vocab_size, node.max_req_total_len)
        if streams.supersede(body.request_id):
            logger.info("request %d: placed here again by the master; the previous placement is ended",
                        body.request_id)
        try:
            events = node.generate(spec, request_id=body.request_id, epoch=body.epoch, request=request)
        except Exception as exc:  # noqa: BLE001 - a refusal before any event is an HTTP error
            return _error_status(exc).to_response()
        stream = _NodeStream(events, body.request_id)
        # Registered at once: losing the master must also end a request still waiting for its first event.
        streams.add(stream)
        first = await _first_item(stream, request)
        if first is None or first is _GONE:  # the master went away (or placed the request again) before the first event
            streams.discard(stream)
            await stream.close()
            return Response(status_code=499)
        if isinstance(first, ServerBusyError):
            # No free request slot: a busy answer at once, as for no free KV (the master may retry).
            first = PdNodeEvent(kind="busy", message=str(first) or "no free request slot")
        if first is _END or isinstance(first, BaseException):
            streams.discard(stream)
            await stream.close()
            if first is _END:
                logger.error("request %d: the node produced no event", body.request_id)
                first = RuntimeError("the node produced no event")
            assert isinstance(first, BaseException)
            return _error_status(first).to_response()
        return StreamingResponse(_lines(stream, first, request), media_type=NDJSON_MEDIA_TYPE)

    async def _lines(stream: _NodeStream, item: Any, request: Request) -> AsyncIterator[bytes]:
        ended = False  # a token with a finish reason or a last kind was sent
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(stream, request))
        try:
            while item is not _END:
                if isinstance(item, BaseException):
                    expected = isinstance(item, (ValueError, ServerUnavailableError, TimeoutError))
                    logger.error("request %d failed on the node: %s", stream.request_id, item,
                                 exc_info=None if expected else item)
                    yield ndjson(error_fields(_failure_message(item)))
                    return
                metrics.observe(item)
                yield event_line(item, with_prompt_logprobs=is_prefill)
                if item.kind in _LAST_KINDS:
                    return
                ended = item.kind == "token" and item.token is not None and item.token.finish_reason is not None
                item = await stream.next()
                if item is _GONE:  # the master closed the stream: the request is stopped, its KV freed
                    return
            if not ended and not await request.is_disconnected():
                # Never a silent end: the master must learn the request is over here.  (A master
                # that closed the stream ended the request itself: nothing is owed to it.)
                logger.error("request %d ended on the node without a result", stream.request_id)
                yield ndjson(error_fields(f"request {stream.request_id} ended on the {run_mode} node without a result",
                                          error_kind="internal"))
        finally:
            watcher.cancel()
            streams.discard(stream)
            await stream.close()

    async def other_role(request: Request) -> Response:
        other = "decode" if is_prefill else "prefill"
        return _wrong_role(run_mode, request.url.path, other)

    router.add_api_route(TRANSFER_SETUP_PATH, transfer_setup, methods=["POST"])
    router.add_api_route(TRANSFER_TEARDOWN_PATH, transfer_teardown, methods=["POST"])
    router.add_api_route(ROLE_PATHS[run_mode], node_request, methods=["POST"])
    router.add_api_route(ROLE_PATHS["decode" if is_prefill else "prefill"], other_role, methods=["POST"],
                         include_in_schema=False)
    return router


def public_api_refusal_router(run_mode: str, master_address: str) -> APIRouter:
    """Answers a PD node's public generation endpoints with a 400 that points to the master.

    Included before the public API, so these routes win over the native and OpenAI ones.
    """
    router = APIRouter()
    message = (
        f"This is a PD {run_mode} node; it serves generation only for its PD master. Send requests to the "
        f"PD master at {master_address}"
    )

    async def refuse() -> Response:
        return APIError(400, message, INVALID_REQUEST, None, PD_NODE_CODE).to_response()

    for path in PUBLIC_GENERATION_PATHS:
        router.add_api_route(path, refuse, methods=["POST"], include_in_schema=False)
    return router
