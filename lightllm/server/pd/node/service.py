"""A PD node's HTTP-side service: transfer setup per epoch and each PD request's event stream.

A prefill or decode node's HTTP process composes one :class:`PdNodeService` around its request
manager (:mod:`lightllm.server.launch.pd_node`); the node's control endpoints
(:mod:`lightllm.server.pd.node.api`) call the service, and the service calls the manager through
the narrow :class:`PdNodeHost` interface only.  The manager knows nothing of PD: the service
registers an inbox handler for rank 0's PD messages and posts a request's notices into that
request's own event stream.

* :meth:`PdNodeService.transfer_setup` sends :class:`PdTransferSetup` to model rank 0 (which
  hands it to every rank) and waits for rank 0's :class:`PdSetupDone`.
* :meth:`PdNodeService.generate` runs one request's
  :class:`~lightllm.server.core.objs.request_spec.RequestSpec` (its PD kind set by the node's
  wire format) through the manager's ``generate`` and turns what comes back into
  :class:`~lightllm.server.pd.protocol.node_events.PdNodeEvent` values (:func:`translate`).

Ordering: rank 0 puts its PD messages in its step output stream (``StepOutput.notices``), ahead
of the tokens and finish of the same step, and the detokenizer forwards them in that place; so a
request's notice (reserved, transferred, transfer_failed, busy) is in its event stream before the
token or finish it explains, and nothing here waits for one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, AsyncIterator, Callable, Dict, List, Mapping, Optional, Protocol, Tuple, Type

import zmq
import zmq.asyncio

from lightllm.server.core.objs.io_messages import PdChannelBroken, PdNotice, PdSetupDone, PdTransferSetup
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_PREFILL
from lightllm.server.manager_errors import ServerBusyError, ServerUnavailableError
from lightllm.server.pd.protocol.node_events import BUSY, ERROR, HANDED_OFF, RESERVED, SEGMENT_END, TOKEN, PdNodeEvent
from lightllm.server.pd.protocol.outcomes import CLIENT_FINISH_REASONS, node_outcome
from lightllm.server.request_manager import GenerationEvent
from lightllm.server.run_mode import PD_NODE_MODES
from lightllm.utils.process_utils import zmq_socket

log = logging.getLogger("lightllm.pd.node.service")

# What rank 0 sends this process about PD (inside its step output stream).
RANK0_PD_MESSAGES: Tuple[Type[Any], ...] = (PdSetupDone, PdNotice, PdChannelBroken)

# PdNotice.kind values other than "reserved" (which becomes a stream event of its own): the
# details of an outcome whose finish or token follows in the same stream.
NOTICE_TRANSFERRED = "transferred"
NOTICE_TRANSFER_FAILED = "transfer_failed"
NOTICE_BUSY = "busy"

# How long a segment waits for the previous segment of the same request id to release its slot
# on this node (normally milliseconds: its finish is already on the way); after that the id is
# refused as in use.
SEGMENT_ID_REUSE_WAIT_S = 5.0


class PdNodeHost(Protocol):
    """What the service needs of the node's request manager (``HttpServerManager`` provides it)."""

    vocab_size: int
    max_req_total_len: int
    metrics: Any  # ``.measured``: the registry the node's /metrics renders

    def add_inbox_handler(self, message_types: Tuple[Type[Any], ...], handler: Callable[[Any], None]) -> None:
        """Call ``handler`` (on the event loop, in arrival order) for every inbox message of these types."""

    def post(self, request_id: int, item: Any) -> bool:
        """Put ``item`` into a pending request's event stream, in arrival order; False if none."""

    def generate(
        self, spec: RequestSpec, *, request: Any = None, request_id: Optional[int] = None,
        slot_wait_seconds: Optional[float] = None,
    ) -> AsyncIterator[Any]:
        """The request's events: ``GenerationEvent`` values and whatever was posted to it."""

    async def wait_request_id_free(self, request_id: int, timeout: float) -> bool:
        """Wait until ``request_id`` is no longer in use here; True if it is free."""


def parse_transfer_address(address: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); ``ValueError`` naming the address when it is not one."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"prefill_transfer_address must be host:port, got {address!r}")
    return host, int(port)


def _error(message: str, error_kind: str, transfer_broken: bool = False) -> PdNodeEvent:
    return PdNodeEvent(ERROR, message=message, error_kind=error_kind, transfer_broken=transfer_broken)


def _with_transfer(event: PdNodeEvent, transferred: Optional[PdNotice]) -> PdNodeEvent:
    if transferred is not None:
        event.transfer_seconds, event.transfer_bytes = transferred.seconds, transferred.nbytes
    return event


