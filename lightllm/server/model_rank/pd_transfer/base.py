"""What a PD node rank's KV transfer does on either side: pairs, submissions and agreed results.

:class:`PdRankTransfer` is the part a prefill rank (:mod:`.prefill`) and a decode rank
(:mod:`.decode`) share; the rank builds the subclass of its node's role once
(``model_rank/pd_backend_settings.py``), and the rank's mode backend carries it as its
:class:`~lightllm.server.model_rank.scheduling.pd_node_backend.TransferIntake`: the rank loop
calls the backend's hooks, the same in every run mode, and the backend hands them here with
itself as the argument.  Nothing here blocks the inference step:

* Pairs.  A node may be paired with several peers at once; the master numbers each pair with an
  ``epoch``, and the rank holds one :class:`KVTransferHandle` per epoch.
  :meth:`PdRankTransfer.setup` (a :class:`PdTransferSetup` command, broadcast to every rank,
  reaching here through :meth:`PdRankTransfer.on_command`) adds the handle of its epoch, or
  replaces it (requests the old one still held fail), and leaves the other epochs alone; a
  :class:`PdTransferTeardown` closes one epoch's handle (its requests fail as a broken
  transfer).  Where a handle meets its peer is the side's own (``_pair_address``).
* :meth:`PdRankTransfer.take` admits a request of this node's PD kind, on the pair of its
  ``spec.pd.epoch``; each side admits it its own way (``_admit``).  A request whose epoch has
  no handle fails as a broken transfer.
* :meth:`PdRankTransfer.poll` (every iteration) polls every handle and acts on results that
  every TP rank has: with TP > 1 each rank moves its own KV-head shard and learns its outcome at
  its own time, so the ranks first exchange what they have (one small ``all_gather_object``
  while transfers are in flight) and act only on requests every rank reported: success when all
  succeeded (:mod:`.outcomes`).  Every rank hence takes the same decision in the same iteration (they apply the
  same setup and teardown commands in the same order, so they hold the same epochs).  Rank 0
  tells the HTTP process the outcome; the side then concludes the request in its backend
  (``_conclude``).

Aborts (:meth:`PdRankTransfer.on_abort`): a transfer that has not started is given up at once,
on either side (``_cancel``).  A transfer already under way ends first (the transfer process
still reads or writes that KV).  The transfer process reads cancellations at all times, also
while it joins its group or moves another request's KV, so an abort never waits for another
pair's trouble.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    ClassVar,
    Dict,
    Generic,
    List,
    Optional,
    Protocol,
    Set,
    Tuple,
    TypeVar,
    cast,
)

from lightllm.server.core.objs.io_messages import (
    PdChannelBroken,
    PdNotice,
    PdSetupDone,
    PdTransferSetup,
    PdTransferTeardown,
)
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.model_rank.pd_transfer.outcomes import (
    ERROR_TRANSFER_CANCELLED,
    TransferOutcome,
    agreed_outcomes,
    outcome_of,
)
from lightllm.server.model_rank.rank_config import PdRankSettings
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.pd_node_backend import PdNodeBackend
from lightllm.server.model_rank.scheduling.step_report import StepReport
from lightllm.server.pd.kv_transfer import KVTransferHandle, TransferResult, TransferStoreHost

if TYPE_CHECKING:
    import torch

log = logging.getLogger("lightllm.pd_rank")

Agree = Callable[[Any], List[Any]]  # all_gather of one picklable object per rank
Notify = Callable[[Any], None]  # rank 0: a message to the HTTP process
# make_handle(role, host, port, group_name, store_host): store_host is the prefill rank's store, None on decode.
MakeHandle = Callable[[str, str, int, str, Optional[TransferStoreHost]], KVTransferHandle]
# Starts one request's transfer on its pair's handle.
Submit = Callable[[KVTransferHandle], None]

BackendT = TypeVar("BackendT", bound=PdNodeBackend)


class KvSlots(Protocol):
    """Where a request's KV lies: what a transfer moves (on a server the rank's ``InferenceContext``)."""

    def slots(self, req: InferReq, start: int, end: int) -> torch.Tensor:
        """Slots of positions ``[start, end)`` of ``req``."""


def kv_slots(backend: PdNodeBackend, req: InferReq, start: int, end: int) -> torch.Tensor:
    """The KV slots of ``req``'s positions ``[start, end)`` in ``backend``'s KV."""
    # The scheduling core's KvView knows no slots (the simulator has no KV to move); a backend
    # with a transfer always runs over the rank's InferenceContext, which does.
    return cast(KvSlots, backend.kv).slots(req, start, end)


def pair_group_name(epoch: int, rank: int) -> str:
    """The key prefix of one pair's transfer group between TP rank ``rank`` of each side."""
    return f"lightllm-kv/epoch-{epoch}/rank-{rank}"


