"""One segment of a PD request on the master: placement, decode reserves first, prefill, hand-off, decode.

For a segment (:mod:`.continuation`) of a request the master

1. places it: a prefill node and a decode node (:mod:`.node_selector`), and makes sure their
   pair is set up (:mod:`.pair_setup`);
2. opens ``D /pd/node/decode`` with the reservation's lease (:attr:`.phase_deadlines.PhaseDeadlines.reserve_lease_s`:
   how long the master itself waits for the KV); D answers ``reserved`` (its prefix-cache hit as
   ``kv_start``), ``busy`` (at once; :class:`~.busy_retry.NodeBusy`) or ``error`` -- deadline
   ``--pd_decode_token_timeout_seconds``;
3. opens ``P /pd/node/prefill`` with that ``kv_start`` and the segment's inference priority;
   P answers the first token -- deadline ``--pd_prefill_timeout_seconds`` -- or ``busy``
   (the reservation on D is closed);
4. hands P's first token to the client at once; when it finishes the request nothing moves,
   and both streams are closed (D's reservation freed) before the token is handed on;
5. reads D's stream (deadline per event ``--pd_decode_token_timeout_seconds``): the first token
   is D's echo of P's (checked, not shown), then D's tokens until a finish, ``segment_end``
   (the master continues with a new segment) or ``error``.  P's ``handed_off`` or D's echo,
   whichever the master reads first, ends the request's dependence on P (D echoes only once
   both sides agreed the KV arrived); before that an ``error`` from P, or losing P, ends the
   request.

A busy node is set aside and the segment placed again on the next best node of that role
(another decode node when D's KV is full, another prefill node when P's queue is); only when
every serving node of the role answered busy does the busy-retry policy (:mod:`.busy_retry`)
take over, which waits (or answers 503) and then tries all of them again.  So is a node that
cannot be reached, or whose pair cannot be set up, before the segment's first token (a killed
node the heartbeat rule has not dropped yet): nothing reached the client, so the segment moves
on, and fails only when no other node of the role is left.  A continuation
whose previous segment ended on KV pressure tries other decode nodes before that one.

An error line with ``transfer_broken`` makes the pair be set up again; when it comes before the
segment produced anything the segment is dispatched once more on the new pair.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, AsyncIterator, Callable, Collection, Dict, Set, Tuple

from lightllm.server.pd.master.busy_retry import BusyRetryPolicy, NodeBusy
from lightllm.server.pd.master.continuation import ContinuationSegment, SegmentEnd
from lightllm.server.pd.master.metrics import MasterMetrics
from lightllm.server.pd.master.node_failures import node_error, protocol_error
from lightllm.server.pd.master.phase_deadlines import PhaseDeadlines
from lightllm.server.pd.protocol.membership import DECODE_PATH, PREFILL_PATH
from lightllm.server.pd.protocol.node_events import BUSY, ERROR, HANDED_OFF, RESERVED, SEGMENT_END, TOKEN
from lightllm.server.pd.protocol.node_info import DECODE, PREFILL
from lightllm.server.pd.protocol.stream_lines import DecodeBody, NodeLine, body_fields, read_line
from lightllm.server.pd.master.node_selector import NodeSelector
from lightllm.server.pd.master.node_streams import STREAM_END, NodeCallError, NodeStreams
from lightllm.server.pd.master.pair_setup import PairSetup, PairSetupFailed, TransferPair
from lightllm.server.pd.master.request_run import PdRequestFailed, RequestRun
from lightllm.server.pd.master.node_registry import NOT_READY_CODE
from lightllm.server.manager_errors import ServerUnavailableError

log = logging.getLogger(__name__)


def decode_body(run: RequestRun, segment: ContinuationSegment, epoch: int, lease_s: float) -> DecodeBody:
    """The decode node's body of ``segment`` on the pair of ``epoch`` (its reservation held ``lease_s``).

    Every field is set here, none left to the model's default: the contract test checks that the
    master decides each field the node reads.
    """
    return DecodeBody(
        request_id=segment.request_id,
        prompt_ids=segment.prompt_ids,
        params=segment.params.to_dict(),
        segment_index=segment.segment_index,
        generated_before=segment.generated_before,
        epoch=epoch,
        # A continuation's client is mid-answer: both nodes admit it ahead of new requests,
        # as a trusted client's priority request (the nodes' overtaking bound still applies).
        high_priority_request=run.high_priority or segment.segment_index > 0,
        reserve_lease_seconds=lease_s,
    )


class SegmentFlow:
    """Places and runs segments of requests on (P, D) pairs (one instance per master)."""

    def __init__(self, pairs: PairSetup, selector: NodeSelector, nodes: NodeStreams, deadlines: PhaseDeadlines,
                 metrics: MasterMetrics) -> None:
        self.pairs = pairs
        self.selector = selector
        self.nodes = nodes
        self.deadlines = deadlines
        self.metrics = metrics

    def _busy_policy(self) -> BusyRetryPolicy:
        # The timeout was read and checked at start-up: a request never reads the environment.
        return BusyRetryPolicy(timeout_s=self.deadlines.busy_retry_s, on_retry=self.metrics.on_retry)

    async def _dispatch_once(self, run: RequestRun, segment: ContinuationSegment,
                             avoid: Collection[str]) -> Tuple[TransferPair, NodeLine]:
        """Place and start the segment, moving on to the next best node of a role when the chosen
        one answers busy, cannot be reached or cannot be set up (nothing reached the client yet).

        Raises :class:`NodeBusy` once every serving node of a role answered busy (or failed, at
        least one of them busy), else the last node's failure.
        """
        busy: Dict[str, Dict[str, NodeBusy]] = {PREFILL: {}, DECODE: {}}
        down: Dict[str, Set[str]] = {PREFILL: set(), DECODE: set()}
        while True:
            try:
                return await self._try_pair(run, segment, busy, down, avoid)
            except NodeBusy as answer:
                busy[answer.role][answer.node_id] = answer
                role, failure, why = answer.role, answer, "busy"
            except (PdRequestFailed, PairSetupFailed) as exc:
                # A prefill node that left before it got the request (D's reservation was freed as
                # its stream closed) is passed over like an unreachable one.
                lost = isinstance(exc, PdRequestFailed) and exc.reason == "node_lost" and exc.role == PREFILL
                unreachable = isinstance(exc, PairSetupFailed) or exc.reason == "node_unreachable"
                if not (lost or unreachable) or not exc.node_id or exc.role not in down:
                    raise
                down[exc.role].add(exc.node_id)
                role, failure, why = exc.role, exc, "left the cluster" if lost else "unusable"
            if not self.selector.candidates(role, set(busy[role]) | down[role], segment.segment_index > 0):
                if busy[role] and not isinstance(failure, NodeBusy):
                    # Some node of the role was only busy: the busy policy may wait for it.
                    raise next(reversed(busy[role].values()))
                if why == "left the cluster" and not self.selector.registry.ready:
                    # No other node of the role: the answer /health gives now (pd_not_ready).
                    raise self.selector.registry.not_ready_error()
                raise failure
            log.info("request %d: %s node %s %s (%s); placing it on the next one", run.request_id, role,
                     getattr(failure, "node_id", ""), why, failure)

    async def _try_pair(self, run: RequestRun, segment: ContinuationSegment, busy: Dict[str, Dict[str, NodeBusy]],
                        down: Dict[str, Set[str]], avoid: Collection[str]) -> Tuple[TransferPair, NodeLine]:
        """Steps 1-3 on one choice of nodes: place, reserve on D, prefill on P; returns the pair and P's first token.

        On any failure past placement the segment's streams are closed before it propagates.
        """
        if run.failure is not None:  # failed while waiting to retry a busy node
            raise run.failure
        try:
            pair = await self._place(run, segment, busy, down, avoid)
            reserve, kv_start = await self._reserve_decode(run, segment, pair)
            first = await self._prefill_first_token(run, segment, pair, reserve, kv_start)
            return pair, first
        except BaseException:
            await run.close_streams()
            raise

    async def _place(self, run: RequestRun, segment: ContinuationSegment, busy: Dict[str, Dict[str, NodeBusy]],
                     down: Dict[str, Set[str]], avoid: Collection[str]) -> TransferPair:
        """Step 1: hold a prefill and a decode node (none in ``busy`` or ``down``) and set their pair up."""
        kv_tokens = len(segment.prompt_ids) + segment.params.max_new_tokens
        # Both placements before the first await: concurrent requests see each other's.
        # A continuation (its client is streaming) may go to a draining node when no serving one is left.
        continuation = segment.segment_index > 0
        prefill = self.selector.place(PREFILL, segment.prompt_ids, kv_tokens,
                                      exclude=set(busy[PREFILL]) | down[PREFILL], continuation=continuation)
        run.hold(PREFILL, prefill)
        decode = self.selector.place(DECODE, segment.prompt_ids, kv_tokens,
                                     exclude=set(busy[DECODE]) | down[DECODE], avoid=avoid,
                                     continuation=continuation)
        run.hold(DECODE, decode)
        prefill_node = self.selector.registry.get(prefill.node_id)
        decode_node = self.selector.registry.get(decode.node_id)
        if prefill_node is None or decode_node is None:
            raise ServerUnavailableError("The PD cluster is not ready: a node left while the request was placed",
                                         NOT_READY_CODE)
        return await self.pairs.pair_for(prefill_node, decode_node)

    async def _reserve_decode(self, run: RequestRun, segment: ContinuationSegment,
                              pair: TransferPair) -> Tuple[DecodeBody, int]:
        """Step 2: open D's stream with the reservation's lease; returns the body sent and D's ``kv_start``.

        Raises :class:`NodeBusy` when D answers busy, else a failure for an error or an unexpected line.
        """
        # Until P is asked to prefill, the request needs only D: a prefill node dropped while D
        # reserves (which may wait behind D's queue) is replaced (:meth:`_prefill_first_token`), not the
        # request failed.
        run.nodes = {DECODE: pair.decode}
        run.previous_decode = pair.decode
        started = time.monotonic()
        reserve = decode_body(run, segment, pair.epoch, self.deadlines.reserve_lease_s)
        run.track(self.nodes.stream(pair.decode, DECODE_PATH, body_fields(reserve), run.sink(DECODE)))
        line = read_line(await run.next(DECODE, self.deadlines.decode_token_s, "KV reservation answer"))
        if line.kind == BUSY:
            self.metrics.on_busy(DECODE)
            raise NodeBusy(DECODE, line.message or "no KV or request slot free", pair.decode.node_id)
        if line.kind == ERROR:
            raise node_error(run, self.pairs, pair, DECODE, line)
        kv_start = line.kv_start
        if line.kind != RESERVED or kv_start is None:
            raise protocol_error(run, pair, DECODE, "a reserved, busy or error event", line)
        self.metrics.on_phase("reserve", time.monotonic() - started)
        return reserve, kv_start

    async def _prefill_first_token(self, run: RequestRun, segment: ContinuationSegment, pair: TransferPair,
                                   reserve: DecodeBody, kv_start: int) -> NodeLine:
        """Step 3: open P's stream from D's ``kv_start`` and read P's first token, watching D's stream meanwhile.

        Raises :class:`NodeBusy` when P answers busy, else a failure for P gone from the cluster, an
        error from either node or an unexpected line.
        """
        if self.selector.registry.get(pair.prefill.node_id) != pair.prefill:
            raise PdRequestFailed(f"request {run.request_id}: the {PREFILL} {pair.prefill.describe()} left the PD "
                                  "cluster while the decode node reserved KV", "pd_node_lost", "node_lost",
                                  role=PREFILL, node_id=pair.prefill.node_id)
        # From here the request needs P too (no await in between: a drop now fails it).
        run.nodes[PREFILL] = pair.prefill
        body = reserve.prefill_body(kv_start=kv_start, infer_high_priority=segment.infer_high_priority)
        started = time.monotonic()
        run.prefill_stream = run.track(self.nodes.stream(pair.prefill, PREFILL_PATH, body_fields(body),
                                                         run.sink(PREFILL)))

        def watch_decode(payload: Any) -> None:
            # D failing while P prefills (it died, its lease expired) ends the request now,
            # not after P's first token; D's ordinary lines wait for their turn.
            if payload is STREAM_END and run.has_buffered(DECODE):
                # D has the token from P's KV header and may finish its whole segment before
                # P's line reaches the master: its end of stream follows lines still to be
                # read, which decide whether it came too early.
                run.keep(DECODE, payload)
                return
            event = read_line(run.check(DECODE, payload, "echo of the first token"))
            if event.kind == ERROR:
                raise node_error(run, self.pairs, pair, DECODE, event)
            run.keep(DECODE, payload)

        line = read_line(await run.next(PREFILL, self.deadlines.prefill_s, "first token", watch_decode))
        if line.kind == BUSY:
            self.metrics.on_busy(PREFILL)
            raise NodeBusy(PREFILL, line.message or "its queue is full", pair.prefill.node_id)
        if line.kind == ERROR:
            raise node_error(run, self.pairs, pair, PREFILL, line)
        if not line.is_token:
            raise protocol_error(run, pair, PREFILL, "the first token", line)
        self.metrics.on_phase("prefill", time.monotonic() - started)
        return line

    async def _dispatch(self, run: RequestRun, segment: ContinuationSegment,
                        avoid: Collection[str]) -> Tuple[TransferPair, NodeLine]:
        retried_broken = False

        async def attempt() -> Tuple[TransferPair, NodeLine]:
            nonlocal retried_broken
            try:
                return await self._dispatch_once(run, segment, avoid)
            except PdRequestFailed as exc:
                if not exc.transfer_broken or retried_broken:
                    raise
                # A node lost its transfer group (or missed a setup) before this segment started:
                # the pair was invalidated, so one more attempt runs on a fresh setup.
                retried_broken = True
                return await self._dispatch_once(run, segment, avoid)

        return await self._busy_policy().run(attempt)

    async def run(self, run: RequestRun, segment: ContinuationSegment) -> AsyncIterator[Dict[str, Any]]:
        """Yield the segment's new token lines (P's first, then D's); sets ``run.segment_end``.

        ``run.segment_end`` is :class:`SegmentEnd` ``FINISHED`` when the request is done, or
        why D ended the segment.  A token-less finish is yielded as a line with ``token_id`` -1.
        """
        previous = run.previous_decode
        # D gave the request's KV back because it ran out: the segment goes elsewhere if it can.
        avoid = {previous.node_id} if previous is not None and run.segment_end is SegmentEnd.KV_PRESSURE else set()
        run.segment_end = None
        pair, first = await self._dispatch(run, segment, avoid)
        got_first = time.monotonic()
        if first.finish_reason:
            run.segment_end = SegmentEnd.FINISHED
            # D's reservation is freed before the token is handed on, not once the caller asks
            # for more: a caller may never ask past a generation's last event (the API's fan-out
            # of n choices waits for every choice's first event first), and another choice of
            # the same request may wait for this very KV (it answers busy until it is freed).
            await run.close_streams()
            yield first.fields
            return
        yield first.fields
        handed_off = False

        def done_with_prefill() -> None:
            nonlocal handed_off
            handed_off = True
            run.nodes.pop(PREFILL, None)  # P's part is done; losing P no longer matters
            run.release(PREFILL)
            if run.prefill_stream is not None:
                # P ends its stream with handed_off once its own side of the transfer reports; closing
                # it first (the request may end on D before that) would make P count an abort.
                run.release_stream(run.prefill_stream, self.deadlines.handoff_s)
                run.prefill_stream = None

        def on_prefill(payload: Any) -> None:
            if handed_off or payload is STREAM_END:
                return
            if isinstance(payload, NodeCallError):
                raise PdRequestFailed(f"request {run.request_id}: {payload}", "pd_node_unreachable", "node_unreachable")
            line = read_line(payload)
            if line.kind == HANDED_OFF:
                done_with_prefill()
            elif line.kind == ERROR:
                raise node_error(run, self.pairs, pair, PREFILL, line)
            else:
                raise protocol_error(run, pair, PREFILL, "handed_off or error", line)

        echo = read_line(await run.next(DECODE, self.deadlines.decode_token_s, "echo of the first token (KV transfer)",
                                        on_prefill))
        if echo.kind == ERROR:
            raise node_error(run, self.pairs, pair, DECODE, echo)
        if echo.kind != TOKEN or echo.token_id != first.token_id:
            raise protocol_error(run, pair, DECODE, f"the echo of the prefill node's first token {first.token_id}",
                                  echo)
        # D echoes P's token only once both sides agreed the KV arrived: from here D needs nothing
        # of P, whether or not P's handed_off line has reached the master yet (P may be busy or
        # die before sending it; the request must not fail with it).
        done_with_prefill()
        echoed = time.monotonic()
        self.metrics.on_phase("transfer", echoed - got_first)
        if echo.finish_reason:
            run.segment_end = SegmentEnd.FINISHED
            yield echo.without_token()
            return
        async with contextlib.aclosing(self._decode_tokens(run, pair, echoed, on_prefill)) as tokens:
            async for fields in tokens:
                yield fields

    async def _decode_tokens(self, run: RequestRun, pair: TransferPair, echoed: float,
                             on_prefill: Callable[[Any], None]) -> AsyncIterator[Dict[str, Any]]:
        """Step 5 past D's echo: yield D's token lines until a finish, ``segment_end`` or ``error``; sets
        ``run.segment_end``.

        ``echoed``: when the echo was read (the first decode token's phase is timed from it);
        ``on_prefill``: what a line of P's stream read meanwhile does.
        """
        first_decode = True
        while True:
            line = read_line(await run.next(DECODE, self.deadlines.decode_token_s, "next token", on_prefill))
            if line.is_token:
                if first_decode:
                    first_decode = False
                    self.metrics.on_phase("first_decode_token", time.monotonic() - echoed)
                yield line.fields
                if line.finish_reason:
                    run.segment_end = SegmentEnd.FINISHED
                    return
            elif line.kind == SEGMENT_END:
                try:
                    run.segment_end = SegmentEnd(line.reason)
                except ValueError:
                    raise protocol_error(run, pair, DECODE, "a segment_end reason kv_pressure or segment_limit", line) from None
                if run.segment_end is SegmentEnd.FINISHED:
                    raise protocol_error(run, pair, DECODE, "a segment_end reason kv_pressure or segment_limit", line)
                return
            elif line.kind == ERROR:
                raise node_error(run, self.pairs, pair, DECODE, line)
            else:
                raise protocol_error(run, pair, DECODE, "a token, segment_end or error event", line)
