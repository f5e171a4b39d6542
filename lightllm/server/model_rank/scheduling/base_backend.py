"""``ModeBackend``: the step engine plus request intake, for one run mode (abstract).

A mode backend is the :class:`~.step_engine.StepEngine` with the hooks of its run mode and the
way requests come in.  The concrete backends are :class:`~.normal_backend.NormalBackend`,
:class:`~.prefill_backend.PrefillBackend` and :class:`~.decode_backend.DecodeBackend`;
``build_backend(run_mode)`` (``backend_registry.py``) picks the class.  A backend knows nothing
about processes, shared memory or zmq: the rank process feeds it requests and commands through
the hooks below, the same calls in every run mode, and turns its
:class:`~.step_report.StepReport` into shared-memory writes and messages; the simulator drives
the same classes in virtual time.

The rank loop calls, per iteration and identically on every TP rank:

* :meth:`ModeBackend.observe_time` with rank 0's clock, then :meth:`ModeBackend.intake` for
  each admitted request, :meth:`reject` / :meth:`abort` for the
  others, :meth:`grammars_ready` for the constrained requests whose grammar compile ended on rank 0
  (rank 0 asks :meth:`grammars_compiled` which those are), :meth:`on_command` for any other command;
* :meth:`ModeBackend.poll` (work outside the step, e.g. a PD node's KV transfers);
* :meth:`step` when :attr:`has_work`.

Adding a run mode: subclass :class:`ModeBackend`, set ``run_mode`` and, if it classifies
requests differently, ``classifier``; implement :meth:`intake`, override the engine's hooks
(``on_prompt_done``, ``can_pause``) and, if the mode has outside work, :meth:`poll`,
:attr:`has_outside_work` and :meth:`on_command`; register it in ``backend_registry.py``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, List, Optional, Sequence, Tuple

from lightllm.server.core.objs.finish_status import FINISH_ERROR
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.admission import check_request
from lightllm.server.model_rank.scheduling.step_engine import StepEngine
from lightllm.server.model_rank.scheduling.request_state import ReqState

if TYPE_CHECKING:
    from lightllm.server.core.objs.request_spec import RequestSpec

log = logging.getLogger("lightllm.model_rank")


class ModeBackend(StepEngine, ABC):
    """The step engine of one run mode and its intake (see the module docstring)."""

    run_mode: ClassVar[str]

    @abstractmethod
    def intake(self, request_id: int, spec: "RequestSpec", shm_index: int = -1) -> Optional[InferReq]:
        """Take in a request the router admitted, the way this run mode does.

        Returns the request as it now runs, or None when it ended at once (the next step
        reports it).  Raises when the request cannot run here; the caller then rejects it.
        """

    def add_request(self, request_id: int, spec: "RequestSpec", shm_index: int = -1) -> InferReq:
        """Create ``spec``'s :class:`InferReq` (snapshotting the prefill counter) and join it.

        ``shm_index``: the request's shared-memory slot (-1: none, as in the simulator).  The
        spec is not checked again here: it was checked where it was built and, on a server, by
        rank 0's screen (:meth:`check_request`) before any rank admits it.
        """
        req = self.new_request(request_id, spec, shm_index)
        self.join(req)
        return req

    def new_request(self, request_id: int, spec: "RequestSpec", shm_index: int = -1) -> InferReq:
        """``spec``'s :class:`InferReq`, not yet joined."""
        return InferReq.from_spec(request_id, spec, shm_index=shm_index,
                                  arrival_processed_prefill_tokens=self.counter.snapshot())

    def check_request(self, spec: "RequestSpec") -> None:
        """Raise :class:`~.admission.RequestRejected` unless this rank can run ``spec`` (rank 0's screen)."""
        check_request(
            spec,
            vocab_size=self.executor.vocab_size,
            max_req_total_len=self.max_req_total_len,
            grammar_enabled=self.executor.grammar_enabled,
        )

    def reject(self, request_id: int, shm_index: int = -1, status: int = FINISH_ERROR) -> None:
        """Finish a request that could not be admitted with ``status`` (default ``FINISH_ERROR``) in the next step."""
        req = InferReq(request_id=request_id, prompt_ids=[], shm_index=shm_index)
        req.move_to(ReqState.FINISHED)
        self._ended.append((req, status))

    # --- the grammar hold (see RequestMembership.join) ---------------------------------------------
    def grammars_compiled(self) -> Tuple[List[int], List[int]]:
        """Rank 0: the held requests whose grammar compile has ended here, ``(succeeded, raised)``,
        each in admission order; never waits.  Rank 0 sends them to every rank as one
        ``GrammarsReady`` command.

        A decode node's request whose KV is still arriving (``TRANSFERRING``) waits for it: one
        whose compile raised must not end (and free its KV) while a transfer writes into that KV,
        as an abort waits too; released during the transfer it could not run anyway."""
        if not self.executor.grammar_enabled:  # no constrained request is admitted
            return [], []
        held = [request_id for request_id, req in self.requests.items()
                if req.grammar_held and req.state is not ReqState.TRANSFERRING]
        return self.executor.grammars_compiled(held) if held else ([], [])

    def grammars_ready(self, request_ids: Sequence[int], failed: Sequence[int] = ()) -> None:
        """Every rank, from rank 0's ``GrammarsReady``: ``request_ids`` may be scheduled from now on,
        and ``failed``, whose compile raised on rank 0, end with ``FINISH_ERROR`` (in the next step's report).

        Rank 0 decides for all ranks, so every rank plans them in the same step; a rank whose own
        compile is still running waits for it where it takes the matcher, at the same point as the
        others.  A compile that raises is a server fault, not the request's (llguidance reports a
        bad grammar as a matcher in error, not by raising), hence the 500 ``generation_failed``
        of ``FINISH_ERROR`` rather than the client's 400 ``grammar_failed``; and it may raise on
        one rank only, so rank 0's outcome is every rank's.  A request that left meanwhile (an
        abort in the same command list) is skipped.
        """
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is not None:
                req.grammar_held = False
        for request_id in failed:
            req = self.requests.get(request_id)
            if req is not None:
                log.warning("request %d: its structured-output grammar could not be compiled on rank 0; finishing "
                            "it with an error", request_id)
                self.finish(req, FINISH_ERROR)

    # --- the rank loop's hooks for work outside the step (none by default) -------------------------
    def on_command(self, command: Any) -> None:
        """A command the rank loop does not handle itself; this mode has none.

        No process of this node sends one, so it is a protocol bug between the server's own
        processes: logged as an error (not a warning that load would bury) and dropped, since
        one stray message must not stop the requests the rank serves.
        """
        log.error("a %s node ignores a %s command (a bug: no process of this node sends it): %.200r",
                  self.run_mode, type(command).__name__, command)

    def observe_time(self, now: float) -> None:
        """The agreed time moved to ``now``: rank 0's clock when it admitted the next requests.

        The same value on every TP rank (it travels with the requests), so a mode deciding by
        time decides alike everywhere; the simulator passes its virtual time.  Only a decode
        node reads it (its KV hold); other modes ignore it.
        """

    def poll(self) -> None:
        """Once per loop iteration, before the step: advance work outside the step (none here)."""

    @property
    def has_outside_work(self) -> bool:
        """Whether work outside the step is in flight, so the rank keeps polling (and its TP ranks with it)."""
        return False

    def promised_token_num(self) -> int:
        """KV tokens promised to requests that are not here yet (a decode node's reservations); none here."""
        return 0
