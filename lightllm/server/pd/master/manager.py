"""PdMasterManager: the PD master's request manager (the public API's backend on a master).

It implements :class:`~lightllm.server.request_manager.SupervisedRequestManager`, so
``create_app`` serves the same native and OpenAI API as a normal server; it loads the
tokenizer and ``config.json`` only (:class:`~lightllm.server.served_model.ServedModel`).

A request gets the next id of the master's counter, used unchanged on both nodes and in every
log line.  Its first segment, and each continuation after D ended a segment, runs through
:class:`~.segment_flow.SegmentFlow`; the client sees one uninterrupted stream and usage counts
each token once (the master counts: :mod:`.request_accounting`).  The text is the master's too
(:mod:`.generation_text`): it decodes the token ids over all segments with the normal
detokenizer's rules and decides stop strings itself.  Errors: before the cluster is ready 503 ``pd_not_ready``;
a busy node 503 ``server_busy`` naming the role (after the bounded retry of
``LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS`` when positive); a node failure, a deadline or a
node dropped from the cluster 503 (an error event when the stream already started).  Closing a
request's generation (the client went away) closes its node streams, which aborts it on the
nodes and frees its KV; a generation that ends closes them before its last event is handed on,
so nothing on the nodes waits for its caller to read on (:meth:`PdMasterManager._release_nodes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.pd.master.continuation import ContinuationSegment, SegmentEnd, first_segment, next_segment
from lightllm.server.pd.master.expiry_sweeper import ExpirySweeper
from lightllm.server.pd.master.generation_text import GenerationText
from lightllm.server.pd.master.metrics import MasterMetrics
from lightllm.server.pd.protocol.node_info import NodeInfo
from lightllm.server.pd.master.node_registry import NodeRegistry
from lightllm.server.pd.master.node_selector import AFFINITY_PREFIX_TOKENS, NodeSelector
from lightllm.server.pd.master.node_streams import NodeStreams
from lightllm.server.pd.master.pair_setup import PairSetup
from lightllm.server.pd.master.request_accounting import FINISH_REASON_BUSY, RequestAccounting
from lightllm.server.pd.master.request_run import ClientGone, PdRequestFailed, RequestRun
from lightllm.server.pd.protocol.node_events import RANK_FAILURE_REASONS
from lightllm.server.pd.master.phase_deadlines import PhaseDeadlines
from lightllm.server.pd.master.segment_flow import SegmentFlow
from lightllm.server.manager_errors import ServerBusyError, ServerUnavailableError
from lightllm.server.admission_scope import generation_started
from lightllm.server.request_gate import RequestGate
from lightllm.server.request_manager import GenerationEvent, generations_per_request
from lightllm.server.pd.protocol.stream_lines import token_from_line
from lightllm.server.served_model import ServedModel
from lightllm.utils.async_polling import wait_until

log = logging.getLogger("lightllm.pd_master")


class PdMasterManager:
    """The PD master's :class:`~lightllm.server.request_manager.SupervisedRequestManager`.

    Args:
        served: the served model (names, tokenizer, limits): the HTTP layer reads it, and the
            master tokenizes, checks specs and decodes text with it.
        registry: the master's live node set (its drop listener fails requests on a lost node).
        deadlines: per-phase deadlines of node answers.
        setup_timeout_s: bound on each node's answer to a transfer setup.
        affinity_prefix_tokens: ``--pd_prefix_affinity_tokens`` (0: place prefills by load only).
    """

    def __init__(self, served: ServedModel, registry: NodeRegistry, deadlines: PhaseDeadlines, setup_timeout_s: float,
                 cluster_key: Optional[str] = None, affinity_prefix_tokens: int = AFFINITY_PREFIX_TOKENS) -> None:
        self.served = served
        self.cluster_key = cluster_key
        self.registry = registry
        self.deadlines = deadlines
        self.setup_timeout_s = setup_timeout_s
        self.selector = NodeSelector(registry, affinity_prefix_tokens=affinity_prefix_tokens)
        registry.add_drop_listener(self.selector.forget)
        self.metrics = MasterMetrics(registry, served.model_name, served.max_req_total_len,
                                     in_flight=self.selector.in_flight)
        registry.add_drop_listener(self._on_node_dropped)
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._nodes: Optional[NodeStreams] = None
        self.pairs: Optional[PairSetup] = None
        self._flow: Optional[SegmentFlow] = None
        self._sweeper = ExpirySweeper(registry)
        self._runs: Dict[int, RequestRun] = {}
        self._next_request_id = 1
        self._gate = RequestGate()

    @property
    def max_generations_per_request(self) -> Optional[int]:
        """Half the request slots of the node with the fewest (each generation holds one on its
        nodes), as a normal server limits one request; None while no node reports its slots."""
        return self._half_of_smallest("request_slots")

    # The caps are half of the places of the node with the fewest; the master has none of its own.
    generation_caps_source = "the smallest PD node's"

    @property
    def max_top_logprob_generations_per_request(self) -> Optional[int]:
        """The same for a request asking for top logprobs, of the nodes' top-logprob rows."""
        return self._half_of_smallest("top_logprob_slots")

    def _half_of_smallest(self, field_name: str) -> Optional[int]:
        counts = [getattr(info, field_name) for info in self.registry.alive() if getattr(info, field_name) is not None]
        return generations_per_request(min(counts)) if counts else None

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the node client and the expiry sweeper on the serving loop."""
        self.loop = asyncio.get_running_loop()
        self._nodes = NodeStreams(cluster_key=self.cluster_key, on_refused=self.registry.mark_refused)
        self.pairs = PairSetup(self.registry, self._nodes, self.setup_timeout_s)
        self._flow = SegmentFlow(self.pairs, self.selector, self._nodes, self.deadlines, self.metrics)
        self._sweeper.start()

    async def stop(self) -> None:
        """Fail what still runs, stop sweeping and close every node connection."""
        self.fail_pending("The PD master is stopping", "server_shutting_down", backend_alive=True)
        await self._sweeper.stop()
        if self.pairs is not None:
            await self.pairs.aclose()
        if self._nodes is not None:
            await self._nodes.aclose()

    # --- shutdown and failure (the supervisor) ---------------------------------------------------
    def refusal(self) -> Optional[ServerUnavailableError]:
        """The error new requests get while the master refuses them (None: it takes them)."""
        return self._gate.refusal

    def refuse_new_requests(self, message: str, code: str) -> None:
        """From now on refuse every new request with ``ServerUnavailableError(message, code)`` (requests the
        HTTP layer admitted earlier, still being tokenized, may start)."""
        self._gate.drain(message, code)

    def fail_pending(self, message: str, code: str, backend_alive: bool) -> int:
        """End every request in flight (and refuse later ones) with that error; returns how many."""
        self._gate.close(message, code)
        return sum(run.fail(PdRequestFailed(message, code, "stopped")) for run in list(self._runs.values()))

    async def wait_until_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every request to end; True if they all did."""
        return await wait_until(lambda: not self._runs, timeout)

    def node_details(self, node_id: str) -> Dict[str, Any]:
        """What the request side adds to ``node_id``'s entry of ``GET /pd/nodes``: the requests
        placed on it and not yet seen leave (``in_flight_requests``), the placement's view of its
        load (report plus placements since: ``estimated_load``) and the epochs of its set-up
        transfer pairs (``transfer_epochs``)."""
        estimate = self.selector.estimate(node_id)
        free = estimate.free_kv_tokens
        return {
            "in_flight_requests": estimate.in_flight,
            "estimated_load": {
                "queued_prefill_tokens": estimate.queued_prefill_tokens,
                "running_requests": estimate.running_requests,
                "free_kv_tokens": None if free == float("inf") else int(free),
            },
            "transfer_epochs": self.pairs.epochs_of(node_id) if self.pairs is not None else [],
        }

    def continuations_pending(self, node_id: str) -> int:
        """What a draining node's heartbeat answer says may still come to it (``continuations_pending``).

        Continuation segments go to a draining node only while no serving node of its role is
        left; then every generation in flight here may still need one, so the node's drain waits
        for them (within its graceful period).  0 for a serving node or when a serving node of the
        role takes them.
        """
        state = self.registry.state(node_id)
        if state is None or state.serving or self.registry.serving(state.info.role):
            return 0
        return len(self._runs)

    def _on_node_dropped(self, info: NodeInfo, reason: str) -> None:
        failed = 0
        for run in list(self._runs.values()):
            role = run.depends_on(info.node_id)
            if role is not None:
                failed += run.fail(PdRequestFailed(
                    f"request {run.request_id}: the {role} {info.describe()} left the PD cluster ({reason})",
                    "pd_node_lost", "node_lost"))
        if failed:
            log.warning("failed %d request(s) in flight on %s", failed, info.describe())

    # --- the API layer's interface -------------------------------------------------------------
    def check_admission(self, request: Any = None) -> None:
        """See :meth:`RequestManager.check_admission`."""
        self._gate.check(request)

    def health(self) -> bool:
        """Requests are accepted: a prefill and a decode node are alive and the master is not stopping."""
        return self._gate.open and self.registry.ready

    def on_request_params(self, n: int, prompts: int = 1) -> None:
        """An API request's generations started: the master, which the client sends it to, observes
        its ``n`` (the nodes see single generations)."""
        self.metrics.requests.on_request_params(n, prompts)

    def metrics_text(self) -> Tuple[bytes, str]:
        """Prometheus exposition of the master's metrics."""
        return self.metrics.render()

    async def generate(self, spec: RequestSpec, *, request: Any = None) -> AsyncIterator[GenerationEvent]:
        """Run one generation through the PD cluster; one event per token, the last with a finish reason.

        The spec's ``high_priority_request`` (a trusted client's, checked by the HTTP layer)
        goes to both nodes with every segment: each admits the request ahead of the others.
        The master splits the generation into segments itself (:meth:`_segments`), counts its
        tokens (:class:`~.request_accounting.RequestAccounting`) and maps its failures to
        metrics (:meth:`_failure_reason`).
        """
        spec.check_fits(self.served.vocab_size, self.served.max_req_total_len)
        prompt_ids, params, high_priority = list(spec.prompt_ids), spec.params, spec.priority.high_priority_request
        self._gate.check(request)
        try:
            self.registry.require_ready()
        except ServerUnavailableError as exc:
            self.metrics.on_refusal(exc.code)  # a failed request too, though it never got an id
            raise
        if self._flow is None:
            raise ServerUnavailableError("The PD master has not started", "server_not_started")
        request_id = self._next_request_id
        self._next_request_id += 1
        run = RequestRun(request_id, request, high_priority=high_priority)
        self._runs[request_id] = run
        generation_started(request)
        accounting = RequestAccounting(self.metrics.requests, len(prompt_ids), params.max_new_tokens,
                                       reads_cache=params.prompt_logprobs is None)
        log.debug("request %d: %d prompt tokens, max_new_tokens %d", request_id, len(prompt_ids), params.max_new_tokens)
        try:
            await run.watch_client()
            async with contextlib.aclosing(self._segments(run, prompt_ids, params, accounting)) as events:
                async for event in events:
                    if event.finish_reason is not None:
                        await self._release_nodes(run)
                    yield event
        except ClientGone:
            accounting.end("abort")
            # Debug: the HTTP layer logs the departure once per API request (with its generation count).
            log.debug("request %d: the client went away; aborted on the nodes", request_id)
        except Exception as exc:
            accounting.end(self._failure_reason(request_id, exc))
            if not (isinstance(exc, PdRequestFailed) and exc.code in RANK_FAILURE_REASONS):
                raise
            # The node's rank ended the request (it failed, or its grammar could not go on): it ends
            # as on a normal server, with that finish (the client's 500 generation_failed or 400
            # grammar_failed), not as a failed node's 503.
            await self._release_nodes(run)
            yield GenerationEvent(request_id, -1, "", 0.0, RANK_FAILURE_REASONS[exc.code], len(prompt_ids),
                                  accounting.cached_tokens, accounting.completion_tokens)
        except (GeneratorExit, asyncio.CancelledError):
            # The HTTP layer closed or cancelled the generation: its client went away mid-answer
            # (a closed stream, a torn-down response).  The finally below aborts it on the nodes.
            if accounting.finish_reason is None:  # a close after the last event is the normal end, not a departure
                run.client_gone = True
                log.debug("request %d: the client went away (response closed); aborting it on the nodes", request_id)
            raise
        finally:
            # Bookkeeping before the first await: a cancelled caller may not get past it.
            run.cancel_streams()
            self._runs.pop(request_id, None)
            accounting.observe_end()
            await run.close_streams()

    @staticmethod
    async def _release_nodes(run: RequestRun) -> None:
        """Close the request's node streams (aborting what still runs there, freeing its KV and
        reservations) before its last event is handed on.

        The caller may ask for nothing after a generation's last event, or only later: the API's
        fan-out of ``n`` choices waits for every choice's first event before reading on (and
        closes a choice once its finish is read), and a single choice's generation is closed only
        when its consumer reads on.  What the nodes still hold for a finished generation (D's
        reservation of a request P finished, a generation the master ended on a stop string) must
        not wait for that: another choice of the same request may need that KV, and would be
        answered busy until it is freed.  Idempotent: the ``finally``
        of :meth:`generate` closes again whatever is left.
        """
        await run.close_streams()

    async def _segments(self, run: RequestRun, prompt_ids: List[int], params: SamplingParams,
                        accounting: RequestAccounting) -> AsyncIterator[GenerationEvent]:
        """The request's events over all its segments: the first, then a continuation after each one D ended.

        The text is decoded over every segment (:class:`~.generation_text.GenerationText`); a
        stop string it completes ends the request here, whichever segment it straddles.
        """
        request_id = run.request_id
        text = GenerationText(self.served.tokenizer, prompt_ids, params, self.served.eos_token_ids)
        segment = first_segment(request_id, prompt_ids, params)
        while True:
            async with contextlib.aclosing(self._segment_events(run, segment, text, accounting)) as events:
                async for event in events:
                    yield event
            if text.stopped:
                # The master decided the stop string (it may straddle segments): the nodes
                # are still generating, and closing their streams aborts the request there.
                log.debug("request %d: stop string completed after %d tokens; aborting on the nodes",
                          request_id, accounting.completion_tokens)
                await run.close_streams()
                return
            end = run.segment_end
            if end is SegmentEnd.FINISHED or accounting.finish_reason is not None:
                return
            if end is None:
                raise PdRequestFailed(f"request {request_id}: segment {segment.segment_index} ended without an end",
                                      "pd_node_failed", "protocol")
            await run.close_streams()
            # A continuation only serves the client: one that left between two segments must not
            # get a new placement (asked now; the poll in RequestRun.next may be 0.5 s away).
            await run.require_client()
            following = next_segment(request_id, prompt_ids, params, accounting.generated, segment, end)
            if following is None:
                # Every token was generated but the segment did not say so: finish by length.
                accounting.end("length")
                last = GenerationEvent(request_id, -1, "", 0.0, "length", len(prompt_ids), accounting.cached_tokens,
                                       accounting.completion_tokens)
                text.apply(last)
                yield last
                return
            log.info("request %d: segment %d ended (%s) after %d tokens; continuing as segment %d",
                     request_id, segment.segment_index, end.value, accounting.completion_tokens,
                     following.segment_index)
            self.metrics.on_continuation()
            segment = following

    async def _segment_events(self, run: RequestRun, segment: ContinuationSegment, text: GenerationText,
                              accounting: RequestAccounting) -> AsyncIterator[GenerationEvent]:
        """One segment's token lines as the client's events, with the master's usage and text.

        Ends with the segment's stream, or at the event that completes a stop string.
        """
        assert self._flow is not None  # generate refuses requests before start
        request_id = run.request_id
        async with contextlib.aclosing(self._flow.run(run, segment)) as lines:
            async for line in lines:
                try:
                    event = token_from_line(line, request_id, accounting.prompt_tokens,
                                            accounting.completion_tokens + 1)
                except (KeyError, TypeError, ValueError) as exc:
                    raise PdRequestFailed(f"request {request_id}: a node sent a malformed token line "
                                          f"{line!r}: {exc}", "pd_node_failed", "protocol") from None
                # Usage is the master's count: the client's prompt, the first segment's cache hit.
                accounting.count(event)
                event.finish_reason = event.finish_reason or None
                text.apply(event)
                if event.finish_reason is not None:
                    accounting.end(event.finish_reason)
                yield event
                if text.stopped:
                    return

    def _failure_reason(self, request_id: int, exc: Exception) -> str:
        """Count and log why a request failed; returns the finish reason its request metrics get."""
        if isinstance(exc, PdRequestFailed):
            self.metrics.on_failure(exc.reason)
            log.warning("request %d failed (%s): %s", request_id, exc.code, exc)
            return RANK_FAILURE_REASONS.get(exc.code, "error")
        elif isinstance(exc, ServerBusyError):
            self.metrics.on_refusal("server_busy")
            log.info("request %d refused: %s", request_id, exc)
            return FINISH_REASON_BUSY  # refused, not run: not a finished request (but a failed one)
        elif isinstance(exc, ServerUnavailableError):
            self.metrics.on_refusal(exc.code)
            log.warning("request %d refused (%s): %s", request_id, exc.code, exc)
        return "error"
