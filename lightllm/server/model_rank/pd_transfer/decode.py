"""A decode node rank's side of the KV transfer: it reserves KV and receives prefilled prompts.

* Pairs.  Each pair's handle joins the prefill node's store at its transfer port + rank.
* Intake.  :meth:`DecodeRankTransfer.take` reserves KV for the prompt plus what one segment may
  generate, or finishes the request ``FINISH_BUSY`` at once (after a ``busy`` notice naming the
  limit it hit); then it asks its epoch's handle to receive positions ``[kv_start, input_len)``,
  with the reservation's lease as the wait: the master's lease for the request
  (``spec.pd.lease_s``), bounded by ``--pd_reserve_lease_seconds``
  (:meth:`~lightllm.server.model_rank.rank_config.PdRankSettings.lease_for`).
* Results.  An agreed success admits the request with the first token from the header; the
  backend reports that token ahead of the next step's own, like a sampled one.  A failure ends
  the request and gives its reservation back.
* Aborts.  A receive whose KV has not started arriving is given up at once
  (``cancel_receive``); one under way ends when its KV arrived (it is not decoded) or at the end
  of its lease.
"""

from __future__ import annotations

import logging
from typing import ClassVar, Optional, Tuple

from lightllm.server.core.objs.finish_status import FINISH_BUSY, FINISH_TRANSFER_FAILED
from lightllm.server.core.objs.io_messages import PdNotice, PdTransferSetup
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE
from lightllm.server.model_rank.pd_transfer.base import PdRankTransfer, kv_slots
from lightllm.server.model_rank.pd_transfer.outcomes import TransferOutcome
from lightllm.server.model_rank.scheduling.decode_backend import DecodeBackend, KvReservationRefused
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.step_report import StepReport
from lightllm.server.pd.kv_transfer import KVTransferHandle, TransferStoreHost
from lightllm.server.run_mode import RunMode

log = logging.getLogger("lightllm.pd_rank")


class DecodeRankTransfer(PdRankTransfer[DecodeBackend]):
    """A decode rank's KV transfer: reserves and receives each request's KV (see the module docstring)."""

    role: ClassVar[str] = RunMode.DECODE.value
    pd_kind: ClassVar[int] = PD_KIND_DECODE

    def _pair_address(self, command: PdTransferSetup) -> Tuple[str, int, Optional[TransferStoreHost]]:
        if not command.peer_host or command.peer_port <= 0:
            raise ValueError(f"a decode node needs the prefill transfer address, got "
                             f"{command.peer_host!r}:{command.peer_port}")
        return command.peer_host, command.peer_port + self.rank, None

    def _admit(self, backend: DecodeBackend, request_id: int, spec: RequestSpec,
               shm_index: int) -> Optional[InferReq]:
        req = self.reserve(backend, request_id, shm_index, spec)
        if req is not None and self.rank == 0:
            log.info("request %d reserved: segment_index=%d kv_start=%d prompt=%d lease=%gs", request_id,
                     spec.segment.segment_index, req.cur_kv_len, spec.prompt_len,
                     self.settings.lease_for(spec.pd.lease_s))
        return req

    def reserve(self, backend: DecodeBackend, request_id: int, shm_index: int,
                spec: RequestSpec) -> Optional[InferReq]:
        """Reserve and start receiving, or finish ``FINISH_BUSY`` at once (None)."""
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
        self._notify(PdNotice(request_id, "reserved", kv_start=kv_start))
        slots = kv_slots(backend, req, kv_start, req.input_len)
        lease_s = self.settings.lease_for(spec.pd.lease_s)
        self._start_transfer(req, spec.pd.epoch, lambda handle: handle.receive(request_id, slots, wait_s=lease_s))
        return req

    def after_step(self, backend: DecodeBackend, report: StepReport) -> None:
        """Nothing: a decode node hands nothing off, and its requests' transfers start at intake."""

    def _conclude(self, backend: DecodeBackend, req: InferReq, outcome: TransferOutcome) -> None:
        if outcome.ok:
            # The backend reports the first token ahead of the next step's, like a sampled one.
            backend.admit_prefilled(req, outcome.first_token)
        else:
            backend.transfer_failed(req, FINISH_TRANSFER_FAILED)

    def _cancel(self, handle: KVTransferHandle, request_id: int) -> None:
        # Only a receive whose KV has not started arriving: the master closed the stream (the
        # prefill node's first token ended the request), placed the request elsewhere, or is gone.
        handle.cancel_receive(request_id)
