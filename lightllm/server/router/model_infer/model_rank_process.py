"""A model rank process: loads its shard of the model and runs the backend loop.

Rank 0 talks to the router and the detokenization process; every rank receives the same
command list each iteration through a torch.distributed broadcast, so all ranks run identical
scheduling decisions.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
import zmq

from lightllm.common.basemodel.model_config import parse_dtype
from lightllm.common.basemodel.parallel import TensorParallelGroup
from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import Sampler
from lightllm.models.registry import load_model
from lightllm.server.core.objs.io_messages import AbortRequests, AddRequests, RequestsReleased, StepOutput
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.core.objs.shm_stats import ShmStats
from lightllm.server.router.model_infer.infer_context import InferenceContext
from lightllm.server.router.model_infer.mode_backend.base_backend import ModeBackend, StepReport
from lightllm.server.router.model_infer.mode_backend.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.router.model_infer.mode_backend.step_planner import StepPlanner
from lightllm.utils.log_utils import init_logging
from lightllm.utils.process_utils import run_child, zmq_socket

log = logging.getLogger("lightllm.model_rank")

IDLE_POLL_MS = 20


@dataclass
class ModelRankConfig:
    """Everything a rank needs (picklable for spawn)."""

    rank: int
    tp: int
    model_dir: str
    dtype: str
    device: str
    nccl_host: str
    nccl_port: int
    model_rank0_address: str
    router_address: str
    detokenization_address: str
    shm_req_name: str
    shm_stats_name: str
    slot_num: int
    max_req_total_len: int
    max_total_token_num: int
    running_max_req_size: int
    batch_max_tokens: int
    chunked_prefill_size: Optional[int]
    prefill_queue_strategy: str
    use_prefix_cache: bool
    eos_token_ids: List[int]
    log_level: str
    sampler_seed: int = 0
    torch_threads: Optional[int] = None


class ModelRank:
    """One rank: its model shard, backend, and (on rank 0) the message plumbing."""

    def __init__(self, config: ModelRankConfig):
        self.config = config
        self.is_leader = config.rank == 0
        device = torch.device(config.device if config.device == "cpu" else f"cuda:{config.rank}")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.tp = TensorParallelGroup(config.rank, config.tp)
        if config.tp > 1:
            dist.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo",
                init_method=f"tcp://{config.nccl_host}:{config.nccl_port}",
                rank=config.rank,
                world_size=config.tp,
                timeout=timedelta(hours=24),
            )
            self.tp.group = dist.group.WORLD
        model = load_model(config.model_dir, dtype=parse_dtype(config.dtype), device=device, tp=self.tp)
        context = InferenceContext(
            model.new_kv_cache(config.max_total_token_num),
            ReqManager(config.running_max_req_size, config.max_req_total_len + 1, device=device),
            use_prefix_cache=config.use_prefix_cache,
        )
        self.backend = ModeBackend(
            model,
            context,
            build_prefill_queue_strategy(config.prefill_queue_strategy),
            StepPlanner(config.batch_max_tokens, config.chunked_prefill_size),
            Sampler(config.sampler_seed),
            config.eos_token_ids,
            config.max_req_total_len,
            token_sync=self._broadcast_tokens if config.tp > 1 else None,
        )
        self.shm = ShmReqBuffer(config.shm_req_name, config.slot_num, config.max_req_total_len, create=False)
        self.stats: Optional[ShmStats] = None
        self.steps = 0
        self._last_step_did_work = False
        if self.is_leader:
            self.zmq_ctx = zmq.Context()
            self.inbox = zmq_socket(self.zmq_ctx, zmq.PULL, config.model_rank0_address, bind=True)
            self.to_router = zmq_socket(self.zmq_ctx, zmq.PUSH, config.router_address, bind=False)
            self.to_detokenization = zmq_socket(self.zmq_ctx, zmq.PUSH, config.detokenization_address, bind=False)
            self.stats = ShmStats(config.shm_stats_name, create=False)
            self.stats.set("kv_total_tokens", config.max_total_token_num)
            self._publish_stats()

    def _broadcast_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.contiguous()
        dist.broadcast(tokens, src=0)
        return tokens

    def receive_commands(self) -> List[Any]:
        """Rank 0 drains its inbox (waiting briefly when idle); every rank gets the same list."""
        commands: List[Any] = []
        if self.is_leader:
            # Wait for messages only when the last step could not do anything, so a batch that
            # is stalled (all requests paused) does not spin a core.
            timeout = 0 if self.backend.has_work and self._last_step_did_work else IDLE_POLL_MS
            if self.inbox.poll(timeout):
                while True:
                    try:
                        commands.append(self.inbox.recv_pyobj(zmq.NOBLOCK))
                    except zmq.Again:
                        break
        if self.config.tp > 1:
            box = [commands]
            dist.broadcast_object_list(box, src=0)
            commands = box[0]
        return commands

    def apply(self, commands: List[Any]) -> None:
        """Admit and abort requests as the router asked."""
        for command in commands:
            if isinstance(command, AddRequests):
                for request_id, shm_index in command.requests:
                    rec = self.shm.records[shm_index]
                    req = self.backend.add_request(
                        request_id,
                        self.shm.prompt_ids(shm_index),
                        self.shm.sampling_params(shm_index),
                        high_priority_request=bool(rec["high_priority_request"]),
                        shm_index=shm_index,
                    )
                    if self.is_leader:
                        rec["prompt_cache_len"] = req.prompt_cache_len
            elif isinstance(command, AbortRequests):
                for request_id in command.request_ids:
                    self.backend.abort(request_id)

    def publish(self, report: StepReport) -> None:
        """Rank 0 writes tokens and finish states to shared memory and notifies the others."""
        started = time.perf_counter()
        updates = {}
        for req, token, logprob in report.tokens:
            self.shm.publish_token(req.shm_index, token, logprob)
            updates[req.request_id] = (req.request_id, req.shm_index)
        released = []
        for req, status in report.finished:
            self.shm.records[req.shm_index]["finish_status"] = status
            updates[req.request_id] = (req.request_id, req.shm_index)
            released.append((req.request_id, req.shm_index))
        for req in self.backend.context.requests.values():
            self.shm.records[req.shm_index]["cur_kv_len"] = req.cur_kv_len
        if updates or released:
            self.to_detokenization.send_pyobj(StepOutput(list(updates.values()), released))
        if released:
            self.to_router.send_pyobj(RequestsReleased([r for r, _ in released]))
        self._publish_stats()
        self._add_time("step_schedule_us", report.schedule_seconds)
        self._add_time("step_forward_us", report.forward_seconds)
        self._add_time("step_sample_us", report.post_seconds)
        self._add_time("step_publish_us", time.perf_counter() - started)

    def _add_time(self, field: str, seconds: float) -> None:
        self.stats.set(field, self.stats.get(field) + int(seconds * 1e6))

    def _publish_stats(self) -> None:
        ctx = self.backend.context
        stats = self.stats
        stats.set("kv_free_tokens", ctx.kv_cache.available)
        stats.set("kv_cached_tokens", ctx.radix_cache.total_token_num if ctx.radix_cache else 0)
        stats.set("kv_allocatable_tokens", ctx.allocatable_token_num())
        stats.set("paused_requests", sum(1 for r in ctx.requests.values() if r.paused))
        stats.set("processed_prefill_tokens", self.backend.counter.value)
        stats.set("backend_steps", self.steps)

    def serve_forever(self) -> None:
        """The rank's main loop."""
        while True:
            self.apply(self.receive_commands())
            if not self.backend.has_work:
                continue
            report = self.backend.step()
            self._last_step_did_work = report.did_work
            self.steps += 1
            if self.is_leader:
                self.publish(report)


def model_rank_process_main(config: ModelRankConfig, ready_conn: Any) -> None:
    """Entry point of a model rank process."""
    init_logging(config.log_level)

    def body(mark_ready: Callable[[], None]) -> None:
        rank = ModelRank(config)
        log.info(
            "rank %d ready: prefill_queue_strategy=%s kv_tokens=%d",
            config.rank,
            config.prefill_queue_strategy,
            config.max_total_token_num,
        )
        mark_ready()
        rank.serve_forever()

    run_child(f"model_rank{config.rank}", ready_conn, body)
