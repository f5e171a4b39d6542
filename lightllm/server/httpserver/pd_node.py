"""The HTTP process's PD node side: transfer setup per epoch and the per-request PD event stream.

A prefill or decode node's :class:`~.manager.HttpServerManager` owns one :class:`PdNodeState`.
It sends :class:`PdTransferSetup` to model rank 0 (which broadcasts it to every rank) and
waits for rank 0's :class:`PdSetupDone`; it tracks the current epoch and whether a rank
reported its transfer group broken.  :func:`pd_generate` runs one request's
:class:`~lightllm.server.core.objs.request_spec.RequestSpec` (its PD kind set by the node's wire
format) through the manager's normal ``generate`` and translates what comes back
(tokens and finish reasons from the detokenizer, :class:`PdNotice` messages from rank 0) into
:class:`~.pd_node_events.PdNodeEvent` values.

Ordering: rank 0 sends a request's notices straight to this process before it publishes the
tokens or finish they precede, while tokens travel through the detokenizer; "reserved" is
delivered in the request's own event queue, and the details of a transfer's outcome (seconds,
bytes, why it failed) are kept per request and read when the matching token or finish arrives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, List, Optional

import zmq

from lightllm.server.core.objs.io_messages import PdChannelBroken, PdNotice, PdSetupDone, PdTransferSetup
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_PREFILL
from lightllm.server.pd.protocol.node_events import (
    BUSY,
    ERROR,
    HANDED_OFF,
    RESERVED,
    SEGMENT_END,
    TOKEN,
    PdNodeEvent,
)
from lightllm.server.manager_errors import ServerBusyError, ServerUnavailableError
from lightllm.server.request_manager import GenerationEvent
from lightllm.utils.process_utils import zmq_socket
from lightllm.server.run_mode import PD_NODE_MODES

if TYPE_CHECKING:
    from lightllm.server.httpserver.manager import HttpServerManager

log = logging.getLogger("lightllm.httpserver.pd_node")

PD_NODE_MESSAGES = (PdSetupDone, PdNotice, PdChannelBroken)
PD_NODE_ROLES = PD_NODE_MODES

# Finish reasons (FINISH_REASON_NAMES) of the PD statuses, and what each becomes.
_SEGMENT_REASONS = {"segment_kv_pressure": "kv_pressure", "segment_limit": "segment_limit"}
_CLIENT_REASONS = ("stop", "length")
# How long a transfer failure waits for rank 0's notice naming its kind (normally already here).
_DETAIL_WAIT_SECONDS = 0.5

# How long a segment waits for the previous segment of the same request id to release its slot
# on this node (normally milliseconds: its finish is already on the way); after that the id is
# refused as in use.
SEGMENT_ID_REUSE_WAIT_S = 5.0


class PdNodeState:
    """One PD node's transfer epoch and per-request transfer details (HTTP process, event loop only)."""

    def __init__(self, role: str, setup_timeout_seconds: float):
        if role not in PD_NODE_ROLES:
            raise ValueError(f"a PD node's role must be one of {PD_NODE_ROLES}, got {role!r}")
        self.role = role
        self.setup_timeout_seconds = setup_timeout_seconds
        self.epoch: Optional[int] = None
        self.broken_reason: Optional[str] = None
        self._to_rank0 = None
        self._setup_lock: Optional[asyncio.Lock] = None
        self._setup_waiters: Dict[int, asyncio.Future] = {}
        # request id -> notice kind -> the latest notice (only while the request is pending).
        self.details: Dict[int, Dict[str, PdNotice]] = {}

    def start(self, zmq_ctx: Any, rank0_address: str) -> None:
        """Open the push socket to model rank 0 (on the manager's event loop)."""
        self._to_rank0 = zmq_socket(zmq_ctx, zmq.PUSH, rank0_address, bind=False)
        self._setup_lock = asyncio.Lock()

    def on_message(self, message: Any, pending: Dict[int, Any]) -> None:
        """Apply one message from rank 0 (the manager's receive loop calls this)."""
        if isinstance(message, PdSetupDone):
            waiter = self._setup_waiters.pop(message.epoch, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(message)
        elif isinstance(message, PdChannelBroken):
            if message.epoch == self.epoch:
                log.warning("KV transfer of epoch %d broken: %s", message.epoch, message.reason)
                self.broken_reason = message.reason
        elif isinstance(message, PdNotice):
            request = pending.get(message.request_id)
            if request is None:
                return
            if message.kind == RESERVED:
                request.deliver_notice(message)
            else:
                self.details.setdefault(message.request_id, {})[message.kind] = message

    async def transfer_setup(self, epoch: int, prefill_transfer_address: str) -> None:
        """(Re)start every rank's transfer handle for ``epoch``; raises on failure or timeout."""
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise ValueError(f"epoch must be an int, got {epoch!r}")
        host, port = "", 0
        if self.role == "decode":
            host, port = parse_transfer_address(prefill_transfer_address)
        async with self._setup_lock:
            waiter = asyncio.get_running_loop().create_future()
            self._setup_waiters[epoch] = waiter
            # Requests of the old epoch fail from now on (their handles are being replaced).
            self.epoch, self.broken_reason = None, None
            try:
                await self._to_rank0.send_pyobj(PdTransferSetup(epoch, host, port))
                done: PdSetupDone = await asyncio.wait_for(waiter, self.setup_timeout_seconds)
            except asyncio.TimeoutError:
                raise RuntimeError(f"KV transfer setup for epoch {epoch} got no answer from model rank 0 "
                                   f"within {self.setup_timeout_seconds:g} s") from None
            finally:
                self._setup_waiters.pop(epoch, None)
            if done.error:
                raise RuntimeError(done.error)
            self.epoch = epoch
            log.info("KV transfer set up for epoch %d (%s)", epoch, self.role)

    async def detail(self, request_id: int, kind: str, wait: bool) -> Optional[PdNotice]:
        """The request's notice of ``kind`` (waiting briefly for it when ``wait``), or None."""
        if wait:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + _DETAIL_WAIT_SECONDS
            while kind not in self.details.get(request_id, {}) and loop.time() < deadline:
                await asyncio.sleep(0.01)
        return self.details.get(request_id, {}).get(kind)


def parse_transfer_address(address: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); ``ValueError`` naming the address when it is not one."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"prefill_transfer_address must be host:port, got {address!r}")
    return host, int(port)


def _error(message: str, error_kind: str, transfer_broken: bool = False) -> PdNodeEvent:
    return PdNodeEvent(ERROR, message=message, error_kind=error_kind, transfer_broken=transfer_broken)


async def pd_generate(
    manager: "HttpServerManager",
    spec: RequestSpec,
    *,
    request_id: int,
    epoch: int,
    request: Any = None,
) -> AsyncIterator[PdNodeEvent]:
    """One PD request on this node (see ``HttpServerManager.pd_generate``)."""
    state: PdNodeState = manager.pd
    if state.epoch is None or epoch != state.epoch:
        yield _error(f"request {request_id}: this node's KV transfer is not set up for epoch {epoch} "
                     f"(current: {state.epoch})", "epoch", transfer_broken=True)
        return
    if state.broken_reason is not None:
        yield _error(f"request {request_id}: this node's KV transfer of epoch {epoch} is broken: "
                     f"{state.broken_reason}", "transfer_broken", transfer_broken=True)
        return
    decode = state.role == "decode"
    expected_kind = PD_KIND_DECODE if decode else PD_KIND_PREFILL
    if not isinstance(spec, RequestSpec) or spec.pd.kind != expected_kind:
        # kv_start travels only with a prefill kind (the spec refuses it otherwise), so this
        # also keeps a decode node from being told where the KV starts: it chooses that itself.
        raise ValueError(f"a {state.role} node runs requests of PD kind {expected_kind} only, got "
                         f"{spec.pd.kind if isinstance(spec, RequestSpec) else type(spec).__name__}")
    # The previous segment of this request may still be releasing its slot here.
    await manager.wait_request_id_free(request_id, SEGMENT_ID_REUSE_WAIT_S)
    events = manager.generate(
        spec, request=request, request_id=request_id,
        # A decode node answers busy at once when no request slot is free, never after a wait.
        slot_wait_seconds=0.0 if decode else None,
    )
    first_token = True
    try:
        try:
            async for item in events:
                if isinstance(item, PdNotice):
                    yield PdNodeEvent(RESERVED, kv_start=item.kv_start)
                    continue
                for event in await _translate(state, request_id, item, decode and first_token):
                    if event.kind == TOKEN:
                        first_token = False
                    yield event
        except ServerBusyError as exc:
            yield PdNodeEvent(BUSY, message=f"request {request_id}: {exc}")
        except ServerUnavailableError as exc:
            yield _error(f"request {request_id}: {exc}", "internal")
    finally:
        await events.aclose()
        state.details.pop(request_id, None)


async def _translate(state: PdNodeState, request_id: int, event: GenerationEvent, first_on_decode: bool) -> List[PdNodeEvent]:
    reason = event.finish_reason
    out: List[PdNodeEvent] = []
    if event.token_id >= 0:
        token = event if reason is None or reason in _CLIENT_REASONS else dataclasses.replace(event, finish_reason=None)
        token_event = PdNodeEvent(TOKEN, token=token)
        if first_on_decode:
            stats = await state.detail(request_id, "transferred", wait=False)
            if stats is not None:
                token_event.transfer_seconds, token_event.transfer_bytes = stats.seconds, stats.nbytes
        out.append(token_event)
    elif reason in _CLIENT_REASONS:
        # A finish without a new token (the event protocol allows one; the detokenizer now reads
        # a step's last token and status together, so length/stop normally carry a token) goes
        # out as a token-less finish, which the master reads as the end of the request; dropped,
        # the stream would end without a result.
        out.append(PdNodeEvent(TOKEN, token=event))
    if reason is None or reason in _CLIENT_REASONS:
        return out
    if reason == "handed_off":
        stats = await state.detail(request_id, "transferred", wait=True)
        done = PdNodeEvent(HANDED_OFF)
        if stats is not None:
            done.transfer_seconds, done.transfer_bytes = stats.seconds, stats.nbytes
        out.append(done)
    elif reason == "busy":
        # Rank 0's notice names the limit it hit (KV tokens or request slots) with its numbers.
        busy = await state.detail(request_id, "busy", wait=True)
        why = busy.message if busy is not None else "no KV or request slot to reserve for it now"
        out.append(PdNodeEvent(BUSY, message=f"request {request_id}: {why}"))
    elif reason in _SEGMENT_REASONS:
        out.append(PdNodeEvent(SEGMENT_END, reason=_SEGMENT_REASONS[reason]))
    elif reason == "transfer_failed":
        failure = await state.detail(request_id, "transfer_failed", wait=True)
        kind = failure.error_kind if failure is not None else "transfer_failed"
        message = failure.message if failure is not None else f"request {request_id}: the KV transfer failed"
        out.append(_error(message, kind, transfer_broken=kind == "transfer_broken"))
    else:  # "error", "abort" (a stop string never ends a PD node's request: the master decides)
        out.append(_error(f"request {request_id} ended on the node: {reason}", "internal"))
    return out
