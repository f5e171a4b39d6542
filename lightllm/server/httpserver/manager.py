"""HttpServerManager: submitting a tokenized request to the router, streaming its events back, and
ending requests on shutdown or failure.

Requests arrive already tokenized (a :class:`~lightllm.server.core.objs.request_spec.RequestSpec`):
the HTTP layer's :class:`~lightllm.server.http.generation.prompt_encoding.PromptEncoder` encodes
prompts. The manager only loads the tokenizer into the served model (:meth:`HttpServerManager.from_config`)
for the HTTP layer to use.

A request's own state and event stream live in :mod:`.pending_request`; the free slots in
:mod:`.slot_pool`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple, Type

from lightllm.server.admission_scope import generation_started
from lightllm.server.core.objs.io_messages import AbortRequest, DetokenizedOutput, NewRequest, SlotReleased, StepTexts
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.core.objs.shm_req_checks import check_request_id
from lightllm.server.core.objs.shm_req_layout import NO_REQUEST, wants_top_rows
from lightllm.server.core.objs.shm_req_views import StaleRecordError
from lightllm.server.core.objs.shm_stats import ShmStats
from lightllm.server.httpserver.metrics import ServerMetrics
from lightllm.server.httpserver.pending_request import PendingRequest
from lightllm.server.httpserver.request_counting import RequestCounting
from lightllm.server.httpserver.slot_pool import RequestSlots
from lightllm.server.httpserver.sockets import HttpSockets
from lightllm.server.manager_errors import DuplicateRequestIdError, ServerUnavailableError
from lightllm.server.request_defaults import RequestDefaults
from lightllm.server.request_gate import RequestGate
from lightllm.server.request_manager import GenerationEvent, ServedModelView, generations_per_request
from lightllm.server.served_model import ServedModel, served_names
from lightllm.server.server_layout import ServerLayout
from lightllm.utils.tokenizer_utils import load_tokenizer
from lightllm.utils.async_polling import wait_until

log = logging.getLogger("lightllm.httpserver")


@dataclass
class HttpServerConfig:
    """What the HTTP process needs to reach the rest of the server."""

    model_dir: str
    model_name: str
    tokenizer_mode: str
    layout: ServerLayout
    vocab_size: int
    eos_token_ids: List[int]
    prefill_queue_strategy: str
    # --slot_wait_seconds: how long a request waits for a free slot before it is refused busy.
    slot_wait_seconds: float
    max_new_tokens_default: Optional[int] = None
    # --model_name values; empty: the directory name and the --model_dir path.
    served_model_names: List[str] = field(default_factory=list)
    # --generation_config's sampling defaults and --chat_template, resolved by the launcher.
    request_defaults: RequestDefaults = field(default_factory=RequestDefaults)
    # Whether the ranks keep a prefix cache (plan.prefix_cache_enabled): what the metrics count as looked up.
    prefix_cache: bool = True


class HttpServerManager:
    """Accepts requests from the API layer and streams their tokens back.

    Implements :class:`~lightllm.server.request_manager.SupervisedRequestManager`.  What a run
    mode adds on top (a PD node's service, :mod:`lightllm.server.pd.node.service`) composes
    around it: :meth:`add_inbox_handler` hands it the inbox messages of its own types and
    :meth:`post` puts a message into one request's event stream, so this class has no mode
    branch of its own.  It builds none of its parts: :meth:`from_config` builds a server's (the
    tokenizer, shared memory, metrics, slot pools and sockets) and hands them to the constructor.
    """

    def __init__(self, served: ServedModelView, shm: ShmReqBuffer, metrics: ServerMetrics, slots: RequestSlots,
                 sockets: HttpSockets, *, prefix_cache: bool = True, stats: Optional[ShmStats] = None) -> None:
        """A manager over the parts it runs on (:meth:`from_config` builds them for a server).

        ``served``: the model it serves (the HTTP layer reads it; :meth:`generate` checks a spec
        against its vocabulary and context length).  ``shm``: the shared-memory request records.
        ``metrics``: what /metrics renders.  ``slots``: the free request slots and top-logprob rows,
        whose counts set the generation caps.  ``sockets``: opened by :meth:`start`, closed by
        :meth:`stop`.  ``prefix_cache``: whether the ranks keep a prefix cache (what the metrics
        count as looked up).  ``stats``: the shared counters ``metrics`` reads, held here for
        whoever closes them.
        """
        self.served = served
        self.shm = shm
        self.stats = stats
        self.metrics = metrics
        self.sockets = sockets
        self._prefix_cache = prefix_cache
        self._slots = slots
        # Every generation of a request (its prompts x n or best_of) holds a request slot: one request
        # may hold at most half of them, so it never locks every other client out of the server.
        self.max_generations_per_request = generations_per_request(slots.slot_num)
        # The same for generations asking for top logprobs, which also hold a top-logprob row each.
        self.max_top_logprob_generations_per_request = generations_per_request(slots.top_slot_num)
        self.generation_caps_source = "the server's"
        self._pending: Dict[int, PendingRequest] = {}
        # Every request id in use, from the moment generate() claims it until its slot is
        # released (the router, ranks and detokenizer key their state by it until then); the
        # value is the slot, None while the request still waits for one.
        self._live: Dict[int, Optional[int]] = {}
        # Set when the id leaves _live, for whoever waits to reuse it (wait_request_id_free).
        self._id_freed: Dict[int, asyncio.Event] = {}
        # (message types, handler) registered by what composes around this manager.
        self._inbox_handlers: List[Tuple[Tuple[Type[Any], ...], Callable[[Any], None]]] = []
        self._next_request_id = 1
        self._receiver: Optional[asyncio.Task] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        # Set once the server stops taking requests; new requests get it as their error.
        self._gate = RequestGate()
        self._backend_alive = True
        self._active_generations = 0

    @classmethod
    def from_config(cls, config: HttpServerConfig) -> "HttpServerManager":
        """The HTTP process's manager: loads the tokenizer, maps the request records and counters
        the launcher created, and builds the metrics and slot pools of ``config``."""
        # Names a request's ``model`` may use (served_names says which).
        _, names = served_names(config.model_dir, config.served_model_names or None)
        layout = config.layout
        served = ServedModel(config.model_name, list(dict.fromkeys([config.model_name, *names])),
                             load_tokenizer(config.model_dir, config.tokenizer_mode), config.vocab_size,
                             list(config.eos_token_ids), layout.max_req_total_len, config.max_new_tokens_default,
                             config.request_defaults,
                             # --model_dir as an absolute path: /v1/models' ``root`` (where vLLM reports its --model).
                             model_path=os.path.abspath(config.model_dir))
        shm = layout.open_requests()
        stats = layout.open_stats()
        metrics = ServerMetrics(config.prefill_queue_strategy, stats, config.model_name, layout.max_req_total_len)
        slots = RequestSlots(layout.slot_num, layout.top_slot_num, config.slot_wait_seconds)
        sockets = HttpSockets(layout.router_address, layout.http_address)
        return cls(served, shm, metrics, slots, sockets, prefix_cache=config.prefix_cache, stats=stats)

    # --- lifecycle (called from the FastAPI lifespan) ----------------------------------------
    async def start(self) -> None:
        """Open sockets and start the receiver task."""
        self.loop = asyncio.get_running_loop()
        self.sockets.open()
        self._slots.start()
        self._receiver = asyncio.create_task(self._receive_loop())

    async def stop(self) -> None:
        """Stop receiving and close sockets."""
        if self._receiver is not None:
            self._receiver.cancel()
        self.sockets.close()

    async def _receive_loop(self) -> None:
        while True:
            message = await self.sockets.inbox.recv_pyobj()
            for item in message.messages if isinstance(message, StepTexts) else (message,):
                try:
                    await self._handle_message(item)
                except Exception:  # one bad message must not stop every stream
                    log.exception("failed to handle %s", type(item).__name__)

    def _scheduled_ns_if_held(self, slot: int, request_id: int) -> int:
        """When rank 0 first scheduled the request, 0 if it was not or the slot is no longer its."""
        try:
            return self.shm.scheduled_ns(slot, request_id)
        except StaleRecordError:
            return 0

    async def _handle_message(self, message: Any) -> None:
        if isinstance(message, DetokenizedOutput):
            pending = self._pending.get(message.request_id)
            if pending is not None:
                if not pending.scheduled_ns:
                    # Read while the slot is surely still this request's: its release
                    # message comes after every output message.
                    pending.scheduled_ns = self.shm.scheduled_ns(pending.slot, message.request_id)
                pending.deliver(message)
        elif isinstance(message, SlotReleased):
            await self._release_slot(message.request_id, message.shm_index)
        else:
            handled = False
            for message_types, handler in self._inbox_handlers:
                if isinstance(message, message_types):
                    handler(message)
                    handled = True
            if not handled:
                # Only the server's own processes write to this inbox: an unhandled type is a bug.
                log.error("no handler for an inbox message of type %s; dropped (a bug in the sender): %.200r",
                          type(message).__name__, message)

    def add_inbox_handler(self, message_types: Tuple[Type[Any], ...], handler: Callable[[Any], None]) -> None:
        """Call ``handler(message)`` for every inbox message of ``message_types``.

        Called on the event loop, in the order the messages arrived among the requests' token
        outputs (rank 0 sends them in its step output stream), so a handler that passes a
        message to its request with :meth:`post` keeps it ahead of the tokens that followed it.
        """
        self._inbox_handlers.append((tuple(message_types), handler))

    def post(self, request_id: int, item: Any) -> bool:
        """Put ``item`` into pending request ``request_id``'s event stream; False if no such request.

        ``generate`` yields it as is, in arrival order with the request's ``GenerationEvent``
        values; only the code that submitted the request with its own id reads such items.
        """
        pending = self._pending.get(request_id)
        if pending is None:
            return False
        return pending.post(item)

    async def _release_slot(self, request_id: int, slot: int) -> None:
        if self._live.get(request_id) == slot:
            self._forget_request_id(request_id)
        # Only the request that holds the slot frees it: a duplicate or late release must never
        # hand a slot in use to a new request.
        if self.shm.release(slot, request_id):
            await self._slots.put(slot)

    def _forget_request_id(self, request_id: int) -> None:
        """The id is no longer in use here: drop it and wake whoever waits to reuse it."""
        self._live.pop(request_id, None)
        freed = self._id_freed.pop(request_id, None)
        if freed is not None:
            freed.set()

    async def wait_request_id_free(self, request_id: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until ``request_id`` is no longer live here; True if free.

        A PD node receives a request's next segment under the same id, and the master may send
        it while the previous segment's slot release is still on its way from the ranks; the
        release wakes this wait.
        """
        if request_id not in self._live:
            return True
        freed = self._id_freed.setdefault(request_id, asyncio.Event())
        try:
            await asyncio.wait_for(freed.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return request_id not in self._live

    def _claim_request_id(self, request_id: Optional[int]) -> int:
        """Reserve ``request_id`` (or, when None, the next free id of this manager's own)."""
        if request_id is None:
            request_id = self._next_request_id
            while request_id in self._live:
                request_id += 1
            self._next_request_id = request_id + 1
        else:
            check_request_id(request_id)
            if request_id in self._live:
                raise DuplicateRequestIdError(request_id)
        self._live[request_id] = None
        return request_id

    # --- shutdown and failure (called on the event loop by the supervisor) ----------------------
    def refuse_new_requests(self, message: str, code: str) -> None:
        """From now on every new request fails with a 503 carrying ``message``; /health says 503.

        Requests already admitted by the HTTP layer (being tokenized) may still start generating.
        """
        self._gate.drain(message, code)

    def fail_pending(self, message: str, code: str, backend_alive: bool) -> int:
        """End every pending request (and every later one) with ``message``; returns how many.

        ``backend_alive`` False means a child process died: nothing is sent to the router then,
        since no one would read it.
        """
        failure = ServerUnavailableError(message, code)
        self._gate.close(message, code)
        self._backend_alive = self._backend_alive and backend_alive
        # Requests still waiting for a slot fail too.
        waiting = self._slots.fail(failure)
        return waiting + sum(pending.fail(failure) for pending in list(self._pending.values()))

    async def wait_until_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every request to end; True if they all did."""
        return await wait_until(lambda: self._active_generations == 0, timeout)

    # --- the API layer's interface ---------------------------------------------------------------
    def refusal(self) -> Optional[ServerUnavailableError]:
        """The error new requests get while the server refuses them (draining, failed); None otherwise."""
        return self._gate.refusal

    def check_admission(self, request: Any = None) -> None:
        """See :meth:`RequestManager.check_admission`."""
        self._gate.check(request)

    def health(self) -> bool:
        """Whether the server accepts requests."""
        return self._gate.open and self._receiver is not None and not self._receiver.done()

    def on_request_params(self, n: int, prompts: int = 1) -> None:
        """An API request's generations started (see :meth:`RequestManager.on_request_params`)."""
        self.metrics.on_request_params(n, prompts)

    def metrics_text(self) -> tuple[bytes, str]:
        """Prometheus exposition of this server's metrics."""
        return self.metrics.render()

    async def generate(
        self,
        spec: RequestSpec,
        *,
        request: Any = None,
        request_id: Optional[int] = None,
        slot_wait_seconds: Optional[float] = None,
        drain_exempt: bool = False,
    ) -> AsyncIterator[GenerationEvent]:
        """Submit ``spec`` and yield one event per generated token (the last has finish_reason).

        The spec checked its own fields when it was built; this checks it against the served
        model (vocabulary, context length) once, and nothing on its way to the ranks checks it
        again but rank 0's screen of the shared-memory record.  ``request_id`` is internal:
        only server code that owns the request passes it (a PD node, under its master's id);
        the HTTP handlers never do.  The id (given, or this manager's next free one) is used
        unchanged by every process and in every event; a given id that is still in use raises
        ``DuplicateRequestIdError``.  ``slot_wait_seconds`` (None: --slot_wait_seconds) is how
        long to wait for a free request slot.  ``drain_exempt`` lets the request start while the
        server drains (a PD node's continuation segment), not once it refuses everything.

        Besides ``GenerationEvent`` values it yields the items given to the request through
        :meth:`post` (none unless an inbox handler posts, as a PD node's service does with rank
        0's notices).
        """
        if not isinstance(spec, RequestSpec):
            raise ValueError(f"generate takes a RequestSpec, got {type(spec).__name__}")
        spec.check_fits(self.served.vocab_size, self.served.max_req_total_len)
        prompt_len = spec.prompt_len
        self._gate.check(request, drain_exempt)
        request_id = self._claim_request_id(request_id)
        self._active_generations += 1
        # Counted here now, so a drain waiting for requests still being prepared sees no gap.
        generation_started(request)
        try:
            try:
                slot, top_slot = await self._slots.take(slot_wait_seconds, wants_top_rows(spec.params))
            except BaseException:
                self._forget_request_id(request_id)
                raise
            self._live[request_id] = slot
            pending = PendingRequest(prompt_len, slot, RequestCounting.of(spec))
            self._pending[request_id] = pending
            try:
                self.shm.write_request(slot, request_id, spec, top_slot)
            except Exception:
                del self._pending[request_id]
                self._forget_request_id(request_id)
                # The record is claimed last, so a refused write leaves the slot free.
                if self.shm.holder(slot) == NO_REQUEST:
                    await self._slots.put(slot)
                raise
            started = time.perf_counter()
            pending.arrival_ns = time.monotonic_ns()
            self.metrics.on_submit(prompt_len, pending.counting,
                                   self._prefix_cache and spec.params.prompt_logprobs is None)
            finish_reason = None
            try:
                await self.sockets.to_router.send_pyobj(NewRequest(request_id, slot))
                events = pending.events(request, started, self.metrics)
                try:
                    async for event in events:
                        if isinstance(event, GenerationEvent):
                            finish_reason = event.finish_reason
                        yield event
                finally:
                    await events.aclose()
                if pending.failure is not None:
                    finish_reason = "error"
                    raise pending.failure
                if finish_reason is None:
                    finish_reason = "abort"  # the client went away
                    # Debug: the HTTP layer logs the departure once per API request, with the count
                    # of its generations (one request may run hundreds); /metrics counts each abort.
                    log.debug("request %d: its client went away; aborting it", request_id)
            finally:
                self._pending.pop(request_id, None)
                if not pending.scheduled_ns and self._backend_alive:
                    # Ended before its first output (aborted during its prefill): the slot is still
                    # its own until the abort is processed, so the scheduling time can be read.
                    pending.scheduled_ns = self._scheduled_ns_if_held(pending.slot, request_id)
                if (finish_reason in (None, "abort") or pending.failure is not None) and self._backend_alive:
                    # Client went away, the stream was closed early or the server gives up on the
                    # request: stop the work (over zmq only; the slot may already be released).
                    await self.sockets.to_router.send_pyobj(AbortRequest(request_id))
                self.metrics.on_finish(
                    finish_reason or "abort",
                    pending.completion_tokens,
                    time.perf_counter() - started,
                    prompt_tokens=pending.prompt_tokens,
                    first_token_seconds=pending.first_token_seconds,
                    queue_seconds=pending.queue_seconds,
                    max_new_tokens=spec.params.max_new_tokens,
                    uncounted_tokens=pending.completion_tokens - pending.taken_tokens,
                    counting=pending.counting,
                )
        finally:
            self._active_generations -= 1
