"""A PD node's HTTP-side service: transfer pairs by epoch, each PD request's event stream, load and draining.

A prefill or decode node's HTTP process composes one :class:`PdNodeService` around its request
manager (:mod:`lightllm.server.launch.pd_node`); the node's control endpoints
(:mod:`lightllm.server.pd.node.api`) call the service, and the service calls the manager through
the narrow :class:`~.host_contract.PdNodeHost` interface only.  The manager knows nothing of PD: the service
registers an inbox handler for rank 0's PD messages and posts a request's notices into that
request's own event stream.

* :meth:`PdNodeService.transfer_setup` sends :class:`PdTransferSetup` to model rank 0 (which
  hands it to every rank) and waits for rank 0's :class:`PdSetupDone` of that attempt (each
  attempt has its own ``setup_id``, which the answer echoes; an answer to an attempt given up
  on is dropped, so it cannot complete a later setup of the same epoch).  A node holds one
  transfer pair per connected peer, each named by the master's ``epoch``; setting one up leaves
  the others alone, and :meth:`PdNodeService.transfer_teardown` drops one
  (:class:`PdTransferTeardown`); :meth:`PdNodeService.teardown_all` drops them all (the master
  forgot this node).  A :class:`PdChannelBroken` breaks only its own epoch.
* :meth:`PdNodeService.generate` runs one request's
  :class:`~lightllm.server.core.objs.request_spec.RequestSpec` (its PD kind set by the node's
  wire format) through the manager's ``generate`` and turns what comes back into
  :class:`~lightllm.server.pd.protocol.node_events.PdNodeEvent` values (:func:`translate`).
  The request's epoch goes into its spec (``spec.pd.epoch``), so the ranks move its KV over
  that pair's handles.
* :meth:`PdNodeService.start_draining` (the node got SIGTERM): new PD requests (first
  segments) are answered busy, naming the drain, while the ones already here finish; a
  continuation segment (``segment_index`` > 0: its client is already streaming) is still taken,
  since the master sends one to a draining node only when no serving node of the role is left
  (the node's drain waits for the master's word that none may still come, see
  :mod:`lightllm.server.launch.pd_node`).
* :attr:`PdNodeService.running_requests` and :attr:`PdNodeService.queued_prefill_tokens`: the
  node's share of the load its heartbeats report.

Ordering: rank 0 puts its PD messages in its step output stream (``StepOutput.notices``), ahead
of the tokens and finish of the same step, and the detokenizer forwards them in that place; so a
request's notice (reserved, transferred, transfer_failed, busy) is in its event stream before the
token or finish it explains, and nothing here waits for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from typing import Any, AsyncIterator, Dict, List, Optional, Set, Tuple, Type

import zmq
import zmq.asyncio

from lightllm.server.core.objs.io_messages import (
    PdChannelBroken,
    PdNotice,
    PdSetupDone,
    PdTransferSetup,
    PdTransferTeardown,
)
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_PREFILL
from lightllm.server.manager_errors import ServerBusyError, ServerUnavailableError
from lightllm.server.pd.protocol.membership import STATE_DRAINING, STATE_SERVING
from lightllm.server.pd.protocol.node_events import BUSY, RESERVED, TOKEN, PdNodeEvent
from lightllm.server.pd.node.host_contract import PdNodeHost, check_epoch, parse_transfer_address
from lightllm.server.pd.node.stream_translation import error_event, translate
from lightllm.server.run_mode import PD_NODE_MODES, RunMode
from lightllm.utils.process_utils import zmq_socket

log = logging.getLogger(__name__)

# What rank 0 sends this process about PD (inside its step output stream).
RANK0_PD_MESSAGES: Tuple[Type[Any], ...] = (PdSetupDone, PdNotice, PdChannelBroken)

# How long a segment waits for the previous segment of the same request id to release its slot
# on this node (normally milliseconds: its finish is already on the way); after that the id is
# refused as in use.
SEGMENT_ID_REUSE_WAIT_S = 5.0


class PdNodeService:
    """All PD state of a node's HTTP process: its transfer pairs, PD request streams, load and drain.

    Attributes:
        epochs: the set-up transfer pairs, epoch -> why it broke (None while usable); a PD
            request runs only under an epoch in here that is not broken.
        draining: set by :meth:`start_draining`; new PD requests are answered busy (continuation
            segments are still taken).

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
        self.epochs: Dict[int, Optional[str]] = {}
        self.draining = False
        self._zmq_ctx: Optional[zmq.asyncio.Context] = None
        self._to_rank0: Any = None
        # Setups of one epoch run one at a time; different epochs (different peers) may overlap,
        # so a peer that is slow to connect does not hold up the others.  epoch -> (lock, users).
        self._setup_locks: Dict[int, Tuple[asyncio.Lock, List[int]]] = {}
        # epoch -> (setup_id, waiter) of the setup waiting for rank 0.  An epoch alone does not
        # name an attempt: a setup that timed out may still be answered after a later setup of
        # the same epoch began (a restarted master numbers its epochs from 0 again), and that
        # answer says nothing about the later one.  Ids start at 1 (0: a command without one).
        self._setup_waiters: Dict[int, Tuple[int, asyncio.Future]] = {}
        self._setup_ids = itertools.count(1)
        # The load this process knows: PD requests it holds, and (prefill node) the prompt
        # tokens of those that have not produced their first token yet.
        self._running: Set[object] = set()
        self._queued_prefill_tokens = 0
        host.add_inbox_handler(RANK0_PD_MESSAGES, self.on_message)

    # --- what the node's control endpoints read -------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The served model's vocabulary size (a request body's token ids are checked against it)."""
        return self.host.served.vocab_size

    @property
    def max_req_total_len(self) -> int:
        """The longest prompt plus generation a request may have here."""
        return self.host.served.max_req_total_len

    @property
    def metrics_registry(self) -> Any:
        """The registry of the node's /metrics, where the PD node metrics go too."""
        return self.host.metrics.measured

    @property
    def running_requests(self) -> int:
        """PD requests this node holds now (accepted and not ended, first token or not)."""
        return len(self._running)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens of the held requests not prefilled yet (their first token is not out).

        Always 0 on a decode node: its prompts are prefilled elsewhere and their KV, received
        into reserved slots, already counts against its free KV.
        """
        return self._queued_prefill_tokens

    @property
    def state(self) -> str:
        """``"serving"``, or ``"draining"`` once :meth:`start_draining` ran."""
        return STATE_DRAINING if self.draining else STATE_SERVING

    def usable_epochs(self) -> List[int]:
        """The set-up epochs whose transfer is not broken, in order."""
        return sorted(epoch for epoch, broken in self.epochs.items() if broken is None)

    def start_draining(self) -> None:
        """Take no new PD requests from now on (they are answered busy); the held ones go on, and
        continuation segments of generations already streaming are still taken."""
        if not self.draining:
            self.draining = True
            log.info("%s node draining: %d PD request(s) in flight, new ones are answered busy (continuation "
                     "segments are still taken)", self.role, self.running_requests)

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
            waiting = self._setup_waiters.get(message.epoch)
            if waiting is None or waiting[0] != message.setup_id:
                # Expected after a timeout or a teardown during a setup: the waiter is gone.
                log.debug("dropped rank 0's answer to KV transfer setup %d of epoch %d: no longer awaited "
                          "(awaiting: %s)", message.setup_id, message.epoch,
                          f"setup {waiting[0]}" if waiting else "none")
                return
            del self._setup_waiters[message.epoch]
            if not waiting[1].done():
                waiting[1].set_result(message)
        elif isinstance(message, PdChannelBroken):
            # Only that pair is broken; the node's other peers keep transferring.
            if message.epoch in self.epochs and self.epochs[message.epoch] is None:
                log.warning("KV transfer of epoch %d broken: %s", message.epoch, message.reason)
                self.epochs[message.epoch] = message.reason
        elif isinstance(message, PdNotice):
            # A request that already ended here has no stream left to explain.
            self.host.post(message.request_id, message)

    # --- the control endpoints' calls ------------------------------------------------------------
    async def transfer_setup(self, epoch: int, prefill_transfer_address: str) -> None:
        """Start (or restart) every rank's transfer handle for ``epoch``; returns once rank 0 applied it.

        The node's other epochs are left as they are.  A prefill node hosts at its own transfer
        port (``prefill_transfer_address`` is not used); a decode node joins
        ``prefill_transfer_address`` (``host:port``).  Raises ``ValueError`` for a bad address or
        epoch and ``RuntimeError`` when the setup failed, got no answer in time, or the epoch
        was torn down meanwhile.
        """
        check_epoch(epoch)
        host, port = "", 0
        if self.role == RunMode.DECODE:
            host, port = parse_transfer_address(prefill_transfer_address)
        if self._to_rank0 is None:
            raise RuntimeError("the PD node service is not started (no socket to model rank 0)")
        async with self._epoch_lock(epoch):
            waiter = asyncio.get_running_loop().create_future()
            setup_id = next(self._setup_ids)
            self._setup_waiters[epoch] = (setup_id, waiter)
            # A replaced pair's requests fail from now on (its handles are being restarted).
            self.epochs.pop(epoch, None)
            try:
                await self._to_rank0.send_pyobj(PdTransferSetup(epoch, host, port, setup_id))
                done: PdSetupDone = await asyncio.wait_for(waiter, self.setup_timeout_seconds)
            except asyncio.TimeoutError:
                # Rank 0 may still finish it later: the teardown, queued behind the setup, keeps
                # a pair nobody uses from holding its handles (and its late answer is dropped).
                await self._to_rank0.send_pyobj(PdTransferTeardown(epoch))
                raise RuntimeError(f"KV transfer setup for epoch {epoch} got no answer from model rank 0 "
                                   f"within {self.setup_timeout_seconds:g} s") from None
            finally:
                if self._setup_waiters.get(epoch, (0, None))[1] is waiter:
                    del self._setup_waiters[epoch]
            if done.error:
                raise RuntimeError(done.error)
            self.epochs[epoch] = None
            log.info("KV transfer set up for epoch %d (%s; %d pair(s) set up)", epoch, self.role, len(self.epochs))

    async def transfer_teardown(self, epoch: int) -> bool:
        """Drop the transfer pair of ``epoch`` here and on every rank; True if this node knew it.

        Idempotent: an unknown epoch is still sent to rank 0 (a setup this process gave up on
        may have finished there).  A setup of ``epoch`` still waiting for rank 0 fails.
        """
        check_epoch(epoch)
        if self._to_rank0 is None:
            raise RuntimeError("the PD node service is not started (no socket to model rank 0)")
        waiting = self._setup_waiters.get(epoch)
        waiter = waiting[1] if waiting is not None else None
        known = epoch in self.epochs or waiter is not None
        self.epochs.pop(epoch, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(RuntimeError(f"the KV transfer of epoch {epoch} was torn down while being set up"))
        await self._to_rank0.send_pyobj(PdTransferTeardown(epoch))
        if known:
            log.info("KV transfer of epoch %d torn down (%s; %d pair(s) left)", epoch, self.role, len(self.epochs))
        return known

    async def teardown_all(self) -> List[int]:
        """Drop every pair held or being set up (the master forgot this node: it tore them down on
        their peers); what they hold is released now, not at their leases.  Returns the epochs."""
        epochs = sorted(set(self.epochs) | set(self._setup_waiters))
        for epoch in epochs:
            await self.transfer_teardown(epoch)
        return epochs

    @contextlib.asynccontextmanager
    async def _epoch_lock(self, epoch: int) -> AsyncIterator[None]:
        entry = self._setup_locks.get(epoch)
        if entry is None:
            entry = self._setup_locks[epoch] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._setup_locks[epoch]

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
        (``kv_start`` only on a prefill node); it runs with ``epoch`` as its ``spec.pd.epoch``.
        A draining node answers a first segment "busy" at once (a continuation segment runs); an epoch that is not set up here, or broken,
        is an "error" marked ``transfer_broken``.  Decode node: "reserved" (or "busy") first, then
        "token" events (the first is the prefill node's token, published here so the
        detokenizer has it), ending with a finish ("stop"/"length" on the last token),
        "segment_end" or "error".  Prefill node: the first "token", then "handed_off" or "error"
        (or the token finished the request).  Closing the iterator early aborts the request and
        frees its KV.  Bad arguments raise ``ValueError`` (or ``DuplicateRequestIdError``) when
        iteration starts, before any event.
        """
        continuation = isinstance(spec, RequestSpec) and spec.segment.segment_index > 0
        if self.draining and not continuation:
            # Busy, not an error: the master places the request elsewhere (it learns the state
            # from the heartbeat too, but one may already be on its way).
            yield self._draining_busy(request_id)
            return
        if epoch not in self.epochs:
            yield error_event(f"request {request_id}: this node's KV transfer is not set up for epoch {epoch} "
                         f"(set up: {self.usable_epochs() or 'none'})", "epoch", transfer_broken=True)
            return
        broken = self.epochs[epoch]
        if broken is not None:
            yield error_event(f"request {request_id}: this node's KV transfer of epoch {epoch} is broken: "
                         f"{broken}", "transfer_broken", transfer_broken=True)
            return
        decode = self.role == RunMode.DECODE
        expected_kind = PD_KIND_DECODE if decode else PD_KIND_PREFILL
        if not isinstance(spec, RequestSpec) or spec.pd.kind != expected_kind:
            # kv_start travels only with a prefill kind (the spec refuses it otherwise), so this
            # also keeps a decode node from being told where the KV starts: it chooses that itself.
            raise ValueError(f"a {self.role} node runs requests of PD kind {expected_kind} only, got "
                             f"{spec.pd.kind if isinstance(spec, RequestSpec) else type(spec).__name__}")
        if spec.pd.epoch != epoch:
            spec = dataclasses.replace(spec, pd=dataclasses.replace(spec.pd, epoch=epoch))
        held = object()
        self._running.add(held)
        # A prefill node's first event (its first token, or why there is none) ends the prefill.
        queued = 0 if decode else spec.prompt_len
        self._queued_prefill_tokens += queued
        events = self._run(spec, request_id, request, decode, continuation)
        try:
            async for event in events:
                self._queued_prefill_tokens -= queued
                queued = 0
                yield event
        finally:
            self._queued_prefill_tokens -= queued
            self._running.discard(held)
            # Closed here, not left to the garbage collector: closing aborts the request on the node.
            await events.aclose()

    def _draining_busy(self, request_id: int) -> PdNodeEvent:
        return PdNodeEvent(BUSY, message=f"request {request_id}: this {self.role} node is draining "
                                         f"(shutting down) and takes no new requests")

    async def _run(self, spec: RequestSpec, request_id: int, request: Any, decode: bool,
                   continuation: bool) -> AsyncIterator[PdNodeEvent]:
        # The previous segment of this request may still be releasing its slot here.
        await self.host.wait_request_id_free(request_id, SEGMENT_ID_REUSE_WAIT_S)
        # A continuation's client is mid-answer: the server's drain lets it start (the drain waits
        # for it, within its graceful period).
        exempt = {"drain_exempt": True} if continuation else {}
        events = self.host.generate(
            spec, request=request, request_id=request_id,
            # A decode node answers busy at once when no request slot is free, never after a wait.
            slot_wait_seconds=0.0 if decode else None, **exempt,
        )
        notices: Dict[str, PdNotice] = {}
        first_token = True
        sent_any = False
        try:
            try:
                async for item in events:
                    if isinstance(item, PdNotice):
                        if item.kind == RESERVED:
                            sent_any = True
                            yield PdNodeEvent(RESERVED, kv_start=item.kv_start)
                        else:
                            notices[item.kind] = item
                        continue
                    for event in translate(item, request_id, notices, decode and first_token):
                        if event.kind == TOKEN:
                            first_token = False
                        sent_any = True
                        yield event
            except ServerBusyError as exc:
                yield PdNodeEvent(BUSY, message=f"request {request_id}: {exc}")
            except ServerUnavailableError as exc:
                if self.draining and not sent_any:
                    # Accepted just before the drain began and refused by the manager since, or
                    # still waiting for its first token when the graceful period ran out: the
                    # client has seen nothing, so the master may place it elsewhere.  The manager's
                    # own message says which of the two it was.
                    yield PdNodeEvent(BUSY, message=f"request {request_id}: this {self.role} node is draining "
                                                    f"(shutting down): {exc}")
                else:
                    yield error_event(f"request {request_id}: {exc}", "internal")
        finally:
            await events.aclose()
