"""A model rank's loop: take the iteration's commands, apply them, step the backend, publish.

:func:`~lightllm.server.model_rank.rank_assembly.build_model_rank` (the composition root: device,
TP group, model, KV cache, backend and, on rank 0, sockets and publisher) returns a
:class:`ModelRank`, the loop itself, which only sees its collaborators; tests build one directly
from fakes.

Rank 0 talks to the router and the detokenization process; with TP > 1 it sends the other ranks
the same command list before every step over a :class:`TpCommandChannel` (:mod:`.command_channel`),
so all ranks run identical scheduling decisions, and sends nothing but a rare keep-alive while
idle, when the other ranks block in the channel.

Admission is screened on rank 0 before the broadcast: a request whose shared-memory record does
not read back as a valid request becomes a :class:`RejectRequests` entry, so every rank finishes
it with an error and none of them runs it.  The other ranks read an admitted request's record
themselves as they apply the command, possibly after rank 0 has stepped on; so with TP > 1 a
:class:`~.record_read_fence.RecordReadFence` holds the publication of a step that finishes a
request no forward has shown every rank to have read yet, until every rank has (the HTTP side
frees the record once rank 0 publishes the finish).

A constrained request's grammar compiles on each rank's compile thread from intake on, and the
request is held out of the steps meanwhile (vLLM's ``WAITING_FOR_FSM``); which requests may run
is rank 0's decision like any other: once its compile has ended, rank 0 adds a
:class:`GrammarsReady` command to the iteration's list, so every rank releases them before the
same step (or, where rank 0's compile raised, finishes them with an error).  Until then rank 0
polls (``IDLE_POLL_MS``) when nothing else runs, and does not wait at all once a compile has ended.

The loop is the same in every run mode: each admitted request goes to ``backend.intake``, any
command it does not know to ``backend.on_command``, and ``backend.poll`` runs once per
iteration.  A PD node's backend carries the rank's KV transfer (:mod:`.pd_transfer`) behind
those hooks: the transfer setup arrives as a command like the others, a decode node's prefilled
arrivals are reserved (or answered busy) at intake, a prefill node's hand-offs are sent right
after the step that produced them, and transfer results are polled once per loop; rank 0 tells
the HTTP process what it needs (setup done, reserved, transfer outcome) in its step output
stream through the detokenizer (``StepOutput.notices``), ahead of the tokens and finish they
explain.
"""


from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import zmq

from lightllm.server.core.objs.io_messages import AbortRequests, AddRequests
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_heartbeats import HeartbeatStamp, beat_of
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.model_rank.command_channel import MessageKind, TpCommandChannel
from lightllm.server.model_rank.prefill_wait_tracker import PrefillWaitTracker
from lightllm.server.model_rank.record_read_fence import RecordReadFence
from lightllm.server.model_rank.scheduling.backend_registry import ModeBackend
from lightllm.server.model_rank.step_publisher import StepPublisher
from lightllm.server.model_rank.step_trace import StepTrace
from lightllm.utils.envs_utils import DEFAULT_IDLE_MALLOC_TRIM_SECONDS
from lightllm.utils.gc_tuning import freeze_startup_objects
from lightllm.utils.malloc_tuning import IdleMallocTrimmer

log = logging.getLogger("lightllm.model_rank")

# Rank 0's inbox wait while requests are running but the last step could do nothing (all
# paused, or held for their grammar's compile) or KV transfers are in flight: short, since only
# time, a transfer result or a finished compile unblocks them.
IDLE_POLL_MS = 20
# Rank 0's longest inbox wait with nothing running: a message ends it at once, so this only bounds
# how late the idle-time duties run (giving freed memory back, noticing a broken KV transfer).
LEADER_IDLE_WAKE_MS = 1000


@dataclass
class RejectRequests:
    """Rank 0 -> every rank, inside the broadcast command list: finish these requests with an error.

    ``requests`` holds ``(request_id, shm_index)`` pairs the router asked to admit but whose
    records failed rank 0's admission check.
    """

    requests: List[Tuple[int, int]] = field(default_factory=list)


@dataclass
class GrammarsReady:
    """Rank 0 -> every rank, inside the broadcast command list: the held requests whose grammar
    compile ended on rank 0.  ``request_ids`` compiled there and may be scheduled now; ``failed``
    raised there and every rank finishes them with an error (rank 0's outcome is every rank's: a
    compile may raise on one rank only)."""

    request_ids: List[int] = field(default_factory=list)
    failed: List[int] = field(default_factory=list)