class PdRankTransfer(ABC, Generic[BackendT]):
    """Owns one rank's KV transfer handles, one per pair, and is its PD backend's intake (see the module docstring).

    ``BackendT`` is the backend the side drives (every intake method's first argument).
    ``make_handle(role, host, port, group_name, store_host)`` builds a handle (a
    :class:`KVTransferHandle` over the rank's shareable cache; tests may pass their own);
    ``group_name`` names the pair and the rank, so both sides of one setup meet and nothing else
    does; ``store_host`` is the prefill rank's store (None on a decode rank).  ``agree`` is None
    for TP = 1; ``notify`` is None on ranks other than 0.
    """

    # The run mode of this side's node, which is also its handles' side of the transfer.
    role: ClassVar[str]
    # The PD kind of the requests this side runs (the kind its node's HTTP side writes).
    pd_kind: ClassVar[int]

    def __init__(
        self,
        rank: int,
        settings: PdRankSettings,
        make_handle: MakeHandle,
        agree: Optional[Agree] = None,
        notify: Optional[Notify] = None,
    ) -> None:
        self.rank = rank
        self.settings = settings
        self._make_handle = make_handle
        self._agree = agree
        self._notify: Notify = notify or (lambda message: None)
        # epoch -> that pair's handle (insertion order: the order setups were applied).
        self.handles: Dict[int, KVTransferHandle] = {}
        self._broken_reported: Set[int] = set()
        # Requests submitted to a transfer and not yet decided (the same set on every rank).
        self._in_flight: Dict[int, InferReq] = {}
        # The pair (epoch) each request in flight transfers through, for cancelling it.
        self._transfer_epochs: Dict[int, int] = {}
        # This rank's outcomes not yet agreed on.
        self._local: Dict[int, TransferOutcome] = {}

    # --- setup ------------------------------------------------------------------------------
    def on_command(self, command: object) -> bool:
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
            host, port, store_host = self._pair_address(command)
            self.handles[epoch] = self._make_handle(self.role, host, port, pair_group_name(epoch, self.rank),
                                                    store_host)
            log.info("rank %d: KV transfer handle for epoch %d (%s, %s:%d; %d pair(s))", self.rank, epoch,
                     self.role, host, port, len(self.handles))
        except Exception as exc:  # noqa: BLE001 - reported to whoever asked for the setup
            log.exception("rank %d: KV transfer setup for epoch %d failed", self.rank, epoch)
            error = f"KV transfer setup failed on rank {self.rank}: {exc}"
        # The attempt's id goes back with the answer: the HTTP process matches it to its waiter.
        self._notify(PdSetupDone(epoch, error, command.setup_id))

    @abstractmethod
    def _pair_address(self, command: PdTransferSetup) -> Tuple[str, int, Optional[TransferStoreHost]]:
        """Where ``command``'s pair meets: host, port and this rank's store (None where it serves none)."""

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

    def close(self) -> None:
        """Stop every handle (the rank is going away)."""
        for epoch in list(self.handles):
            self._close_epoch(epoch)

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
    def take(self, backend: BackendT, request_id: int, spec: RequestSpec, shm_index: int = -1) -> Optional[InferReq]:
        """Admit a request of this node's PD kind into ``backend``; None when it ended at once (busy).

        Raises ``ValueError`` for a request of another kind.
        """
        if spec.pd.kind != self.pd_kind:
            raise ValueError(f"a {self.role} node cannot run a request of PD kind {spec.pd.kind}")
        return self._admit(backend, request_id, spec, shm_index)

    @abstractmethod
    def _admit(self, backend: BackendT, request_id: int, spec: RequestSpec, shm_index: int) -> Optional[InferReq]:
        """This side's admission of a request of its kind (see :meth:`take`)."""

    @abstractmethod
    def after_step(self, backend: BackendT, report: StepReport) -> None:
        """Act on what a step of ``backend`` produced, right after it."""

    def _start_transfer(self, req: InferReq, epoch: int, submit: Submit) -> None:
        """Track ``req`` as in flight on ``epoch``'s pair and ``submit`` its transfer there."""
        self._in_flight[req.request_id] = req
        self._transfer_epochs[req.request_id] = epoch
        handle = self.handles.get(epoch)
        if handle is None:
            request_id = req.request_id
            self._record(TransferResult(request_id, False, 0.0, 0, f"request {request_id}: the KV transfer of "
                                        f"epoch {epoch} is not set up on this node (never set up, or torn down)"),
                         True)
            return
        submit(handle)

    # --- results ----------------------------------------------------------------------------
    def poll(self, backend: BackendT) -> None:
        """Poll, agree across TP ranks, and act on decided transfers in ``backend`` (never blocks on a transfer)."""
        for epoch, handle in self.handles.items():
            results = handle.poll()
            broken_reason = handle.broken_reason
            for result in results:
                self._record(result, broken_reason is not None)
            if broken_reason is not None and epoch not in self._broken_reported:
                self._broken_reported.add(epoch)
                self._notify(PdChannelBroken(epoch, broken_reason))
        if not self._in_flight:
            self._local.clear()  # results of requests no longer tracked
            return
        decided = self._decide()
        for request_id, outcome in decided.items():
            req = self._in_flight.pop(request_id, None)
            if req is not None:
                self._act(backend, req, outcome)

    def _record(self, result: TransferResult, broken: bool) -> None:
        self._local[result.request_id] = outcome_of(result, broken)

    def _decide(self) -> Dict[int, TransferOutcome]:
        mine = {rid: o for rid, o in self._local.items() if rid in self._in_flight}
        if self._agree is None:
            self._local = {}
            return mine
        decided = agreed_outcomes(self._in_flight, self._agree(mine))
        for request_id in decided:
            self._local.pop(request_id, None)
        return decided

    def _act(self, backend: BackendT, req: InferReq, outcome: TransferOutcome) -> None:
        request_id = req.request_id
        self._transfer_epochs.pop(request_id, None)
        if outcome.ok:
            self._notify(PdNotice(request_id, "transferred", seconds=outcome.seconds, nbytes=outcome.nbytes))
        elif outcome.error_kind == ERROR_TRANSFER_CANCELLED:
            # Asked for by the request's own end; the reason already names the request.
            log.info("%s", outcome.reason)
        else:
            # A request aborted while its transfer ran (its client left as its prefill ended) fails
            # it as a matter of course on either side, whatever the failure: the peer has already
            # let the request go, and nobody waits for the KV.
            level = logging.INFO if req.abort_requested else logging.WARNING
            log.log(level, "request %d: KV transfer failed (%s): %s", request_id, outcome.error_kind, outcome.reason)
            self._notify(PdNotice(request_id, "transfer_failed", error_kind=outcome.error_kind, message=outcome.reason))
        self._conclude(backend, req, outcome)

    @abstractmethod
    def _conclude(self, backend: BackendT, req: InferReq, outcome: TransferOutcome) -> None:
        """End ``req``'s transfer in ``backend`` with the outcome every rank agreed on."""

    def on_abort(self, backend: BackendT, request_id: int) -> None:
        """An aborted request gives up its transfer if it has not started.

        The engine releases a request under transfer only when the transfer ends, so that no
        process reads or writes KV given to another request.  A transfer that has not started
        can end at once instead (see the sides' ``_cancel``).  The result comes back
        ``cancelled`` through :meth:`poll`; a transfer already under way reports itself.
        """
        epoch = self._transfer_epochs.get(request_id)
        handle = self.handles.get(epoch) if epoch is not None else None
        if request_id not in self._in_flight or handle is None:
            return
        self._cancel(handle, request_id)

    @abstractmethod
    def _cancel(self, handle: KVTransferHandle, request_id: int) -> None:
        """Give up ``request_id``'s transfer on ``handle`` if it has not started."""

    @property
    def in_flight(self) -> List[int]:
        """Requests with a transfer not yet decided."""
        return list(self._in_flight)
