"""How a prefill rank logs a failed KV transfer: a warning, unless the request's abort caused it.

A client that leaves as its prompt's prefill ends is common: the master lets the request go on
both nodes, the decode node drops its reservation, and the send that had already started is
refused there ("no reservation").  That is the abort's expected consequence, logged as info;
the same failure of a request nobody aborted (a lease that ran out, a broken pair) is a warning.
"""

from __future__ import annotations

import logging
from typing import List, Tuple

import pytest

from lightllm.server.core.objs.finish_status import FINISH_TRANSFER_FAILED
from lightllm.server.model_rank.pd_transfer.outcomes import TransferOutcome
from lightllm.server.model_rank.pd_transfer.prefill import PrefillRankTransfer
from lightllm.server.model_rank.rank_config import PdRankSettings
from lightllm.server.model_rank.scheduling.infer_req import InferReq


class _EndedTransfers:
    """The backend side of a concluded transfer: what transfer_done was told."""

    def __init__(self) -> None:
        self.done: List[Tuple[int, bool, int]] = []

    def transfer_done(self, request_id: int, ok: bool, failure: int) -> None:
        self.done.append((request_id, ok, failure))


@pytest.mark.parametrize("aborted, level", [(True, logging.INFO), (False, logging.WARNING)])
def test_a_transfer_failing_after_its_requests_abort_is_no_warning(aborted, level, caplog) -> None:
    notices: list = []
    side = PrefillRankTransfer(0, PdRankSettings(), make_handle=None, notify=notices.append)
    req = InferReq(request_id=9, prompt_ids=[1, 2, 3])
    req.abort_requested = aborted
    backend = _EndedTransfers()
    refused = TransferOutcome(9, False, -1, 0.0, 0, "transfer_failed",
                              "request 9 refused by the decode side: the decode side has no reservation for this request")
    with caplog.at_level(logging.DEBUG, logger="lightllm.pd_rank"):
        side._act(backend, req, refused)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (level, f"request 9: KV transfer failed (transfer_failed): {refused.reason}")]
    # Either way the request ends as a failed transfer and its node stream hears why.
    assert backend.done == [(9, False, FINISH_TRANSFER_FAILED)]
    assert [(n.request_id, n.kind) for n in notices] == [(9, "transfer_failed")]