class ModelRank:
    """One rank's loop: take the iteration's commands, apply them, step the backend, publish (rank 0).

    Build a server's with :func:`~lightllm.server.model_rank.rank_assembly.build_model_rank`.

    Args:
        backend: the run mode's backend (intake, hooks and the step engine).
        shm: the request records (rank 0 screens them; every rank reads admitted ones).
        is_leader: rank 0, which reads the inbox, screens, and sends the other ranks their commands.
        channel: the TP command channel (None with TP = 1).
        inbox: rank 0's zmq PULL socket (router and HTTP messages).
        publisher: rank 0's step publisher (None elsewhere: only rank 0 publishes).
        wait_tracker: rank 0's prefill-wait metrics, fed at admission.
        idle_trim_seconds: idle seconds before freed heap memory goes back to the kernel (inf: never).
        step_trace: rank 0's per-step trace (``LIGHTLLM_STEP_TRACE``), or None.
        heartbeat: this rank's field of the watchdog's heartbeats (``--watchdog_timeout``), stamped
            once per loop iteration; None: not watched.
    """

    def __init__(
        self,
        backend: ModeBackend,
        shm: ShmReqBuffer,
        *,
        is_leader: bool,
        channel: Optional[TpCommandChannel] = None,
        inbox: Any = None,
        publisher: Optional[StepPublisher] = None,
        wait_tracker: Optional[PrefillWaitTracker] = None,
        idle_trim_seconds: float = DEFAULT_IDLE_MALLOC_TRIM_SECONDS,
        step_trace: Optional[StepTrace] = None,
        heartbeat: Optional[HeartbeatStamp] = None,
    ) -> None:
        self.backend = backend
        self.idle_trim_seconds = idle_trim_seconds
        self.step_trace = step_trace
        self.shm = shm
        self.is_leader = is_leader
        self.channel = channel
        self.inbox = inbox
        self.publisher = publisher
        self.wait_tracker = wait_tracker
        self.heartbeat = heartbeat
        self._stop_requested = False
        self._last_step_did_work = False
        # Rank 0's screened reads of admitted records, reused by apply() instead of reading again.
        self._screened: Dict[int, RequestSpec] = {}
        # With TP > 1: every rank's record reads end before rank 0 publishes those requests' finish.
        self.read_fence: Optional[RecordReadFence] = (
            RecordReadFence(channel.wait_for_ranks) if channel is not None else None)

    def receive_commands(self) -> Optional[List[Any]]:
        """This iteration's commands, the same list in the same order on every rank; None: stop.

        Rank 0 drains its inbox and screens it; with TP > 1 it sends the result to the other
        ranks only when they have something to do (commands, running requests, transfers in
        flight), and otherwise at most a keep-alive.  The other ranks block in the channel.
        """
        if not self.is_leader:
            message = self.channel.receive()
            if message.kind is MessageKind.SHUTDOWN:
                return None
            # A keep-alive comes only while rank 0 runs nothing, and every rank holds the same
            # requests and transfers, so the empty pass it causes here steps and gathers nothing.
            return message.commands
        if self._stop_requested:
            if self.channel is not None:
                self.channel.send_shutdown()
            return None
        commands: List[Any] = []
        if self.inbox.poll(self._inbox_wait_ms()):
            while True:
                try:
                    commands.append(self.inbox.recv_pyobj(zmq.NOBLOCK))
                except zmq.Again:
                    break
        commands = self.screen(commands)
        compiled, failed = self.backend.grammars_compiled()
        if compiled or failed:
            commands.append(GrammarsReady(compiled, failed))
        if self.channel is not None:
            # With no commands the ranks' state is what it was after the last step, so rank 0's
            # own view tells whether the others have anything to run in this iteration.
            if commands or self._ranks_busy():
                self.channel.send_step(commands)
            else:
                self.channel.keep_alive()
        return commands

    def _ranks_busy(self) -> bool:
        """Whether this iteration runs a step or a transfer agreement (the same on every rank)."""
        return self.backend.has_work or self.backend.has_outside_work

    def _inbox_wait_ms(self) -> int:
        """Rank 0: how long to wait for the first message of this iteration."""
        if self.backend.has_work and self._last_step_did_work:
            return 0
        if any(self.backend.grammars_compiled()):  # a held request can run (or end) at once
            return 0
        # A stalled batch (all requests paused) or transfers in flight are polled, not spun on.
        if self._ranks_busy():
            return IDLE_POLL_MS
        wait_ms = LEADER_IDLE_WAKE_MS
        if self.channel is not None:
            wait_ms = min(wait_ms, math.ceil(self.channel.seconds_until_keepalive() * 1000))
        return wait_ms

    def stop(self) -> None:
        """Rank 0: leave :meth:`serve_forever` at the next iteration, taking the other ranks along."""
        self._stop_requested = True

    def screen(self, commands: List[Any]) -> List[Any]:
        """Rank 0: split each AddRequests into requests that read back valid and RejectRequests.

        This is the guard of shared memory: reading a record rebuilds its :class:`RequestSpec`
        (whose own checks run again on what the record holds) and :meth:`check_request` adds
        this rank's limits; nothing after it checks the request again.  Any failure reading or
        checking one record is that request's alone.
        """
        screened: List[Any] = []
        for command in commands:
            if not isinstance(command, AddRequests):
                screened.append(command)
                continue
            accepted, rejected = [], []
            for request_id, shm_index in command.requests:
                try:
                    spec = self.shm.read_request(shm_index, request_id)
                    self.backend.check_request(spec)
                except Exception as exc:  # noqa: BLE001 - reported to the request's client instead
                    log.warning("rejecting request %d at admission: %s", request_id, exc)
                    rejected.append((request_id, shm_index))
                    continue
                self._screened[request_id] = spec
                accepted.append((request_id, shm_index))
            if accepted:
                screened.append(AddRequests(accepted, leader_time=time.monotonic()))
            if rejected:
                screened.append(RejectRequests(rejected))
        return screened

    def _read_request(self, request_id: int, shm_index: int) -> RequestSpec:
        screened = self._screened.pop(request_id, None)
        if screened is not None:
            return screened
        return self.shm.read_request(shm_index, request_id)

    def apply(self, commands: List[Any]) -> None:
        """Admit, reject and abort requests as the (screened) commands say; other commands go to the backend."""
        for command in commands:
            if isinstance(command, AddRequests):
                self.backend.observe_time(command.leader_time)
                if self.read_fence is not None:
                    self.read_fence.admitted(request_id for request_id, _ in command.requests)
                for request_id, shm_index in command.requests:
                    self._admit(request_id, shm_index)
            elif isinstance(command, RejectRequests):
                for request_id, shm_index in command.requests:
                    self.backend.reject(request_id, shm_index)
            elif isinstance(command, AbortRequests):
                for request_id in command.request_ids:
                    self.backend.abort(request_id)
            elif isinstance(command, GrammarsReady):
                self.backend.grammars_ready(command.request_ids, command.failed)
            else:
                self.backend.on_command(command)

    def _admit(self, request_id: int, shm_index: int) -> None:
        try:
            req = self.backend.intake(request_id, self._read_request(request_id, shm_index), shm_index)
        except Exception:  # noqa: BLE001 - one request must not stop the rank
            # Every rank takes this branch together and stays in step: each has the same spec
            # (rank 0 from its screen, the others from the same record, which is still the
            # request's while they read it: rank 0 publishes no finish before, RecordReadFence)
            # and the same state to admit it into.  Only a fault of one rank's own (a compile
            # thread that cannot start) takes it there alone, like any fault of one rank: the
            # ranks then disagree about the request, and when its end is the fence's to wait for,
            # one rank waits in the fence's barrier while the other does not, so the group
            # stalls until the watchdog (--watchdog_timeout) stops the server with an error.
            log.exception("admitting request %d failed; finishing it with an error", request_id)
            self.backend.reject(request_id, shm_index)
            return
        if req is not None and self.is_leader:
            self.shm.set_prompt_cache_len(shm_index, request_id, req.prompt_cache_len)
            if self.wait_tracker is not None:
                self.wait_tracker.on_arrival(req)

    def serve_forever(self) -> None:
        """The rank's main loop; it beats before and right after each wait for commands.

        The beat after the wait starts the step's count: a step may run for the whole watchdog
        timeout (lightllm/server/launch/watchdog.py), however long the wait before it was.  Idle,
        the waits end at most ``LEADER_IDLE_WAKE_MS`` apart on rank 0 and one keep-alive period of
        the command channel (5 s) apart on the other ranks, far below the watchdog's minimum.
        """
        # Freed activation memory goes back to the kernel once the rank has been idle a while.
        trimmer = IdleMallocTrimmer(self.idle_trim_seconds)
        freeze_startup_objects()
        beat = beat_of(self.heartbeat)
        while True:
            beat()
            commands = self.receive_commands()
            beat()  # the wait is over: what follows is this iteration's work
            if commands is None:
                return
            self.apply(commands)
            self.backend.poll()
            if not self.backend.has_work:
                if self.publisher is not None:
                    self.publisher.flush_notices()  # a setup answer or notice with no step to carry it
                trimmer.idle()
                continue
            trimmer.busy()
            trace = self.step_trace
            if trace is not None:
                trace.begin()
            report = self.backend.step()
            self._last_step_did_work = report.did_work
            if trace is not None:
                trace.stepped()
            if self.read_fence is not None:  # on every rank: they all wait here, or none does
                self.read_fence.before_publish(report)
            if self.publisher is not None:
                self.publisher.publish(report)
            if trace is not None:
                trace.end(report)
