"""A model rank process: loads its shard of the model and runs the backend loop.

Rank 0 talks to the router and the detokenization process; with TP > 1 it sends the other ranks
the same command list before every step over a :class:`TpCommandChannel` (:mod:`.command_channel`),
so all ranks run identical scheduling decisions, and sends nothing but a rare keep-alive while
idle, when the other ranks block in the channel.

Admission is screened on rank 0 before the broadcast: a request whose shared-memory record does
not read back as a valid request becomes a :class:`RejectRequests` entry, so every rank finishes
it with an error and none of them runs it.

A PD node's ranks (``run_mode`` prefill or decode) also own a KV transfer each
(:mod:`.pd_rank_transfer`): the transfer setup arrives as a command like the others, a decode
node's prefilled arrivals are reserved (or answered busy) at admission, a prefill node's
hand-offs are sent right after the step that produced them, and transfer results are polled
once per loop; rank 0 tells the HTTP process what it needs (setup done, reserved, transfer
outcome) over a push socket to the HTTP inbox.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import zmq

from lightllm.common.basemodel.attention.selection import AttentionBackendError, build_attention_backend, resolve_attention_backend
from lightllm.common.basemodel.linear_kernels import LinearBackendError, resolve_linear_backend
from lightllm.common.basemodel.model_config import parse_dtype
from lightllm.common.basemodel.parallel import TensorParallelGroup
from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling.sampler import Sampler
from lightllm.models.registry import load_model
from lightllm.server.core.objs.io_messages import (
    AbortRequests,
    AddRequests,
    PdTransferSetup,
)
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_NONE, PD_KIND_PREFILL
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.model_rank.command_channel import MessageKind, TpCommandChannel
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.execution.forward_cost import ForwardCostModel, ForwardShape, measure_rates
from lightllm.server.model_rank.execution.forward_threads import ForwardThreads, WideForwardRule
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.prefill_wait_tracker import PrefillWaitTracker
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.model_rank.execution.structured_output import GrammarConstraints
from lightllm.server.model_rank.rank_config import ModelRankConfig
from lightllm.server.model_rank.step_publisher import StepPublisher
from lightllm.server.model_rank.pd_rank_transfer import PD_ROLES, PdRankTransfer
from lightllm.server.pd.kv_transfer import KVTransferHandle
from lightllm.utils.log_utils import init_logging
from lightllm.utils.malloc_tuning import IdleMallocTrimmer
from lightllm.utils.process_utils import run_child, zmq_socket
from lightllm.utils.tokenizer_utils import load_tokenizer
from lightllm.utils.gc_tuning import freeze_startup_objects

log = logging.getLogger("lightllm.model_rank")

# Rank 0's inbox wait while requests are running but the last step could do nothing (all
# paused) or KV transfers are in flight: short, since only time or a transfer result unblocks them.
IDLE_POLL_MS = 20
# Rank 0's longest inbox wait with nothing running: a message ends it at once, so this only bounds
# how late the idle-time duties run (giving freed memory back, noticing a broken KV transfer).
LEADER_IDLE_WAKE_MS = 1000


@dataclass
class RejectRequests:
    """Rank 0 -> every rank, inside the broadcast command list: finish these requests with an error.

    ``requests`` holds ``(request_id, shm_index)`` pairs the router asked to admit but whose
    records failed rank 0's admission check.
    """

    requests: List[Tuple[int, int]] = field(default_factory=list)


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
        # Created right after the model group, while every rank is at the same point of start-up
        # (creating a group is collective); None with TP = 1.
        self.channel: Optional[TpCommandChannel] = TpCommandChannel.open(config.rank, config.tp)
        self._stop_requested = False
        model = load_model(
            config.model_dir, dtype=parse_dtype(config.dtype), device=device, tp=self.tp,
            attention=build_attention_backend(config.attention_backend), linear_backend=config.linear_backend,
        )
        threads = self._forward_threads(model) if config.torch_threads else None
        kv_cache = model.new_kv_cache(config.max_total_token_num)
        pd_role = config.run_mode if config.run_mode in PD_ROLES else None
        if pd_role is not None:
            kv_cache.share_buffers()  # the KV transfer process reads and writes it
        context = InferenceContext(
            kv_cache,
            ReqManager(config.running_max_req_size, config.max_req_total_len + 1, device=device),
            use_prefix_cache=config.use_prefix_cache,
        )
        self.context = context
        self.backend = build_rank_backend(
            config.run_mode,
            model,
            context,
            build_prefill_queue_strategy(config.prefill_queue_strategy, config.prefill_overtake_bound),
            StepPlanner(config.batch_max_tokens, config.chunked_prefill_size, mixed=config.mixed_batches),
            Sampler(config.sampling_seed),
            config.eos_token_ids,
            config.max_req_total_len,
            token_sync=self._broadcast_tokens if config.tp > 1 else None,
            grammar=GrammarConstraints(lambda: load_tokenizer(config.model_dir)),
            threads=threads,
        )
        if config.run_mode == "decode":
            self.backend.end_segment_on_kv_pressure = True
            self.backend.max_segment_tokens = config.pd.max_segment_tokens
        self.shm = config.layout.open_requests()
        self.wait_tracker = PrefillWaitTracker(config.prefill_overtake_bound)
        self.publisher: Optional[StepPublisher] = None  # rank 0 only
        self._last_step_did_work = False
        # Rank 0's screened reads of admitted records, reused by apply() instead of reading again.
        self._screened: Dict[int, RequestSpec] = {}
        if self.is_leader:
            self.zmq_ctx = zmq.Context()
            layout = config.layout
            self.inbox = zmq_socket(self.zmq_ctx, zmq.PULL, layout.model_rank0_address, bind=True)
            self.to_router = zmq_socket(self.zmq_ctx, zmq.PUSH, layout.router_address, bind=False)
            self.to_detokenization = zmq_socket(self.zmq_ctx, zmq.PUSH, layout.detokenization_address, bind=False)
            self.publisher = StepPublisher(self.shm, layout.open_stats(), self.backend, context, self.wait_tracker,
                                           self.to_detokenization, self.to_router)
            self.publisher.start(config.max_total_token_num)
            self.to_http = zmq_socket(self.zmq_ctx, zmq.PUSH, layout.http_address, bind=False) if pd_role else None
        self.pd: Optional[PdRankTransfer] = None
        if pd_role is not None:
            settings = config.pd
            self.pd = PdRankTransfer(
                pd_role,
                self.backend,
                config.rank,
                settings,
                lambda role, host, port, group_name: KVTransferHandle(
                    role, kv_cache, host, port, page_size=settings.page_size, timeout_s=settings.transfer_timeout_s,
                    connect_timeout_s=settings.connect_timeout_s, receive_wait_s=settings.reserve_lease_s,
                    group_name=group_name, listen_socket=settings.listen_socket,
                ),
                agree=self._gather_objects if config.tp > 1 else None,
                notify=self.to_http.send_pyobj if self.is_leader else None,
            )

    def _gather_objects(self, value: Any) -> List[Any]:
        gathered: List[Any] = [None] * self.config.tp
        dist.all_gather_object(gathered, value)
        return gathered

    def _forward_threads(self, model: Any) -> ForwardThreads:
        """The rank's thread counts, with the wide-forward rule priced by rates measured here (CPU)."""
        config = self.config
        narrow, wide = config.torch_threads, config.prefill_torch_threads or config.torch_threads
        threads = ForwardThreads(narrow, wide)
        if wide != narrow:
            shape = ForwardShape.from_config(model.config, config.tp, parse_dtype(config.dtype))
            rule = WideForwardRule(ForwardCostModel(shape, measure_rates(shape, parse_dtype(config.dtype), model.attention, model.head_dim,
                                                                    model.linear_backend)),
                                   config.wide_forward_ms_per_token / 1000)
            threads = ForwardThreads(narrow, wide, rule)
            if self.is_leader:
                log.info("threads: %d, %d in a wide forward; %s", narrow, wide, rule.describe())
        threads.apply()
        return threads

    def _broadcast_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.contiguous()
        dist.broadcast(tokens, src=0)
        return tokens

    def receive_commands(self) -> Optional[List[Any]]:
        """This iteration's commands, the same list in the same order on every rank; None: stop.

        Rank 0 drains its inbox and screens it; with TP > 1 it sends the result to the other
        ranks only when they have something to do (commands, running requests, transfers in
        flight), and otherwise at most a keep-alive.  The other ranks block in the channel.
        """
        if not self.is_leader:
            message = self.channel.receive()
            if message.kind is MessageKind.SHUTDOWN:
                return None
            # A keep-alive comes only while rank 0 runs nothing, and every rank holds the same
            # requests and transfers, so the empty pass it causes here steps and gathers nothing.
            return message.commands
        if self._stop_requested:
            if self.channel is not None:
                self.channel.send_shutdown()
            return None
        commands: List[Any] = []
        if self.inbox.poll(self._inbox_wait_ms()):
            while True:
                try:
                    commands.append(self.inbox.recv_pyobj(zmq.NOBLOCK))
                except zmq.Again:
                    break
        commands = self.screen(commands)
        if self.channel is not None:
            # With no commands the ranks' state is what it was after the last step, so rank 0's
            # own view tells whether the others have anything to run in this iteration.
            if commands or self._ranks_busy():
                self.channel.send_step(commands)
            else:
                self.channel.keep_alive()
        return commands

    def _ranks_busy(self) -> bool:
        """Whether this iteration runs a step or a transfer agreement (the same on every rank)."""
        return self.backend.has_work or (self.pd is not None and bool(self.pd.in_flight))

    def _inbox_wait_ms(self) -> int:
        """Rank 0: how long to wait for the first message of this iteration."""
        if self.backend.has_work and self._last_step_did_work:
            return 0
        # A stalled batch (all requests paused) or transfers in flight are polled, not spun on.
        if self._ranks_busy():
            return IDLE_POLL_MS
        wait_ms = LEADER_IDLE_WAKE_MS
        if self.channel is not None:
            wait_ms = min(wait_ms, math.ceil(self.channel.seconds_until_keepalive() * 1000))
        return wait_ms

    def stop(self) -> None:
        """Rank 0: leave :meth:`serve_forever` at the next iteration, taking the other ranks along."""
        self._stop_requested = True

    def screen(self, commands: List[Any]) -> List[Any]:
        """Rank 0: split each AddRequests into requests that read back valid and RejectRequests.

        This is the guard of shared memory: reading a record rebuilds its :class:`RequestSpec`
        (whose own checks run again on what the record holds) and :meth:`check_request` adds
        this rank's limits; nothing after it checks the request again.  Any failure reading or
        checking one record is that request's alone.
        """
        screened: List[Any] = []
        for command in commands:
            if not isinstance(command, AddRequests):
                screened.append(command)
                continue
            accepted, rejected = [], []
            for request_id, shm_index in command.requests:
                try:
                    spec = self.shm.read_request(shm_index, request_id)
                    self.backend.check_request(spec)
                except Exception as exc:  # noqa: BLE001 - reported to the request's client instead
                    log.warning("rejecting request %d at admission: %s", request_id, exc)
                    rejected.append((request_id, shm_index))
                    continue
                self._screened[request_id] = spec
                accepted.append((request_id, shm_index))
            if accepted:
                screened.append(AddRequests(accepted))
            if rejected:
                screened.append(RejectRequests(rejected))
        return screened

    def _read_request(self, request_id: int, shm_index: int) -> RequestSpec:
        screened = self._screened.pop(request_id, None)
        if screened is not None:
            return screened
        return self.shm.read_request(shm_index, request_id)

    def apply(self, commands: List[Any]) -> None:
        """Admit, reject and abort requests as the (screened) commands say."""
        for command in commands:
            if isinstance(command, AddRequests):
                for request_id, shm_index in command.requests:
                    try:
                        spec = self._read_request(request_id, shm_index)
                        pd_kind = spec.pd.kind
                        if pd_kind != PD_KIND_NONE:
                            self._check_pd_kind(pd_kind)
                        if pd_kind == PD_KIND_DECODE:
                            req = self.pd.reserve(request_id, shm_index, spec)
                            if req is not None and self.is_leader:
                                self.shm.set_prompt_cache_len(shm_index, request_id, req.prompt_cache_len)
                                log.info("request %d reserved: segment_index=%d kv_start=%d prompt=%d", request_id,
                                         spec.segment.segment_index, req.cur_kv_len, spec.prompt_len)
                            continue
                        req = self.backend.add_request(request_id, spec, shm_index)
                    except Exception:  # noqa: BLE001 - one request must not stop the rank
                        # Every rank reads the same record into the same state, so all of them
                        # take this branch together and stay in step.
                        log.exception("admitting request %d failed; finishing it with an error", request_id)
                        self.backend.reject(request_id, shm_index)
                        continue
                    if pd_kind == PD_KIND_PREFILL:
                        self.pd.note_prefill_request(request_id, spec.pd.kv_start)
                        if self.is_leader:
                            log.info("request %d admitted: segment_index=%d infer_high_priority=%d kv_start=%d prompt=%d",
                                     request_id, spec.segment.segment_index, spec.priority.infer_high_priority,
                                     spec.pd.kv_start, spec.prompt_len)
                    if self.is_leader:
                        self.shm.set_prompt_cache_len(shm_index, request_id, req.prompt_cache_len)
                        self.wait_tracker.on_arrival(req)
            elif isinstance(command, PdTransferSetup):
                if getattr(self, "pd", None) is None:
                    log.warning("a %s node ignores a KV transfer setup", self.config.run_mode)
                else:
                    self.pd.setup(command)
            elif isinstance(command, RejectRequests):
                for request_id, shm_index in command.requests:
                    self.backend.reject(request_id, shm_index)
            elif isinstance(command, AbortRequests):
                for request_id in command.request_ids:
                    self.backend.abort(request_id)

    def _check_pd_kind(self, pd_kind: int) -> None:
        """Raise unless this rank's run mode runs PD requests of ``pd_kind``."""
        wanted = {"prefill": PD_KIND_PREFILL, "decode": PD_KIND_DECODE}.get(self.config.run_mode)
        if self.pd is None or pd_kind != wanted:
            raise ValueError(f"a {self.config.run_mode} node cannot run a request of PD kind {pd_kind}")

    def serve_forever(self) -> None:
        """The rank's main loop."""
        trimmer = IdleMallocTrimmer()  # freed activation memory goes back to the kernel when idle
        pd = self.pd
        freeze_startup_objects()
        while True:
            commands = self.receive_commands()
            if commands is None:
                return
            self.apply(commands)
            if pd is not None:
                pd.tick()
            if not self.backend.has_work:
                trimmer.idle()
                continue
            trimmer.busy()
            report = self.backend.step()
            self._last_step_did_work = report.did_work
            if pd is not None:
                pd.send_handoffs(report)
                for req, _ in report.finished:
                    pd.forget(req.request_id)
                if pd.pending_tokens:
                    # A decode node's first tokens (from the prefill node) go out before this step's.
                    report.tokens[:0] = pd.pending_tokens
                    pd.pending_tokens = []
            if self.publisher is not None:
                self.publisher.publish(report)


def model_rank_process_main(config: ModelRankConfig, ready_conn: Any) -> None:
    """Entry point of a model rank process."""
    init_logging(config.log_level)

    def body(mark_ready: Callable[[], None]) -> None:
        # Resolved here, where torch is loaded anyway: the launcher imports no torch. A refused
        # explicit choice reaches the launcher as one line (run_child's ``refused``), exit 2.
        resolved = replace(
            config,
            attention_backend=resolve_attention_backend(config.attention_backend, config.device),
            linear_backend=resolve_linear_backend(config.linear_backend, config.device, parse_dtype(config.dtype)),
        )
        rank = ModelRank(resolved)
        log.info(
            "rank %d ready: attention_backend=%s linear_backend=%s prefill_queue_strategy=%s overtake_bound=%s kv_tokens=%d",
            config.rank,
            resolved.attention_backend,
            resolved.linear_backend,
            config.prefill_queue_strategy,
            config.prefill_overtake_bound.describe(),
            config.max_total_token_num,
        )
        mark_ready()
        rank.serve_forever()

    run_child(f"model_rank{config.rank}", ready_conn, body, refused=(AttentionBackendError, LinearBackendError))
