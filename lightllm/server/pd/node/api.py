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
  open here replaces it (:meth:`~.open_streams.PdStreams.supersede`): the master sends a new placement of a
  request only after giving the previous one up.

The endpoints are the handlers of :class:`PdNodeEndpoints`; they call the node's
:class:`~lightllm.server.pd.node.service.PdNodeService` (what they use of it is
:class:`PdNodeControl`), never the request manager directly.  The open streams are
:mod:`.open_streams`'s.

Errors found before a stream starts (an invalid body, a request the node refuses, a node
shutting down) are the API's usual ``{"error": {...}}`` bodies with their HTTP status; once the
stream has started they are an ``error`` line.  A stream the master closes early, and every
stream when the node loses its master (:meth:`~.open_streams.PdStreams.fail_all`), stops its request on the
node: the node's request iterator is closed, which aborts the request and frees its KV.

A PD node serves no public generation: :func:`public_api_refusal_router` answers the native and
OpenAI generation endpoints with a 400 that points to the master (a decode node cannot prefill
a prompt alone and a prefill node never decodes).  ``/health``, ``/metrics`` and
``/v1/models`` keep working.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Optional, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from lightllm.server.http.validation.body import parse_body, parse_body_off_loop
from lightllm.server.http.errors import (
    INVALID_REQUEST,
    NOT_FOUND,
    SERVICE_UNAVAILABLE,
    APIError,
    JSONErrorRoute,
    manager_error,
)
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.pd.protocol.node_events import BUSY, ERROR, HANDED_OFF, SEGMENT_END, TOKEN, PdNodeEvent
from lightllm.server.manager_errors import ServerBusyError, ServerUnavailableError
from lightllm.server.pd.node.metrics import PdNodeMetrics
from lightllm.server.pd.node.open_streams import END, GONE, NodeStream, PdStreams, first_item, watch_disconnect
from lightllm.server.pd.node.request_bodies import request_spec_of
from lightllm.server.pd.protocol.membership import ROLE_PATHS, TRANSFER_SETUP_PATH, TRANSFER_TEARDOWN_PATH
from lightllm.server.pd.protocol.stream_lines import (
    NDJSON_MEDIA_TYPE,
    DecodeBody,
    PrefillBody,
    TransferSetupBody,
    error_fields,
    event_line,
    ndjson,
)
from lightllm.server.run_mode import RunMode

logger = logging.getLogger(__name__)

# The public generation endpoints a PD node refuses.
PUBLIC_GENERATION_PATHS = ("/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions")
PD_NODE_CODE = "pd_node_not_public"
# Events after which a node stream ends (a finishing token ends it when the iterator ends).
_LAST_KINDS = frozenset({BUSY, SEGMENT_END, ERROR, HANDED_OFF})

__all__ = ["PdNodeControl", "PdNodeEndpoints", "TransferTeardownBody", "pd_node_router",
           "public_api_refusal_router"]


class TransferTeardownBody(BaseModel):
    """``POST /pd/node/transfer_teardown``: drop this node's KV transfer pair of ``epoch``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    epoch: int = Field(ge=0)


class PdNodeControl(Protocol):
    """What the control endpoints use of the node (:class:`~lightllm.server.pd.node.service.PdNodeService`)."""

    @property
    def vocab_size(self) -> int:
        """The served model's vocabulary size (a body's token ids are checked against it)."""

    @property
    def max_req_total_len(self) -> int:
        """The longest prompt plus generation a request may have here."""

    @property
    def metrics_registry(self) -> Any:
        """The registry of the node's /metrics, where the PD node metrics go."""

    async def transfer_setup(self, epoch: int, prefill_transfer_address: str) -> None:
        """Set up the KV transfer pair of ``epoch``; ``ValueError`` for arguments it refuses."""

    async def transfer_teardown(self, epoch: int) -> bool:
        """Drop the KV transfer pair of ``epoch``; False if it was not known here."""

    def generate(self, spec: RequestSpec, *, request_id: int, epoch: int,
                 request: Any = None) -> AsyncIterator[PdNodeEvent]:
        """The request's events under the master's ``request_id``; closing the iterator aborts it."""


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