def translate(
    event: GenerationEvent, request_id: int, notices: Mapping[str, PdNotice], first_on_decode: bool
) -> List[PdNodeEvent]:
    """The stream events of one generation event of a PD request.

    ``notices`` holds the request's notices so far by kind (they arrive before the token or
    finish they explain); ``first_on_decode``: this is a decode node's first token, which
    carries its transfer's seconds and bytes.  The PD finish reasons are named by
    :func:`~lightllm.server.pd.protocol.outcomes.node_outcome`.
    """
    reason = event.finish_reason
    client_finish = reason is None or reason in CLIENT_FINISH_REASONS
    out: List[PdNodeEvent] = []
    if event.token_id >= 0:
        token = event if client_finish else dataclasses.replace(event, finish_reason=None)
        token_event = PdNodeEvent(TOKEN, token=token)
        out.append(_with_transfer(token_event, notices.get(NOTICE_TRANSFERRED)) if first_on_decode else token_event)
    elif reason is not None and client_finish:
        # A finish without a new token (the event protocol allows one; the detokenizer reads a
        # step's last token and status together, so length/stop normally carry a token) goes
        # out as a token-less finish, which the master reads as the end of the request; dropped,
        # the stream would end without a result.
        out.append(PdNodeEvent(TOKEN, token=event))
    if client_finish:
        return out
    outcome = node_outcome(reason)
    if outcome is None:  # "error", "abort" (a stop string never ends a PD node's request: the master decides)
        out.append(_error(f"request {request_id} ended on the node: {reason}", "internal"))
    elif outcome.event == HANDED_OFF:
        out.append(_with_transfer(PdNodeEvent(HANDED_OFF), notices.get(NOTICE_TRANSFERRED)))
    elif outcome.event == BUSY:
        # Rank 0's notice names the limit it hit (KV tokens or request slots) with its numbers.
        busy = notices.get(NOTICE_BUSY)
        why = busy.message if busy is not None else "no KV or request slot to reserve for it now"
        out.append(PdNodeEvent(BUSY, message=f"request {request_id}: {why}"))
    elif outcome.event == SEGMENT_END:
        out.append(PdNodeEvent(SEGMENT_END, reason=outcome.reason))
    else:  # the KV transfer failed; rank 0's notice says how
        failure = notices.get(NOTICE_TRANSFER_FAILED)
        kind = failure.error_kind if failure is not None else NOTICE_TRANSFER_FAILED
        message = failure.message if failure is not None else f"request {request_id}: the KV transfer failed"
        out.append(_error(message, kind, transfer_broken=kind == "transfer_broken"))
    return out


