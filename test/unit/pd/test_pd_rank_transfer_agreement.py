"""TP ranks of a PD node agree on KV transfer outcomes: a rank acts on a request's result only once
every rank has one, and fails it if any rank failed (PdRankTransfer.poll with a stand-in agreement)."""

from __future__ import annotations

from typing import Dict, List, Tuple

from lightllm.server.core.objs.finish_status import FINISH_TRANSFER_FAILED
from lightllm.server.model_rank.pd_transfer.outcomes import TransferOutcome
from lightllm.server.model_rank.pd_transfer.prefill import PrefillRankTransfer
from lightllm.server.model_rank.rank_config import PdRankSettings


class _Ranks:
    """The outcomes another TP rank reports, for the agreement between ranks."""

    def __init__(self):
        self.other: Dict[int, TransferOutcome] = {}

    def agree(self, mine):
        return [mine, dict(self.other)]


class _Backend:
    def __init__(self):
        self.done: List[Tuple[int, bool, int]] = []

    def transfer_done(self, request_id: int, ok: bool, failure_status: int) -> None:
        self.done.append((request_id, ok, failure_status))


class _Req:
    """What the transfer side reads of an InferReq."""

    def __init__(self, request_id: int):
        self.request_id = request_id
        self.abort_requested = False


def test_tp_ranks_act_only_on_results_every_rank_has_and_fail_if_any_failed() -> None:
    ranks, backend = _Ranks(), _Backend()
    pd = PrefillRankTransfer(0, PdRankSettings(), lambda *a: None, agree=ranks.agree)
    pd._in_flight = {1: _Req(1), 2: _Req(2)}
    pd._local = {1: TransferOutcome(1, True, 5, 0.1, 100, "", ""), 2: TransferOutcome(2, True, 6, 0.1, 100, "", "")}
    pd.poll(backend)  # the other rank has nothing yet: nothing is decided
    assert backend.done == [] and sorted(pd.in_flight) == [1, 2]
    ranks.other = {2: TransferOutcome(2, False, -1, 0.2, 0, "transfer_failed", "checksum")}
    pd.poll(backend)
    assert backend.done == [(2, False, FINISH_TRANSFER_FAILED)] and pd.in_flight == [1]
    ranks.other = {1: TransferOutcome(1, True, 5, 0.3, 100, "", "")}
    pd.poll(backend)
    assert backend.done[-1] == (1, True, FINISH_TRANSFER_FAILED) and pd.in_flight == []
