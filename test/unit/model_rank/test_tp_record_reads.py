"""Under TP, rank 0 publishes no request's finish before every rank has read that request's record.

The HTTP side frees a request's shared-memory record once rank 0 has published its finish; the
other ranks read the record themselves when they apply rank 0's ``AddRequests``.  A request
aborted in the very command list that admitted it ends in a step with no forward, so nothing
kept rank 0 from publishing (and the HTTP side from freeing the slot) before a lagging rank 1
read the record: rank 1 then failed with ``StaleRecordError``, finished with an error a request
rank 0 had admitted and aborted, and its scheduling state was no longer rank 0's.

The two-rank test runs real gloo ranks, each a :class:`ModelRank` over a shard of the tiny model
(its forwards all-reduce), a real shared-memory request buffer and the real TP command channel.
Rank 1 is made to lag without any timing: its read of the aborted request's record waits until
rank 0 has either published that request's finish or started waiting for the other ranks, and
rank 0's stand-in for the HTTP side frees each record the moment its finish is published.
"""

from __future__ import annotations

import os
import pickle
import time
from collections import deque
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import zmq

from lightllm.common.basemodel.parallel import TensorParallelGroup
from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.models.registry import load_model
from lightllm.server.core.objs.finish_status import FINISH_ABORT, FINISH_LENGTH
from lightllm.server.core.objs.io_messages import AbortRequests, AddRequests
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.model_rank.command_channel import TpCommandChannel
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.rank_process import ModelRank
from lightllm.server.model_rank.record_read_fence import RecordReadFence
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.model_rank.scheduling.step_report import StepReport
from lightllm.utils.free_ports import free_port

from shm_test_support import scratch_req_buffer

TEST_TIMEOUT = timedelta(seconds=120)  # a hung peer fails the test instead of hanging it
LAG_LIMIT_S = 60.0  # only a hang reaches it: rank 1's lag ends on rank 0's actions, not on time
SLOTS = 32
MAX_LEN = 256
# Request id -> its record's slot.  The first scenario: ABORTED_AT_ONCE is admitted and aborted in
# one command list (no forward in between).  The second: RUNS is admitted with SECOND_ABORTED,
# aborted likewise, while RUNS runs: the step that finishes SECOND_ABORTED samples RUNS's token.
ABORTED_AT_ONCE, RUNS, SECOND_ABORTED = 28, 29, 30
SLOT_OF = {ABORTED_AT_ONCE: 15, RUNS: 16, SECOND_ABORTED: 17}
PARAMS = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
PROMPTS = {ABORTED_AT_ONCE: [5, 6, 7, 8], RUNS: [9, 10, 11, 12, 13], SECOND_ABORTED: [14, 15, 16]}


class _ScriptedInbox:
    """Rank 0's inbox (a zmq PULL socket on a server), fed by the test's script."""

    def __init__(self) -> None:
        self.queue: "deque[Any]" = deque()

    def poll(self, timeout_ms: int) -> bool:
        if not self.queue:
            time.sleep(timeout_ms / 1000)
        return bool(self.queue)

    def recv_pyobj(self, flags: int = 0) -> Any:
        if not self.queue:
            raise zmq.Again()
        return self.queue.popleft()


class _AnnouncingChannel(TpCommandChannel):
    """Rank 0's real channel, which also tells the lagging rank 1 when rank 0 waits for the ranks."""

    announce: Any = None  # the event rank 1's lagging read waits for

    def wait_for_ranks(self) -> None:
        self.announce.set()
        super().wait_for_ranks()


class _LaggingRecords(ShmReqBuffer):
    """Rank 1's view of the records: its read of ABORTED_AT_ONCE's record waits for ``may_read``."""

    may_read: Any = None
    timed_out = False

    def read_request(self, slot: int, request_id: int) -> RequestSpec:
        if request_id == ABORTED_AT_ONCE and not self.may_read.wait(LAG_LIMIT_S):
            _LaggingRecords.timed_out = True
        return super().read_request(slot, request_id)


class _Outcomes:
    """The step publisher's place: records every finish; on rank 0 it is also the HTTP side that
    frees each finished request's record at once, and the script that sends the next commands."""

    def __init__(self, records: ShmReqBuffer, may_read: Any = None, inbox: Optional[_ScriptedInbox] = None) -> None:
        self.records = records
        self.may_read = may_read
        self.inbox = inbox
        self.rank: Optional[ModelRank] = None
        self.finished: List[Tuple[int, int, List[int]]] = []

    def publish(self, report: StepReport) -> None:
        for req, status in report.finished:
            self.finished.append((req.request_id, status, list(req.output_ids)))
        if self.inbox is None:
            return  # a follower's record: it publishes nothing
        for req, _ in report.finished:
            self.records.release(req.shm_index, req.request_id)
            self.may_read.set()
            if req.request_id == ABORTED_AT_ONCE:
                self.inbox.queue.extend([AddRequests([(RUNS, SLOT_OF[RUNS]), (SECOND_ABORTED, SLOT_OF[SECOND_ABORTED])]),
                                         AbortRequests([SECOND_ABORTED])])
            if req.request_id == RUNS:
                self.rank.stop()

    def flush_notices(self) -> None:
        """No notices here (a PD node's)."""


def _broadcast_tokens(tokens: torch.Tensor) -> torch.Tensor:
    tokens = tokens.contiguous()
    dist.broadcast(tokens, src=0)  # the model's group, as on a server
    return tokens


