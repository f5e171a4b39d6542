"""A prefill node rank's side of the KV transfer: it serves the pairs' store and sends hand-offs.

* Pairs.  The rank serves one TCP store on its transfer port + rank, started at its first setup,
  which every pair's transfer processes join (see ``pd/kv_transfer/store_host.py``).
* Intake.  :meth:`PrefillRankTransfer.take` joins the request to the backend and remembers its
  ``kv_start`` and epoch.
* Hand-off.  :meth:`PrefillRankTransfer.after_step` sends each handed-off request's positions
  ``[kv_start, input_len)`` with its first token in the header, on its epoch's handle, right
  after the step.  The agreed result releases the request's KV (``transfer_done``).
* Aborts.  A send still queued behind other transfers is given up at once (``cancel_send``; its
  master is gone, so the decode side no longer waits for it); a send under way ends first and
  the request with it.
"""

from __future__ import annotations

import logging
from typing import ClassVar, Dict, Optional, Tuple

from lightllm.server.core.objs.finish_status import FINISH_TRANSFER_FAILED
from lightllm.server.core.objs.io_messages import PdTransferSetup
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_layout import PD_KIND_PREFILL
from lightllm.server.model_rank.pd_transfer.base import Agree, MakeHandle, Notify, PdRankTransfer, kv_slots
from lightllm.server.model_rank.pd_transfer.outcomes import TransferOutcome
from lightllm.server.model_rank.rank_config import PdRankSettings
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_backend import PrefillBackend
from lightllm.server.model_rank.scheduling.step_report import StepReport
from lightllm.server.pd.kv_transfer import KVTransferHandle, TransferStoreHost
from lightllm.server.run_mode import RunMode

log = logging.getLogger("lightllm.pd_rank")


class PrefillRankTransfer(PdRankTransfer[PrefillBackend]):
    """A prefill rank's KV transfer: sends each handed-off request's KV (see the module docstring)."""

    role: ClassVar[str] = RunMode.PREFILL.value
    pd_kind: ClassVar[int] = PD_KIND_PREFILL

    def __init__(
        self,
        rank: int,
        settings: PdRankSettings,
        make_handle: MakeHandle,
        agree: Optional[Agree] = None,
        notify: Optional[Notify] = None,
    ) -> None:
        super().__init__(rank, settings, make_handle, agree, notify)
        # The one store every pair's transfer processes join (started at the first setup).
        self.store_host: Optional[TransferStoreHost] = None
        # request id -> (first prompt position to send, epoch), from its record.
        self._pending_sends: Dict[int, Tuple[int, int]] = {}

    def _pair_address(self, command: PdTransferSetup) -> Tuple[str, int, Optional[TransferStoreHost]]:
        store_host = self._ensure_store_host()
        return store_host.connect_host, store_host.port, store_host

    def _ensure_store_host(self) -> TransferStoreHost:
        if self.store_host is None:
            s = self.settings
            self.store_host = TransferStoreHost(s.listen_socket, s.transfer_host, s.transfer_port + self.rank,
                                                timeout_s=s.connect_timeout_s)
            log.info("rank %d: KV transfer store serving on port %d", self.rank, self.store_host.port)
        return self.store_host

    def close(self) -> None:
        """Stop every handle and the store (the rank is going away)."""
        super().close()
        if self.store_host is not None:
            self.store_host.close()
            self.store_host = None

    def _admit(self, backend: PrefillBackend, request_id: int, spec: RequestSpec,
               shm_index: int) -> Optional[InferReq]:
        req = backend.add_request(request_id, spec, shm_index)
        self._pending_sends[request_id] = (spec.pd.kv_start, spec.pd.epoch)
        if self.rank == 0:
            log.info("request %d admitted: segment_index=%d infer_high_priority=%d kv_start=%d prompt=%d",
                     request_id, spec.segment.segment_index, spec.priority.infer_high_priority,
                     spec.pd.kv_start, spec.prompt_len)
        return req

    def after_step(self, backend: PrefillBackend, report: StepReport) -> None:
        """Send the KV of every request the step handed off; forget those that left."""
        for req in report.handoffs:
            kv_start, epoch = self._pending_sends.pop(req.request_id, (0, 0))
            request_id, first_token = req.request_id, req.output_ids[0]
            slots = kv_slots(backend, req, kv_start, req.input_len)
            # Submitted at once, so the loop's variables are still this request's.
            self._start_transfer(req, epoch, lambda handle: handle.send(request_id, slots, first_token))
        for req, _ in report.finished:
            # A request that left before any transfer (aborted, failed) drops its bookkeeping.
            self._pending_sends.pop(req.request_id, None)

    def _conclude(self, backend: PrefillBackend, req: InferReq, outcome: TransferOutcome) -> None:
        backend.transfer_done(req.request_id, outcome.ok, FINISH_TRANSFER_FAILED)

    def _cancel(self, handle: KVTransferHandle, request_id: int) -> None:
        # Only a send still queued behind other transfers: its master is gone.
        handle.cancel_send(request_id)