class PdNodeService:
    """All PD state of a node's HTTP process: the transfer epoch and the PD request streams.

    Args:
        host: the node's request manager (:class:`PdNodeHost`); the service registers its
            inbox handler there at once.
        role: ``"prefill"`` or ``"decode"``.
        setup_timeout_seconds: how long :meth:`transfer_setup` waits for rank 0's answer.
        rank0_address: model rank 0's inbox (zmq), where transfer setups go.
    """

    def __init__(self, host: PdNodeHost, role: str, setup_timeout_seconds: float, rank0_address: str):
        if role not in PD_NODE_MODES:
            raise ValueError(f"a PD node's role must be one of {PD_NODE_MODES}, got {role!r}")
        self.host = host
        self.role = role
        self.setup_timeout_seconds = setup_timeout_seconds
        self.rank0_address = rank0_address
        self.epoch: Optional[int] = None
        self.broken_reason: Optional[str] = None
        self._zmq_ctx: Optional[zmq.asyncio.Context] = None
        self._to_rank0: Any = None
        self._setup_lock = asyncio.Lock()
        self._setup_waiters: Dict[int, asyncio.Future] = {}
        host.add_inbox_handler(RANK0_PD_MESSAGES, self.on_message)

    # --- what the node's control endpoints read -------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The served model's vocabulary size (a request body's token ids are checked against it)."""
        return self.host.vocab_size

    @property
    def max_req_total_len(self) -> int:
        """The longest prompt plus generation a request may have here."""
        return self.host.max_req_total_len

    @property
    def metrics_registry(self) -> Any:
        """The registry of the node's /metrics, where the PD node metrics go too."""
        return self.host.metrics.measured

    # --- lifecycle (on the server's event loop) --------------------------------------------------
    def start(self) -> None:
        """Open the push socket to model rank 0."""
        if self._to_rank0 is None:
            self._zmq_ctx = zmq.asyncio.Context()
            self._to_rank0 = zmq_socket(self._zmq_ctx, zmq.PUSH, self.rank0_address, bind=False)

    def stop(self) -> None:
        """Close the socket to model rank 0."""
        if self._zmq_ctx is not None:
            self._zmq_ctx.destroy(linger=0)
        self._zmq_ctx = self._to_rank0 = None

    # --- rank 0's messages (the manager's inbox handler) -----------------------------------------
    def on_message(self, message: Any) -> None:
        """Apply one of rank 0's PD messages; a request's notice goes into its own event stream."""
        if isinstance(message, PdSetupDone):
            waiter = self._setup_waiters.pop(message.epoch, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(message)
        elif isinstance(message, PdChannelBroken):
            if message.epoch == self.epoch:
                log.warning("KV transfer of epoch %d broken: %s", message.epoch, message.reason)
                self.broken_reason = message.reason
        elif isinstance(message, PdNotice):
            # A request that already ended here has no stream left to explain.
            self.host.post(message.request_id, message)

    # --- the control endpoints' calls ------------------------------------------------------------
    async def transfer_setup(self, epoch: int, prefill_transfer_address: str) -> None:
        """(Re)start every rank's transfer handle for ``epoch``; returns once rank 0 applied it.

        A prefill node hosts at its own transfer port (``prefill_transfer_address`` is not used);
        a decode node joins ``prefill_transfer_address`` (``host:port``).  Raises ``ValueError``
        for a bad address or epoch and ``RuntimeError`` when the setup failed or got no answer in time.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise ValueError(f"epoch must be an int, got {epoch!r}")
        host, port = "", 0
        if self.role == "decode":
            host, port = parse_transfer_address(prefill_transfer_address)
        if self._to_rank0 is None:
            raise RuntimeError("the PD node service is not started (no socket to model rank 0)")
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

    async def generate(
        self,
        spec: RequestSpec,
        *,
        request_id: int,
        epoch: int,
        request: Any = None,
    ) -> AsyncIterator[PdNodeEvent]:
        """Run one PD request on this node under the master's ``request_id``.

        ``spec`` is the request as the node's wire body built it, its PD kind this node's role
        (``kv_start`` only on a prefill node).  Decode node: "reserved" (or "busy") first, then
        "token" events (the first is the prefill node's token, published here so the
        detokenizer has it), ending with a finish ("stop"/"length" on the last token),
        "segment_end" or "error".  Prefill node: the first "token", then "handed_off" or "error"
        (or the token finished the request).  Closing the iterator early aborts the request and
        frees its KV.  Bad arguments raise ``ValueError`` (or ``DuplicateRequestIdError``) when
        iteration starts, before any event.
        """
        if self.epoch is None or epoch != self.epoch:
            yield _error(f"request {request_id}: this node's KV transfer is not set up for epoch {epoch} "
                         f"(current: {self.epoch})", "epoch", transfer_broken=True)
            return
        if self.broken_reason is not None:
            yield _error(f"request {request_id}: this node's KV transfer of epoch {epoch} is broken: "
                         f"{self.broken_reason}", "transfer_broken", transfer_broken=True)
            return
        decode = self.role == "decode"
        expected_kind = PD_KIND_DECODE if decode else PD_KIND_PREFILL
        if not isinstance(spec, RequestSpec) or spec.pd.kind != expected_kind:
            # kv_start travels only with a prefill kind (the spec refuses it otherwise), so this
            # also keeps a decode node from being told where the KV starts: it chooses that itself.
            raise ValueError(f"a {self.role} node runs requests of PD kind {expected_kind} only, got "
                             f"{spec.pd.kind if isinstance(spec, RequestSpec) else type(spec).__name__}")
        # The previous segment of this request may still be releasing its slot here.
        await self.host.wait_request_id_free(request_id, SEGMENT_ID_REUSE_WAIT_S)
        events = self.host.generate(
            spec, request=request, request_id=request_id,
            # A decode node answers busy at once when no request slot is free, never after a wait.
            slot_wait_seconds=0.0 if decode else None,
        )
        notices: Dict[str, PdNotice] = {}
        first_token = True
        try:
            try:
                async for item in events:
                    if isinstance(item, PdNotice):
                        if item.kind == RESERVED:
                            yield PdNodeEvent(RESERVED, kv_start=item.kv_start)
                        else:
                            notices[item.kind] = item
                        continue
                    for event in translate(item, request_id, notices, decode and first_token):
                        if event.kind == TOKEN:
                            first_token = False
                        yield event
            except ServerBusyError as exc:
                yield PdNodeEvent(BUSY, message=f"request {request_id}: {exc}")
            except ServerUnavailableError as exc:
                yield _error(f"request {request_id}: {exc}", "internal")
        finally:
            await events.aclose()
