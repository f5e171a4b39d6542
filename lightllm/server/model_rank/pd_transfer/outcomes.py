"""What a PD rank learns of one request's KV transfer, and the outcome its TP ranks agree on.

With TP > 1 each rank moves its own KV-head shard and learns its outcome at its own time; the
ranks exchange what they have and act only on requests every rank reported (see
:meth:`~.base.PdRankTransfer.poll`).  This module is the data and the rule of that exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Dict, List

from lightllm.server.pd.kv_transfer import TransferResult

# error_kind values of a failed transfer (the HTTP side's PdNodeEvent.error_kind).
ERROR_TRANSFER_FAILED = "transfer_failed"
ERROR_LEASE_EXPIRED = "lease_expired"
# A transfer given up before it started because its request was aborted (on_abort).
ERROR_TRANSFER_CANCELLED = "transfer_cancelled"
ERROR_TRANSFER_BROKEN = "transfer_broken"


@dataclass(frozen=True)
class TransferOutcome:
    """One rank's outcome of one request's transfer, as exchanged between TP ranks (or the agreed one)."""

    request_id: int
    ok: bool
    first_token: int
    seconds: float
    nbytes: int
    error_kind: str
    reason: str


def outcome_of(result: TransferResult, broken: bool) -> TransferOutcome:
    """This rank's outcome of ``result``; ``broken``: its pair's channel had failed (or was closed)."""
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
    return TransferOutcome(result.request_id, result.ok, result.first_token, result.seconds, result.bytes, kind,
                           result.reason)


def agreed_outcomes(in_flight: Collection[int],
                    gathered: List[Dict[int, TransferOutcome]]) -> Dict[int, TransferOutcome]:
    """The outcomes of the requests in ``in_flight`` that every rank of ``gathered`` reported.

    A failure on any rank fails the request (the first rank's failure is the one reported);
    otherwise the transfer took as long as the slowest rank and moved every rank's bytes.
    """
    decided: Dict[int, TransferOutcome] = {}
    for request_id in sorted(in_flight):
        outcomes = [o for ranks in gathered if (o := ranks.get(request_id)) is not None]
        if len(outcomes) < len(gathered):
            continue
        failed = [o for o in outcomes if not o.ok]
        if failed:
            decided[request_id] = failed[0]
        else:
            decided[request_id] = TransferOutcome(request_id, True, outcomes[0].first_token,
                                                  max(o.seconds for o in outcomes), sum(o.nbytes for o in outcomes),
                                                  "", "")
    return decided