class PdNodeEndpoints:
    """The control endpoints of a ``run_mode`` (prefill|decode) node, bound to its service.

    Args:
        node: the node's service (:class:`PdNodeControl`).
        run_mode: ``prefill`` or ``decode`` (anything else is a ``ValueError``).
        streams: collects the open streams, so the caller can fail them when the master is lost
            (None: a collection of its own).
    """

    def __init__(self, node: PdNodeControl, run_mode: str, streams: Optional[PdStreams] = None) -> None:
        if run_mode not in ROLE_PATHS:
            raise ValueError(f"PD node endpoints exist for run modes prefill and decode, not {run_mode!r}")
        self.node = node
        self.run_mode = run_mode
        self.streams = streams if streams is not None else PdStreams()
        self.metrics = PdNodeMetrics(node.metrics_registry, run_mode)
        self.is_prefill = run_mode == RunMode.PREFILL

    def router(self) -> APIRouter:
        """An APIRouter with the transfer setup and teardown, this role's request path and the other role's 404."""
        router = APIRouter(route_class=JSONErrorRoute)
        router.add_api_route(TRANSFER_SETUP_PATH, self.transfer_setup, methods=["POST"])
        router.add_api_route(TRANSFER_TEARDOWN_PATH, self.transfer_teardown, methods=["POST"])
        router.add_api_route(ROLE_PATHS[self.run_mode], self.node_request, methods=["POST"])
        router.add_api_route(ROLE_PATHS[self._other_role], self.other_role, methods=["POST"], include_in_schema=False)
        return router

    @property
    def _other_role(self) -> str:
        return "decode" if self.is_prefill else "prefill"

    async def transfer_setup(self, request: Request) -> Response:
        """``POST /pd/node/transfer_setup``: ``{"epoch"}`` once the pair is set up; 400 refused, 503 failed."""
        body = parse_body(await request.body(), TransferSetupBody)
        try:
            await self.node.transfer_setup(body.epoch, body.prefill_transfer_address)
        except ValueError as exc:
            raise APIError(400, str(exc), INVALID_REQUEST, None, "pd_transfer_setup_refused") from None
        except Exception as exc:  # noqa: BLE001 - the master must learn why and may retry
            logger.error("KV transfer setup for epoch %d with %s (%s) failed: %s", body.epoch, body.peer_node_id,
                         body.prefill_transfer_address, exc, exc_info=not isinstance(exc, (TimeoutError, RuntimeError)))
            message = f"KV transfer setup for epoch {body.epoch} failed on this {self.run_mode} node: {exc}"
            raise APIError(503, message, SERVICE_UNAVAILABLE, None, "pd_transfer_setup_failed") from None
        logger.info("KV transfer set up for epoch %d (peer %s, prefill transfer address %s)", body.epoch,
                    body.peer_node_id, body.prefill_transfer_address)
        return JSONResponse({"epoch": body.epoch})

    async def transfer_teardown(self, request: Request) -> Response:
        """``POST /pd/node/transfer_teardown``: ``{"epoch", "known"}``; 400 refused, 503 failed."""
        body = parse_body(await request.body(), TransferTeardownBody)
        try:
            known = await self.node.transfer_teardown(body.epoch)
        except ValueError as exc:
            raise APIError(400, str(exc), INVALID_REQUEST, "epoch", "pd_transfer_teardown_refused") from None
        except Exception as exc:  # noqa: BLE001 - the master must learn why and may retry
            logger.error("KV transfer teardown of epoch %d failed: %s", body.epoch, exc,
                         exc_info=not isinstance(exc, RuntimeError))
            message = f"KV transfer teardown of epoch {body.epoch} failed on this {self.run_mode} node: {exc}"
            raise APIError(503, message, SERVICE_UNAVAILABLE, None, "pd_transfer_teardown_failed") from None
        return JSONResponse({"epoch": body.epoch, "known": known})

    async def node_request(self, request: Request) -> Response:
        """``POST /pd/node/prefill`` or ``/pd/node/decode``: the request's NDJSON stream, or an error status
        (499 when the master left before the first event)."""
        body_type = PrefillBody if self.is_prefill else DecodeBody
        # A long prompt's ids make a large body: decoded off the event loop, like a public request's.
        body = await parse_body_off_loop(await request.body(), body_type)
        spec = request_spec_of(body, self.node.vocab_size, self.node.max_req_total_len)
        if self.streams.supersede(body.request_id):
            logger.info("request %d: placed here again by the master; the previous placement is ended",
                        body.request_id)
        try:
            events = self.node.generate(spec, request_id=body.request_id, epoch=body.epoch, request=request)
        except Exception as exc:  # noqa: BLE001 - a refusal before any event is an HTTP error
            return _error_status(exc).to_response()
        stream = NodeStream(events, body.request_id)
        # Registered at once: losing the master must also end a request still waiting for its first event.
        self.streams.add(stream)
        first = await first_item(stream, request)
        if first is None or first is GONE:  # the master went away (or placed the request again) before the first event
            self.streams.discard(stream)
            await stream.close()
            return Response(status_code=499)
        if isinstance(first, ServerBusyError):
            # No free request slot: a busy answer at once, as for no free KV (the master may retry).
            first = PdNodeEvent(kind=BUSY, message=str(first) or "no free request slot")
        if first is END or isinstance(first, BaseException):
            self.streams.discard(stream)
            await stream.close()
            if first is END and await request.is_disconnected():
                # The master gave up (its client left) as the request ended: nothing failed here.
                logger.info("request %d: the master went away before the first event", body.request_id)
                return Response(status_code=499)
            if first is END:
                logger.error("request %d: the node produced no event", body.request_id)
                first = RuntimeError("the node produced no event")
            assert isinstance(first, BaseException)
            return _error_status(first).to_response()
        return StreamingResponse(self._lines(stream, first, request), media_type=NDJSON_MEDIA_TYPE)

    async def _lines(self, stream: NodeStream, item: Any, request: Request) -> AsyncIterator[bytes]:
        ended = False  # a token with a finish reason or a last kind was sent
        watcher = asyncio.get_running_loop().create_task(watch_disconnect(stream, request))
        try:
            while item is not END:
                if isinstance(item, BaseException):
                    expected = isinstance(item, (ValueError, ServerUnavailableError, TimeoutError))
                    logger.error("request %d failed on the node: %s", stream.request_id, item,
                                 exc_info=None if expected else item)
                    yield ndjson(error_fields(_failure_message(item)))
                    return
                self.metrics.observe(item)
                yield event_line(item, with_prompt_logprobs=self.is_prefill)
                if item.kind in _LAST_KINDS:
                    return
                ended = item.kind == TOKEN and item.token is not None and item.token.finish_reason is not None
                item = await stream.next()
                if item is GONE:  # the master closed the stream: the request is stopped, its KV freed
                    return
            if not ended and not await request.is_disconnected():
                # Never a silent end: the master must learn the request is over here.  (A master
                # that closed the stream ended the request itself: nothing is owed to it.)
                logger.error("request %d ended on the node without a result", stream.request_id)
                yield ndjson(error_fields(f"request {stream.request_id} ended on the {self.run_mode} node "
                                          f"without a result", error_kind="internal"))
        finally:
            watcher.cancel()
            self.streams.discard(stream)
            await stream.close()

    async def other_role(self, request: Request) -> Response:
        """The other role's request path: 404 naming the role that serves it."""
        return _wrong_role(self.run_mode, request.url.path, self._other_role)


def pd_node_router(node: PdNodeControl, run_mode: str, streams: Optional[PdStreams] = None) -> APIRouter:
    """The router of :class:`PdNodeEndpoints` (``node``, ``run_mode``, ``streams``), as the node's launcher mounts it."""
    return PdNodeEndpoints(node, run_mode, streams).router()


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
