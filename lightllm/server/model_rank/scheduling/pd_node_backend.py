"""The common part of the PD node backends: requests come in and go out through a KV transfer.

A prefill or decode node's backend carries a :class:`TransferIntake`, the rank's side of the KV
transfer (on a server the :class:`~lightllm.server.model_rank.pd_transfer.base.PdRankTransfer`
subclass of the node's role, built by the rank and passed to the backend's constructor).  The
backend routes the rank loop's mode-independent hooks to it, so the rank loop runs a PD node
exactly like a normal one:

* :meth:`PdNodeBackend.intake` -> :meth:`TransferIntake.take` (a prefill node joins the request
  and notes where its transfer starts; a decode node reserves KV and starts receiving, or answers
  busy at once);
* :meth:`PdNodeBackend.step` -> :meth:`TransferIntake.after_step` (a prefill node sends the KV of
  what the step handed off, right after the step);
* :meth:`PdNodeBackend.poll` -> :meth:`TransferIntake.poll` (transfer results every TP rank
  agreed on: a prefill node releases the KV, a decode node admits the request with its first token);
* :meth:`PdNodeBackend.on_command` -> :meth:`TransferIntake.on_command` (a pair's transfer setup
  or teardown; a node may hold several pairs, one per epoch, and a request names its own in
  ``spec.pd.epoch``).

The intake takes the backend as an argument on every call instead of holding it, so the two are
built one after the other and neither is patched after construction.  The intake is generic in
the backend it drives, since each side calls its own backend's methods.  Without an intake (the
scheduling simulator, unit tests of the engine) the backend schedules alone: the caller admits
and acknowledges requests through the mode's own methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence, TypeVar

from lightllm.server.model_rank.scheduling.base_backend import ModeBackend
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.kv_view import KvView
from lightllm.server.model_rank.scheduling.model_executor import ModelExecutor
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import PrefillQueueStrategy
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.model_rank.scheduling.step_report import StepReport

if TYPE_CHECKING:
    from typing_extensions import Self

    from lightllm.server.core.objs.request_spec import RequestSpec

# The backend an intake drives; contravariant: an intake of any PD backend serves a prefill one too.
BackendT_contra = TypeVar("BackendT_contra", bound="PdNodeBackend", contravariant=True)


class TransferIntake(Protocol[BackendT_contra]):
    """A PD node backend's way in and out: the rank's KV transfer (see the module docstring).

    Every method runs on every TP rank with the same arguments in the same order, and must decide
    the same on each (results are agreed between ranks before anyone acts on them).
    """

    def take(self, backend: BackendT_contra, request_id: int, spec: "RequestSpec",
             shm_index: int) -> Optional[InferReq]:
        """Admit one request into ``backend``; None when it ended at once."""

    def after_step(self, backend: BackendT_contra, report: StepReport) -> None:
        """Act on what a step of ``backend`` produced (hand-offs, finishes)."""

    def poll(self, backend: BackendT_contra) -> None:
        """Act on agreed transfer results, between steps; never waits on a transfer."""

    def on_command(self, command: object) -> bool:
        """Apply a transfer command (a pair's setup or teardown); False when ``command`` is not one."""

    def on_abort(self, backend: BackendT_contra, request_id: int) -> None:
        """A request was asked to end: a transfer that has not started may be given up."""

    @property
    def in_flight(self) -> Sequence[int]:
        """Requests whose transfer is not decided yet."""


class PdNodeBackend(ModeBackend):
    """A PD node's backend: the step engine plus a :class:`TransferIntake` (see the module docstring).

    Args, after the :class:`~.step_engine.StepEngine` ones:
        transfer: the rank's KV transfer; None when the caller drives intake and acknowledgements itself.
    """

    def __init__(
        self,
        executor: ModelExecutor,
        kv: KvView,
        strategy: PrefillQueueStrategy,
        planner: StepPlanner,
        eos_token_ids: Sequence[int],
        max_req_total_len: int,
        *,
        transfer: Optional[TransferIntake[Self]] = None,
    ) -> None:
        super().__init__(executor, kv, strategy, planner, eos_token_ids, max_req_total_len)
        self.transfer: Optional[TransferIntake[Self]] = transfer

    # ``self: Self`` on the methods that hand the backend to its intake: the intake drives this very subclass.
    def intake(self: Self, request_id: int, spec: "RequestSpec", shm_index: int = -1) -> Optional[InferReq]:
        """The transfer admits the request (see :meth:`TransferIntake.take`)."""
        if self.transfer is None:
            raise RuntimeError(f"a {self.run_mode} backend without a KV transfer cannot take requests from a router")
        return self.transfer.take(self, request_id, spec, shm_index)

    def step(self: Self) -> StepReport:
        """One engine step; then the transfer acts on it (a prefill node sends what was handed off)."""
        report = super().step()
        if self.transfer is not None:
            self.transfer.after_step(self, report)
        return report

    def abort(self: Self, request_id: int) -> None:
        """Ask the request to end; the transfer may give up a receive no KV is coming for."""
        super().abort(request_id)
        if self.transfer is not None:
            self.transfer.on_abort(self, request_id)

    def poll(self: Self) -> None:
        """Act on the transfer results every TP rank has."""
        if self.transfer is not None:
            self.transfer.poll(self)

    def on_command(self, command: Any) -> None:
        """Hand a transfer command (a pair's setup or teardown) to the transfer."""
        if self.transfer is None or not self.transfer.on_command(command):
            super().on_command(command)

    @property
    def has_outside_work(self) -> bool:
        """Whether a transfer is in flight."""
        return self.transfer is not None and bool(self.transfer.in_flight)