def _rank_worker(rank: int, port: int, model_dir: str, records_name: str, may_read: Any, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=TEST_TIMEOUT)
    model = load_model(model_dir, dtype=torch.float32, tp=TensorParallelGroup(rank, 2, dist.group.WORLD))
    _AnnouncingChannel.announce = may_read
    _LaggingRecords.may_read = may_read
    channel = (_AnnouncingChannel if rank == 0 else TpCommandChannel).open(rank, 2, timeout=TEST_TIMEOUT)
    records = (ShmReqBuffer if rank == 0 else _LaggingRecords)(records_name, SLOTS, MAX_LEN, create=False)
    context = InferenceContext(model.new_kv_cache(1024), ReqManager(8, MAX_LEN + 1), use_prefix_cache=True)
    backend = build_rank_backend("normal", model, context, build_prefill_queue_strategy("default"),
                                 StepPlanner(128, 64), Sampler(0), [2], MAX_LEN, token_sync=_broadcast_tokens)
    inbox = _ScriptedInbox() if rank == 0 else None
    outcomes = _Outcomes(records, may_read, inbox)
    model_rank = ModelRank(backend, records, is_leader=rank == 0, channel=channel, inbox=inbox, publisher=outcomes)
    outcomes.rank = model_rank
    if inbox is not None:
        # Drained in one iteration: the request is admitted and aborted before any step.
        inbox.queue.extend([AddRequests([(ABORTED_AT_ONCE, SLOT_OF[ABORTED_AT_ONCE])]), AbortRequests([ABORTED_AT_ONCE])])
    model_rank.serve_forever()
    fence = getattr(model_rank, "read_fence", None)  # None before the fence existed
    result: Dict[str, Any] = {
        "finished": outcomes.finished,
        "fence_waits": fence.waits if fence is not None else 0,
        "channel_waits": getattr(channel, "waits", 0),
        "lag_timed_out": _LaggingRecords.timed_out,
    }
    with open(f"{out_path}.{rank}", "wb") as out:
        pickle.dump(result, out)
    records.close()
    dist.destroy_process_group()
    # Past the results: skip the interpreter's teardown, which aborted in about one run of three
    # on a 2-core VM ("terminate called without an active exception", after the process group was
    # destroyed); a server's ranks never take that path (their supervisor ends them by signal).
    os._exit(0)


def _load(path: str) -> Dict[str, Any]:
    with open(path, "rb") as source:
        return pickle.load(source)


def test_rank0_publishes_a_finish_only_after_every_rank_read_the_record(tiny_llama_dir, tmp_path):
    out_path = str(tmp_path / "ranks")
    with scratch_req_buffer(SLOTS, MAX_LEN) as records:
        for request_id, slot in SLOT_OF.items():
            records.write_request(slot, request_id, RequestSpec(PROMPTS[request_id], PARAMS))
        may_read = mp.get_context("spawn").Event()
        mp.spawn(_rank_worker, args=(free_port(), str(tiny_llama_dir), records.name, may_read, out_path), nprocs=2,
                 join=True)
        still_held = [request_id for request_id, slot in SLOT_OF.items() if records.holder(slot) == request_id]
    leader, follower = (_load(f"{out_path}.{rank}") for rank in (0, 1))
    assert not follower["lag_timed_out"]
    # Rank 1 read the record while it still held the request, so it admitted and aborted it as
    # rank 0 did (before the fence it finished the request with FINISH_ERROR: StaleRecordError).
    assert follower["finished"] == leader["finished"]
    assert [(request_id, status) for request_id, status, _ in leader["finished"]] == [
        (ABORTED_AT_ONCE, FINISH_ABORT), (SECOND_ABORTED, FINISH_ABORT), (RUNS, FINISH_LENGTH)]
    assert len(leader["finished"][-1][2]) == PARAMS.max_new_tokens
    # One wait, for the step that ran no forward; the step that finished SECOND_ABORTED sampled
    # RUNS's token (every rank had joined its forward), and the others finished nothing new.
    assert leader["fence_waits"] == follower["fence_waits"] == 1
    assert leader["channel_waits"] == follower["channel_waits"] == 1
    assert still_held == []  # the stand-in HTTP side freed every record once its finish was out


# --- the fence's rule, one rank ---------------------------------------------------------------
def _report(finished: List[int], sampled: List[int] = (), carried: List[int] = ()) -> StepReport:
    report = StepReport()
    report.finished = [(InferReq(request_id=request_id, prompt_ids=[1]), FINISH_ABORT) for request_id in finished]
    report.tokens = [(InferReq(request_id=request_id, prompt_ids=[1]), 7, 0.0) for request_id in [*carried, *sampled]]
    report.carried_tokens = len(carried)
    return report


def test_the_fence_waits_only_for_a_finish_no_sampling_step_followed_since_its_admission():
    waits: List[int] = []
    fence = RecordReadFence(lambda: waits.append(1))
    assert not fence.before_publish(_report([1]))  # nothing admitted: a finish of an older request
    fence.admitted([1, 2])
    assert not fence.before_publish(_report([]))  # nothing finishes
    assert not fence.before_publish(_report([3]))  # a request admitted before
    # A decode node's carried first token is no forward of this step: the finish waits.
    assert fence.before_publish(_report([1], carried=[2])) and waits == [1]
    assert not fence.before_publish(_report([2]))  # the wait covered every read up to it
    fence.admitted([4])
    assert not fence.before_publish(_report([4], sampled=[5]))  # a sampling step: every rank joined its forward
    fence.admitted([6])
    assert not fence.before_publish(_report([], sampled=[5]))
    assert not fence.before_publish(_report([6]))  # read before that sampling step
    assert waits == [1] and fence.waits == 1


def test_a_single_rank_has_no_fence():
    assert ModelRank(backend=None, shm=None, is_leader=True).read_fence is None
