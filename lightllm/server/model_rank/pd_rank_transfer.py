"""A PD node rank's side of the KV transfer: setup, intake, hand-offs and agreed results.

One :class:`PdRankTransfer` lives in every model rank of a prefill or decode node, carried by
the rank's mode backend as its :class:`~.scheduling.pd_node_backend.TransferIntake`: the rank
loop calls the backend's hooks, the same in every run mode, and the backend hands them here with
itself as the argument.  Nothing here blocks the inference step:

* Pairs.  A node may be paired with several peers at once; the master numbers each pair with an
  ``epoch``, and the rank holds one :class:`KVTransferHandle` per epoch.
  :meth:`PdRankTransfer.setup` (a :class:`PdTransferSetup` command, broadcast to every rank,
  reaching here through :meth:`PdRankTransfer.on_command`) adds the handle of its epoch, or
  replaces it (requests the old one still held fail), and leaves the other epochs alone; a
  :class:`PdTransferTeardown` closes one epoch's handle (its requests fail as a broken
  transfer).  A prefill rank serves one TCP store on its transfer port + rank, started at its
  first setup, which every pair's transfer processes join (see ``pd/kv_transfer/store_host.py``);
  a decode rank's handle joins the prefill node's port + rank.
* :meth:`PdRankTransfer.take` admits a request of this node's PD kind, on the pair of its
  ``spec.pd.epoch``.  A prefill node joins it and remembers its ``kv_start`` and epoch.  A decode
  node reserves KV for the prompt plus what one segment may generate, or finishes the request
  ``FINISH_BUSY`` at once (after a ``busy`` notice naming the limit it hit); then it asks its
  epoch's handle to receive positions ``[kv_start, input_len)``, with the reservation's lease
  as the wait: the master's lease for the request (``spec.pd.lease_s``), bounded by
  ``--pd_reserve_lease_seconds`` (:meth:`PdRankSettings.lease_for`).  A request whose epoch has
  no handle fails as a broken transfer.
* :meth:`PdRankTransfer.after_step` (prefill node) sends each handed-off request's positions
  ``[kv_start, input_len)`` with its first token in the header, on its epoch's handle, right
  after the step.
* :meth:`PdRankTransfer.poll` (every iteration) polls every handle and acts on results that
  every TP rank has: with TP > 1 each rank moves its own KV-head shard and learns its outcome at
  its own time, so the ranks first exchange what they have (one small ``all_gather_object``
  while transfers are in flight) and act only on requests every rank reported: success when all
  succeeded.  Every rank hence takes the same decision in the same iteration (they apply the
  same setup and teardown commands in the same order, so they hold the same epochs).  A decode
  node's success admits the request with the first token from the header; the backend reports
  that token ahead of the next step's own, like a sampled one.

Aborts (:meth:`PdRankTransfer.on_abort`): a transfer that has not started is given up at once,
on either side: a prefill request whose send is still queued behind other transfers
(``cancel_send``; its master is gone, so the decode side no longer waits for it), a decode
request whose KV has not started arriving (``cancel_receive``).  A transfer already under way
ends first (the transfer process still reads or writes that KV): a prefill request then ends
when its send does, a decode request when its KV arrived (it is not decoded) or at the end of
its lease.  The transfer process reads cancellations at all times, also while it joins its
group or moves another request's KV, so an abort never waits for another pair's trouble.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from lightllm.server.core.objs.finish_status import FINISH_BUSY, FINISH_TRANSFER_FAILED
from lightllm.server.core.objs.io_messages import (
    PdChannelBroken,
    PdNotice,
    PdSetupDone,
    PdTransferSetup,
    PdTransferTeardown,
)
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_PREFILL
from lightllm.server.pd.kv_transfer import KVTransferHandle, TransferResult, TransferStoreHost
# Defined with the rest of a rank's start-up config (torch-free, for the launcher); imported from here too.
from lightllm.server.model_rank.rank_config import ModelRankConfig, PdRankSettings  # noqa: F401
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.decode_backend import KvReservationRefused
from lightllm.server.model_rank.scheduling.step_report import StepReport
from lightllm.server.run_mode import PD_NODE_MODES, RunMode

log = logging.getLogger("lightllm.pd_rank")

PD_ROLES = PD_NODE_MODES
# The PD kind of the requests each role runs (the kind its node's HTTP side writes).
ROLE_PD_KIND = {"prefill": PD_KIND_PREFILL, "decode": PD_KIND_DECODE}

# error_kind values of a failed transfer (the HTTP side's PdNodeEvent.error_kind).
ERROR_TRANSFER_FAILED = "transfer_failed"
ERROR_LEASE_EXPIRED = "lease_expired"
# A transfer given up before it started because its request was aborted (on_abort).
ERROR_TRANSFER_CANCELLED = "transfer_cancelled"
ERROR_TRANSFER_BROKEN = "transfer_broken"


@dataclass(frozen=True)
class _Outcome:
    """One rank's outcome of one request's transfer, as exchanged between TP ranks."""

    request_id: int
    ok: bool
    first_token: int
    seconds: float
    nbytes: int
    error_kind: str
    reason: str


Agree = Callable[[Any], List[Any]]  # all_gather of one picklable object per rank
Notify = Callable[[Any], None]  # rank 0: a message to the HTTP process
# make_handle(role, host, port, group_name, store_host): store_host is the prefill rank's store, None on decode.
MakeHandle = Callable[[str, str, int, str, Optional[TransferStoreHost]], KVTransferHandle]


def pair_group_name(epoch: int, rank: int) -> str:
    """The key prefix of one pair's transfer group between TP rank ``rank`` of each side."""
    return f"lightllm-kv/epoch-{epoch}/rank-{rank}"


