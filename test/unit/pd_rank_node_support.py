"""PD node ranks in one test process, driven through their backends' hooks as the rank loop drives them.

A :class:`Node` is one rank of a prefill or decode node: a real backend over a tiny model, carrying
its side's PdRankTransfer with real transfer handles, and what rank 0 would have told the HTTP
process (tokens, finishes, notices).  :func:`set_up_pair` joins a prefill and a decode rank on one
transfer epoch, :func:`submit` runs a request the way the PD master does (reserve on D, then
prefill on P from D's ``kv_start``) and :func:`run_until` iterates the ranks until a condition holds.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.server.core.objs.io_messages import PdNotice, PdSetupDone, PdTransferSetup
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_PREFILL
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.pd_transfer.base import PdRankTransfer
from lightllm.server.model_rank.pd_transfer.decode import DecodeRankTransfer
from lightllm.server.model_rank.pd_transfer.prefill import PrefillRankTransfer
from lightllm.server.model_rank.rank_config import PdRankSettings
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.pd.kv_transfer import KVTransferHandle, TransferStoreHost
from lightllm.server.pd.node.transfer_ports import TransferPortBlock

MAX_LEN = 400
# The transfer side each node role builds, as pd_backend_settings picks it.
TRANSFER_OF_ROLE: Dict[str, type[PdRankTransfer]] = {"prefill": PrefillRankTransfer, "decode": DecodeRankTransfer}


def backend_for(model, run_mode: str, kv_tokens: int = 2048, prefix_cache: bool = True, **mode_settings: Any):
    """A ``run_mode`` backend over ``model`` with its own KV cache of ``kv_tokens`` tokens."""
    cache = model.new_kv_cache(kv_tokens)
    cache.share_buffers()
    context = InferenceContext(cache, ReqManager(8, MAX_LEN + 1), use_prefix_cache=prefix_cache)
    if run_mode == "decode":
        mode_settings.setdefault("end_segment_on_kv_pressure", True)  # as a PD decode node's rank builds it
    return build_rank_backend(run_mode, model, context, build_prefill_queue_strategy("hrrn"),
                              StepPlanner(64, 32), Sampler(0), [2], MAX_LEN, **mode_settings)


class Node:
    """One PD rank: its backend carrying its PdRankTransfer, and what rank 0 would have told the HTTP process."""

    def __init__(self, model, role: str, settings: PdRankSettings, kv_tokens: int = 2048, **mode_settings: Any):
        self.messages: List[Any] = []
        self.pd = TRANSFER_OF_ROLE[role](0, settings, self._make_handle, notify=self.messages.append)
        self.backend = backend_for(model, role, kv_tokens, transfer=self.pd, **mode_settings)
        self.tokens: Dict[int, List[int]] = {}
        self.finished: Dict[int, int] = {}

    def _make_handle(self, role: str, host: str, port: int, group_name: str,
                     store_host: Optional[TransferStoreHost]) -> KVTransferHandle:
        s = self.pd.settings
        return KVTransferHandle(role, self.backend.kv.kv_cache, host, port, page_size=s.page_size,
                                timeout_s=s.transfer_timeout_s, connect_timeout_s=s.connect_timeout_s,
                                receive_wait_s=s.lease_for(0.0), group_name=group_name, store_host=store_host)

    def iterate(self) -> None:
        """What the rank loop does once: poll (transfer results), step (hand-offs go out with it), publish."""
        self.backend.poll()
        if not self.backend.has_work:
            return
        report = self.backend.step()
        for req, token, _ in report.tokens:
            self.tokens.setdefault(req.request_id, []).append(token)
        for req, status in report.finished:
            self.finished[req.request_id] = status

    def notices(self, request_id: int) -> Dict[str, PdNotice]:
        """The PD notices rank 0 sent for ``request_id``, by kind."""
        return {m.kind: m for m in self.messages if isinstance(m, PdNotice) and m.request_id == request_id}


def set_up_pair(prefill: Node, decode: Node, epoch: int) -> None:
    """Set up transfer epoch ``epoch`` on both ranks, as the master's transfer_setup does, and wait until it is ready."""
    settings = prefill.pd.settings
    if settings.listen_socket is None:  # held like a prefill node holds its port from start-up
        settings.listen_socket = TransferPortBlock.reserve("127.0.0.1", 1).socket_for(0)
        settings.transfer_port = settings.listen_socket.getsockname()[1]
    port = settings.transfer_port
    # Each attempt numbered as the node's HTTP process numbers it; rank 0's answer carries it back.
    prefill.backend.on_command(PdTransferSetup(epoch, setup_id=2 * epoch + 1))
    decode.backend.on_command(PdTransferSetup(epoch, "127.0.0.1", port, setup_id=2 * epoch + 2))
    for node, setup_id in ((prefill, 2 * epoch + 1), (decode, 2 * epoch + 2)):
        assert node.messages[-1] == PdSetupDone(epoch, "", setup_id)
        handle = node.pd.handle_for(epoch)
        assert handle.wait_ready(90), handle.broken_reason


def submit(prefill: Node, decode: Node, request_id: int, prompt: List[int], params: SamplingParams,
           epoch: Optional[int] = None) -> Optional[int]:
    """Reserve on D first, then prefill on P from D's kv_start; None when D answered busy.

    ``epoch``: the pair the request runs on (default: the one both nodes set up last).
    """
    if epoch is None:
        epoch = decode.pd.epochs[-1]
    spec = RequestSpec.build(prompt, params, pd_kind=PD_KIND_DECODE, pd_epoch=epoch)
    if decode.backend.intake(request_id, spec) is None:
        return None
    kv_start = decode.notices(request_id)["reserved"].kv_start
    prefill.backend.intake(request_id, RequestSpec.build(prompt, params, pd_kind=PD_KIND_PREFILL, kv_start=kv_start,
                                                         pd_epoch=epoch))
    return kv_start


def run_until(nodes: Tuple[Node, ...], done, timeout_s: float = 120.0) -> None:
    """Iterate ``nodes`` until ``done()``; fails after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, [(n.finished, n.pd.in_flight) for n in nodes]
        for node in nodes:
            node.iterate()
        time.sleep(0.002)
