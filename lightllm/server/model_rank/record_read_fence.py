"""Under TP, rank 0 publishes no request's finish before every rank has read that request's record.

A request's shared-memory record is the HTTP side's until it frees it, which it does once rank 0
has published the request's finish (the release travels rank 0 -> detokenizer -> HTTP).  Rank 0
reads the record when it screens the ``AddRequests`` command; the other ranks read it themselves
when they apply the command rank 0 sent them over the TP command channel, and that send returns
before they have applied it.  So rank 0 must not publish a finish while another rank may not have
read the record yet, or the HTTP side frees (and may reuse) the slot under it: that rank then
fails to admit a request rank 0 admitted, and the ranks' scheduling state (the strategy's arrival
numbering, the overtaking account) differs, which under TP must never happen.

A step that sampled tokens keeps the ranks together on its own: rank 0 read on the host tokens
computed from a forward whose collectives (all-reduce) every rank joined after applying the same
commands, so every record read before that forward is done.  (With NCCL a forward whose results
rank 0 never reads, a prefill chunk that samples nothing, proves nothing: its collectives run on
the device, and the host goes on.)  A request can, however, end with no such step since its
admission: an abort in the command list that admitted it (a client gone at once), a grammar
compile that raised on rank 0 (``GrammarsReady(failed)``), an intake that refused it (a decode
node answering busy).  For those, every rank waits for the others once before the step is
published.

Every rank runs a :class:`RecordReadFence` over the same commands and the same step reports, so
every rank decides alike whether to wait and all of them join the wait.  Steps that sampled, and
steps that finish no request admitted since the last sampling one, cost nothing; with TP = 1 the
rank builds no fence.  "Alike" assumes the ranks agree on every request: an admission that fails on
one rank alone (a fault of its own, see ``ModelRank._admit``) can leave one rank in the barrier and
the other waiting for commands, a stall the watchdog (``--watchdog_timeout``) ends with an error.
"""

from __future__ import annotations

from typing import Callable, Iterable, Set

from lightllm.server.model_rank.scheduling.step_report import StepReport


class RecordReadFence:
    """Holds a step's publication until every TP rank has read the records of the requests it finishes.

    Args:
        wait_for_ranks: a collective every TP rank joins (the command channel's
            :meth:`~lightllm.server.model_rank.command_channel.TpCommandChannel.wait_for_ranks`).
    """

    def __init__(self, wait_for_ranks: Callable[[], None]) -> None:
        self._wait_for_ranks = wait_for_ranks
        # Requests whose record a rank may not have read yet: admitted since the last step that
        # sampled (or since the last wait).  Every one of them is live or ends in the next steps,
        # which clear the set, so it holds at most the live requests.
        self._unconfirmed: Set[int] = set()
        self.waits = 0  # for tests and diagnostics

    def admitted(self, request_ids: Iterable[int]) -> None:
        """The ranks read the records of ``request_ids`` as they apply this iteration's ``AddRequests``."""
        self._unconfirmed.update(request_ids)

    def before_publish(self, report: StepReport) -> bool:
        """Call on every rank after each step, before rank 0 publishes it; True when it waited for the others.

        Waits when ``report`` finishes a request admitted since the last step that sampled, and
        that step sampled nothing.
        """
        unconfirmed = self._unconfirmed
        if not unconfirmed:
            return False
        if report.sampled:
            unconfirmed.clear()  # every rank joined this step's forward after its reads
            return False
        if not any(req.request_id in unconfirmed for req, _ in report.finished):
            return False
        self._wait_for_ranks()
        self.waits += 1
        unconfirmed.clear()  # every rank has applied every command up to this step
        return True