class PdRankTransfer:
    """Owns one rank's KV transfer handles, one per pair, and is its PD backend's intake (see the module docstring).

    ``backend`` (every intake method's first argument) is the :class:`PrefillBackend` or
    :class:`DecodeBackend` that carries this transfer.  ``make_handle(role, host, port,
    group_name, store_host)`` builds a handle (a :class:`KVTransferHandle` over the rank's
    shareable cache; tests may pass their own); ``group_name`` names the pair and the rank, so
    both sides of one setup meet and nothing else does; ``store_host`` is the prefill rank's
    store (None on a decode rank).  ``agree`` is None for TP = 1; ``notify`` is None on ranks
    other than 0.
    """

    def __init__(
        self,
        role: str,
        rank: int,
        settings: PdRankSettings,
        make_handle: MakeHandle,
        agree: Optional[Agree] = None,
        notify: Optional[Notify] = None,
    ):
        if role not in PD_ROLES:
            raise ValueError(f"PD role must be one of {PD_ROLES}, got {role!r}")
        self.role = role
        self.rank = rank
        self.settings = settings
        self._make_handle = make_handle
        self._agree = agree
        self._notify = notify or (lambda message: None)
        # epoch -> that pair's handle (insertion order: the order setups were applied).
        self.handles: Dict[int, KVTransferHandle] = {}
        # Prefill rank: the one store every pair's transfer processes join (started at the first setup).
        self.store_host: Optional[TransferStoreHost] = None
        self._broken_reported: Set[int] = set()
        # Requests submitted to a transfer and not yet decided (the same set on every rank).
        self._in_flight: Dict[int, InferReq] = {}
        # The pair (epoch) each request in flight transfers through, for cancelling it.
        self._transfer_epochs: Dict[int, int] = {}
        # This rank's outcomes not yet agreed on.
        self._local: Dict[int, _Outcome] = {}
        # Prefill node: request id -> (first prompt position to send, epoch), from its record.
        self._pending_sends: Dict[int, Tuple[int, int]] = {}

    # --- setup ------------------------------------------------------------------------------
    def on_command(self, command: Any) -> bool:
        """Apply a :class:`PdTransferSetup` or :class:`PdTransferTeardown`; False for any other command."""
        if isinstance(command, PdTransferSetup):
            self.setup(command)
            return True
        if isinstance(command, PdTransferTeardown):
            self.teardown(command.epoch)
            return True
        return False

    def handle_for(self, epoch: int) -> Optional[KVTransferHandle]:
        """The handle of ``epoch``'s pair, or None."""
        return self.handles.get(epoch)

    @property
    def epochs(self) -> List[int]:
        """The epochs this rank holds a handle for."""
        return list(self.handles)

    def setup(self, command: PdTransferSetup) -> None:
        """Add (or replace) the handle of ``command.epoch``; rank 0 acknowledges to the HTTP process.

        Other epochs' handles are not touched.
        """
        epoch, error = command.epoch, ""
        try:
            self._close_epoch(epoch)
            store_host = None
            if self.role == RunMode.PREFILL:
                store_host = self._ensure_store_host()
                host, port = store_host.connect_host, store_host.port
            else:
                if not command.peer_host or command.peer_port <= 0:
                    raise ValueError(f"a decode node needs the prefill transfer address, got "
                                     f"{command.peer_host!r}:{command.peer_port}")
                host, port = command.peer_host, command.peer_port + self.rank
            self.handles[epoch] = self._make_handle(self.role, host, port, pair_group_name(epoch, self.rank),
                                                    store_host)
            log.info("rank %d: KV transfer handle for epoch %d (%s, %s:%d; %d pair(s))", self.rank, epoch,
                     self.role, host, port, len(self.handles))
        except Exception as exc:  # noqa: BLE001 - reported to whoever asked for the setup
            log.exception("rank %d: KV transfer setup for epoch %d failed", self.rank, epoch)
            error = f"KV transfer setup failed on rank {self.rank}: {exc}"
        self._notify(PdSetupDone(epoch, error))

    def teardown(self, epoch: int) -> bool:
        """Close the handle of ``epoch`` (a no-op when there is none); True if there was one.

        Requests still on it fail as a broken transfer of that pair; nothing is reported to the
        HTTP process besides their notices (it asked for the teardown).
        """
        closed = self._close_epoch(epoch)
        if closed:
            log.info("rank %d: KV transfer of epoch %d torn down (%d pair(s) left)", self.rank, epoch,
                     len(self.handles))
        return closed

    def _ensure_store_host(self) -> TransferStoreHost:
        if self.store_host is None:
            s = self.settings
            self.store_host = TransferStoreHost(s.listen_socket, s.transfer_host, s.transfer_port + self.rank,
                                                timeout_s=s.connect_timeout_s)
            log.info("rank %d: KV transfer store serving on port %d", self.rank, self.store_host.port)
        return self.store_host

    def close(self) -> None:
        """Stop every handle and the store (the rank is going away)."""
        for epoch in list(self.handles):
            self._close_epoch(epoch)
        if self.store_host is not None:
            self.store_host.close()
            self.store_host = None

    def _close_epoch(self, epoch: int) -> bool:
        old = self.handles.pop(epoch, None)
        self._broken_reported.discard(epoch)
        if old is None:
            return False
        old.close()
        for result in old.poll():  # requests it still held, now failed as a broken transfer
            self._record(result, True)
        return True

    # --- intake -----------------------------------------------------------------------------
    def take(self, backend: Any, request_id: int, spec: RequestSpec, shm_index: int = -1) -> Optional[InferReq]:
        """Admit a request of this node's PD kind into ``backend``; None when it ended at once (busy).

        Raises ``ValueError`` for a request of another kind.
        """
        if spec.pd.kind != ROLE_PD_KIND[self.role]:
            raise ValueError(f"a {self.role} node cannot run a request of PD kind {spec.pd.kind}")
        if self.role == RunMode.DECODE:
            req = self.reserve(backend, request_id, shm_index, spec)
            if req is not None and self.rank == 0:
                log.info("request %d reserved: segment_index=%d kv_start=%d prompt=%d lease=%gs", request_id,
                         spec.segment.segment_index, req.cur_kv_len, spec.prompt_len,
                         self.settings.lease_for(spec.pd.lease_s))
            return req
        req = backend.add_request(request_id, spec, shm_index)
        self._pending_sends[request_id] = (spec.pd.kv_start, spec.pd.epoch)
        if self.rank == 0:
            log.info("request %d admitted: segment_index=%d infer_high_priority=%d kv_start=%d prompt=%d",
                     request_id, spec.segment.segment_index, spec.priority.infer_high_priority,
                     spec.pd.kv_start, spec.prompt_len)
        return req

    def reserve(self, backend: Any, request_id: int, shm_index: int, spec: RequestSpec) -> Optional[InferReq]:
        """Decode node: reserve and start receiving, or finish ``FINISH_BUSY`` at once (None)."""
        try:
            decode_tokens = backend.segment_tokens(spec.params.max_new_tokens)
            req = backend.reserve_prefilled(request_id, spec, shm_index, decode_tokens=decode_tokens)
        except KvReservationRefused as exc:
            log.info("request %d: busy: %s", request_id, exc)
            # Ahead of the finish, like a transfer failure's notice: the busy answer names the limit.
            self._notify(PdNotice(request_id, "busy", error_kind=exc.limit, message=str(exc)))
            backend.reject(request_id, shm_index, FINISH_BUSY)
            return None
        kv_start = req.cur_kv_len
        self._in_flight[request_id] = req
        self._transfer_epochs[request_id] = spec.pd.epoch
        self._notify(PdNotice(request_id, "reserved", kv_start=kv_start))
        slots = backend.kv.slots(req, kv_start, req.input_len)
        lease_s = self.settings.lease_for(spec.pd.lease_s)
        self._submit(request_id, spec.pd.epoch, lambda handle: handle.receive(request_id, slots, wait_s=lease_s))
        return req

    def after_step(self, backend: Any, report: StepReport) -> None:
        """Prefill node: send the KV of every request the step handed off; forget those that left."""
        for req in report.handoffs:
            kv_start, epoch = self._pending_sends.pop(req.request_id, (0, 0))
            self._in_flight[req.request_id] = req
            self._transfer_epochs[req.request_id] = epoch
            slots = backend.kv.slots(req, kv_start, req.input_len)
            first_token = req.output_ids[0]
            self._submit(req.request_id, epoch,
                         lambda handle, s=slots, t=first_token, r=req.request_id: handle.send(r, s, t))
        for req, _ in report.finished:
            # A request that left before any transfer (aborted, failed) drops its bookkeeping.
            self._pending_sends.pop(req.request_id, None)

    def _submit(self, request_id: int, epoch: int, submit: Callable[[KVTransferHandle], None]) -> None:
        handle = self.handles.get(epoch)
        if handle is None:
            self._record(TransferResult(request_id, False, 0.0, 0, f"request {request_id}: the KV transfer of "
                                        f"epoch {epoch} is not set up on this node (never set up, or torn down)"),
                         True)
            return
        submit(handle)

    # --- results ----------------------------------------------------------------------------
    def poll(self, backend: Any) -> None:
        """Poll, agree across TP ranks, and act on decided transfers in ``backend`` (never blocks on a transfer)."""
        for epoch, handle in self.handles.items():
            results = handle.poll()
            broken = handle.broken_reason is not None
            for result in results:
                self._record(result, broken)
            if broken and epoch not in self._broken_reported:
                self._broken_reported.add(epoch)
                self._notify(PdChannelBroken(epoch, handle.broken_reason))
        if not self._in_flight:
            self._local.clear()  # results of requests no longer tracked
            return
        decided = self._decide()
        for request_id, outcome in decided.items():
            req = self._in_flight.pop(request_id, None)
            if req is not None:
                self._act(backend, req, outcome)

    def _record(self, result: TransferResult, broken: bool) -> None:
        if result.ok:
            kind = ""
        elif result.cancelled:
            kind = ERROR_TRANSFER_CANCELLED
        elif result.expired:
            kind = ERROR_LEASE_EXPIRED
        elif broken:
            kind = ERROR_TRANSFER_BROKEN
        else:
            kind = ERROR_TRANSFER_FAILED
        self._local[result.request_id] = _Outcome(result.request_id, result.ok, result.first_token, result.seconds,
                                                  result.bytes, kind, result.reason)

    def _decide(self) -> Dict[int, _Outcome]:
        mine = {rid: o for rid, o in self._local.items() if rid in self._in_flight}
        if self._agree is None:
            self._local = {}
            return mine
        gathered: List[Dict[int, _Outcome]] = self._agree(mine)
        decided: Dict[int, _Outcome] = {}
        for request_id in sorted(self._in_flight):
            outcomes = [ranks.get(request_id) for ranks in gathered]
            if any(o is None for o in outcomes):
                continue
            failed = [o for o in outcomes if not o.ok]
            lead = outcomes[0]
            if failed:
                decided[request_id] = failed[0]
            else:
                decided[request_id] = _Outcome(request_id, True, lead.first_token, max(o.seconds for o in outcomes),
                                               sum(o.nbytes for o in outcomes), "", "")
            self._local.pop(request_id, None)
        return decided

    def _act(self, backend: Any, req: InferReq, outcome: _Outcome) -> None:
        request_id = req.request_id
        self._transfer_epochs.pop(request_id, None)
        if outcome.ok:
            self._notify(PdNotice(request_id, "transferred", seconds=outcome.seconds, nbytes=outcome.nbytes))
        elif outcome.error_kind == ERROR_TRANSFER_CANCELLED:
            log.info("request %d: %s", request_id, outcome.reason)  # asked for by the request's own end
        else:
            log.warning("request %d: KV transfer failed (%s): %s", request_id, outcome.error_kind, outcome.reason)
            self._notify(PdNotice(request_id, "transfer_failed", error_kind=outcome.error_kind, message=outcome.reason))
        if self.role == RunMode.PREFILL:
            backend.transfer_done(request_id, outcome.ok, FINISH_TRANSFER_FAILED)
        elif outcome.ok:
            # The backend reports the first token ahead of the next step's, like a sampled one.
            backend.admit_prefilled(req, outcome.first_token)
        else:
            backend.transfer_failed(req, FINISH_TRANSFER_FAILED)

    def on_abort(self, backend: Any, request_id: int) -> None:
        """An aborted request gives up its transfer if it has not started.

        The engine releases a request under transfer only when the transfer ends, so that no
        process reads or writes KV given to another request.  A transfer that has not started
        can end at once instead: on a decode node a receive whose KV has not started arriving
        (the master closed the stream because the prefill node's first token ended the request,
        or it placed the request elsewhere, or it is gone), on a prefill node a send still queued
        behind other transfers (the master that wanted it is gone).  The result comes back
        ``cancelled`` through :meth:`poll`; a transfer already under way reports itself.
        """
        epoch = self._transfer_epochs.get(request_id)
        handle = self.handles.get(epoch) if epoch is not None else None
        if request_id not in self._in_flight or handle is None:
            return
        if self.role == RunMode.DECODE:
            handle.cancel_receive(request_id)
        else:
            handle.cancel_send(request_id)

    @property
    def in_flight(self) -> List[int]:
        """Requests with a transfer not yet decided."""
        return list(self._in_flight)
