"""A decode rank holds each reservation for the lease its request carries, bounded by its own flag.

The rank is the real one (a decode backend carrying its PdRankTransfer over the tiny model's KV
cache).  The first test records what the rank asks its transfer handle for; the second runs real
transfer processes paired with a real prefill rank that never sends, so each reservation expires
at the lease the transfer process was given, which its failure message names.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import pytest
import torch

from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.models.registry import load_model
from lightllm.server.core.objs.finish_status import FINISH_TRANSFER_FAILED
from lightllm.server.core.objs.io_messages import PdNotice, PdSetupDone, PdTransferSetup
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.pd_transfer.base import PdRankTransfer
from lightllm.server.model_rank.pd_transfer.decode import DecodeRankTransfer
from lightllm.server.model_rank.pd_transfer.prefill import PrefillRankTransfer
from lightllm.server.model_rank.rank_config import PdRankSettings
from lightllm.server.model_rank.rank_config import DEFAULT_RESERVE_LEASE_S
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.pd.kv_transfer import KVTransferHandle, TransferStoreHost
from lightllm.server.pd.node.transfer_ports import TransferPortBlock

MAX_LEN = 200
EPOCH = 3


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


class RecordingHandle:
    """A transfer handle that records the receives it is asked for and never completes one."""

    broken_reason: Optional[str] = None

    def __init__(self) -> None:
        self.receives: Dict[int, float] = {}

    def receive(self, request_id: int, slots: Any, wait_s: Optional[float] = None) -> None:
        self.receives[request_id] = wait_s

    def poll(self) -> List[Any]:
        return []

    def cancel_receive(self, request_id: int) -> None:
        pass

    def close(self) -> None:
        pass


class Rank:
    """One PD rank of ``role`` (its backend carries its PdRankTransfer) and what rank 0 reported."""

    def __init__(self, model, role: str, settings: PdRankSettings, make_handle) -> None:
        self.messages: List[Any] = []
        side: type[PdRankTransfer] = PrefillRankTransfer if role == "prefill" else DecodeRankTransfer
        self.pd = side(0, settings, make_handle, notify=self.messages.append)
        cache = model.new_kv_cache(512)
        cache.share_buffers()
        context = InferenceContext(cache, ReqManager(8, MAX_LEN + 1), use_prefix_cache=True)
        extra = {"end_segment_on_kv_pressure": True} if role == "decode" else {}
        self.backend = build_rank_backend(role, model, context, build_prefill_queue_strategy("default"),
                                          StepPlanner(64, 32), Sampler(0), [2], MAX_LEN, transfer=self.pd, **extra)
        self.finished: Dict[int, int] = {}

    def reserve(self, request_id: int, lease_s: float) -> None:
        spec = RequestSpec.build(list(range(5, 25)), SamplingParams(max_new_tokens=4), pd_kind=PD_KIND_DECODE,
                                 pd_epoch=EPOCH, pd_lease_s=lease_s)
        assert self.backend.intake(request_id, spec) is not None

    def iterate(self) -> None:
        self.backend.poll()
        if self.backend.has_work:
            for req, status in self.backend.step().finished:
                self.finished[req.request_id] = status

    def failure(self, request_id: int) -> PdNotice:
        return next(m for m in self.messages if isinstance(m, PdNotice) and m.request_id == request_id
                    and m.kind == "transfer_failed")


@pytest.mark.parametrize(
    ("cap", "leases"),
    [
        (None, {1: (630.0, 630.0), 2: (0.0, DEFAULT_RESERVE_LEASE_S)}),
        (12.5, {1: (630.0, 12.5), 2: (0.0, 12.5), 3: (4.0, 4.0)}),
    ],
)
def test_each_receive_waits_for_its_requests_lease_within_the_nodes_bound(model, cap, leases) -> None:
    handle = RecordingHandle()
    rank = Rank(model, "decode", PdRankSettings(reserve_lease_s=cap), lambda *args: handle)
    rank.backend.on_command(PdTransferSetup(EPOCH, "127.0.0.1", 1))
    for request_id, (requested, _) in leases.items():
        rank.reserve(request_id, requested)
    assert handle.receives == {request_id: lease for request_id, (_, lease) in leases.items()}


def test_a_reservation_expires_at_its_own_lease_or_at_the_nodes_bound(model) -> None:
    def real_handle(rank: Rank):
        def make(role: str, host: str, port: int, group_name: str, store_host: Optional[TransferStoreHost]):
            s = rank.pd.settings
            return KVTransferHandle(role, rank.backend.kv.kv_cache, host, port, page_size=s.page_size,
                                    timeout_s=s.transfer_timeout_s, connect_timeout_s=s.connect_timeout_s,
                                    receive_wait_s=s.lease_for(0.0), group_name=group_name, store_host=store_host)
        return make

    ports = TransferPortBlock.reserve("127.0.0.1", 1)
    listen = ports.socket_for(0)
    prefill_settings = PdRankSettings(listen_socket=listen, transfer_port=listen.getsockname()[1])
    prefill = Rank(model, "prefill", prefill_settings, None)
    prefill.pd._make_handle = real_handle(prefill)
    decode = Rank(model, "decode", PdRankSettings(reserve_lease_s=1.5), None)
    decode.pd._make_handle = real_handle(decode)
    try:
        prefill.backend.on_command(PdTransferSetup(EPOCH))
        decode.backend.on_command(PdTransferSetup(EPOCH, "127.0.0.1", prefill_settings.transfer_port))
        for rank in (prefill, decode):
            assert rank.messages[-1] == PdSetupDone(EPOCH, "")
            assert rank.pd.handle_for(EPOCH).wait_ready(90), rank.pd.handle_for(EPOCH).broken_reason
        decode.reserve(1, 0.5)  # the master's lease, shorter than the node's bound
        decode.reserve(2, 600.0)  # a master that would wait long: the node's 1.5 s bound applies
        deadline = time.monotonic() + 60  # a generous guard against a hang, not the result
        while len(decode.finished) < 2:
            assert time.monotonic() < deadline, decode.messages
            decode.iterate()
            time.sleep(0.01)
        assert decode.finished == {1: FINISH_TRANSFER_FAILED, 2: FINISH_TRANSFER_FAILED}
        assert [decode.failure(r).error_kind for r in (1, 2)] == ["lease_expired", "lease_expired"]
        assert "no KV arrived from the prefill side within 0.5 s" in decode.failure(1).message
        assert "no KV arrived from the prefill side within 1.5 s" in decode.failure(2).message
        assert decode.backend.kv.allocatable_token_num() == decode.backend.kv.kv_cache.size
    finally:
        prefill.pd.close()
        decode.pd.close()
        ports.close()
