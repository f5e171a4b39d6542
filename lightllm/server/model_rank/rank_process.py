"""A model rank process: loads its shard of the model and runs the backend loop.

:func:`build_model_rank` (the composition root: device, TP group, model, KV cache, backend and,
on rank 0, sockets and publisher) returns a :class:`ModelRank`, the loop itself, which only sees
its collaborators; tests build one directly from fakes.

Rank 0 talks to the router and the detokenization process; with TP > 1 it sends the other ranks
the same command list before every step over a :class:`TpCommandChannel` (:mod:`.command_channel`),
so all ranks run identical scheduling decisions, and sends nothing but a rare keep-alive while
idle, when the other ranks block in the channel.

Admission is screened on rank 0 before the broadcast: a request whose shared-memory record does
not read back as a valid request becomes a :class:`RejectRequests` entry, so every rank finishes
it with an error and none of them runs it.

The loop is the same in every run mode: each admitted request goes to ``backend.intake``, any
command it does not know to ``backend.on_command``, and ``backend.poll`` runs once per
iteration.  A PD node's backend carries the rank's KV transfer (:mod:`.pd_rank_transfer`) behind
those hooks: the transfer setup arrives as a command like the others, a decode node's prefilled
arrivals are reserved (or answered busy) at intake, a prefill node's hand-offs are sent right
after the step that produced them, and transfer results are polled once per loop; rank 0 tells
the HTTP process what it needs (setup done, reserved, transfer outcome) in its step output
stream through the detokenizer (``StepOutput.notices``), ahead of the tokens and finish they
explain.
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
from lightllm.server.core.objs.io_messages import AbortRequests, AddRequests
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.model_rank.command_channel import MessageKind, TpCommandChannel
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.execution.forward_cost import ForwardCostModel, ForwardShape, measure_rates
from lightllm.server.model_rank.execution.forward_threads import ForwardThreads, WideForwardRule
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.scheduling.backend_registry import ModeBackend
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.prefill_wait_tracker import PrefillWaitTracker
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.model_rank.execution.structured_output import GrammarConstraints
from lightllm.server.model_rank.execution.startup_forward import run_startup_forward, startup_forward_lengths
from lightllm.server.model_rank.rank_config import ModelRankConfig
from lightllm.server.model_rank.step_publisher import StepPublisher
from lightllm.server.model_rank.pd_rank_transfer import pd_backend_settings
from lightllm.utils.log_utils import init_logging
from lightllm.utils.envs_utils import DEFAULT_IDLE_MALLOC_TRIM_SECONDS
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
    """One rank's loop: take the iteration's commands, apply them, step the backend, publish (rank 0).

    Build a server's with :func:`build_model_rank`.

    Args:
        backend: the run mode's backend (intake, hooks and the step engine).
        shm: the request records (rank 0 screens them; every rank reads admitted ones).
        is_leader: rank 0, which reads the inbox, screens, and sends the other ranks their commands.
        channel: the TP command channel (None with TP = 1).
        inbox: rank 0's zmq PULL socket (router and HTTP messages).
        publisher: rank 0's step publisher (None elsewhere: only rank 0 publishes).
        wait_tracker: rank 0's prefill-wait metrics, fed at admission.
        idle_trim_seconds: idle seconds before freed heap memory goes back to the kernel (inf: never).
    """

    def __init__(
        self,
        backend: ModeBackend,
        shm: ShmReqBuffer,
        *,
        is_leader: bool,
        channel: Optional[TpCommandChannel] = None,
        inbox: Any = None,
        publisher: Optional[StepPublisher] = None,
        wait_tracker: Optional[PrefillWaitTracker] = None,
        idle_trim_seconds: float = DEFAULT_IDLE_MALLOC_TRIM_SECONDS,
    ) -> None:
        self.backend = backend
        self.idle_trim_seconds = idle_trim_seconds
        self.shm = shm
        self.is_leader = is_leader
        self.channel = channel
        self.inbox = inbox
        self.publisher = publisher
        self.wait_tracker = wait_tracker
        self._stop_requested = False
        self._last_step_did_work = False
        # Rank 0's screened reads of admitted records, reused by apply() instead of reading again.
        self._screened: Dict[int, RequestSpec] = {}

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
        return self.backend.has_work or self.backend.has_outside_work

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
        """Admit, reject and abort requests as the (screened) commands say; other commands go to the backend."""
        for command in commands:
            if isinstance(command, AddRequests):
                for request_id, shm_index in command.requests:
                    self._admit(request_id, shm_index)
            elif isinstance(command, RejectRequests):
                for request_id, shm_index in command.requests:
                    self.backend.reject(request_id, shm_index)
            elif isinstance(command, AbortRequests):
                for request_id in command.request_ids:
                    self.backend.abort(request_id)
            else:
                self.backend.on_command(command)

    def _admit(self, request_id: int, shm_index: int) -> None:
        try:
            req = self.backend.intake(request_id, self._read_request(request_id, shm_index), shm_index)
        except Exception:  # noqa: BLE001 - one request must not stop the rank
            # Every rank reads the same record into the same state, so all of them take this
            # branch together and stay in step.
            log.exception("admitting request %d failed; finishing it with an error", request_id)
            self.backend.reject(request_id, shm_index)
            return
        if req is not None and self.is_leader:
            self.shm.set_prompt_cache_len(shm_index, request_id, req.prompt_cache_len)
            if self.wait_tracker is not None:
                self.wait_tracker.on_arrival(req)

    def serve_forever(self) -> None:
        """The rank's main loop."""
        # Freed activation memory goes back to the kernel once the rank has been idle a while.
        trimmer = IdleMallocTrimmer(self.idle_trim_seconds)
        freeze_startup_objects()
        while True:
            commands = self.receive_commands()
            if commands is None:
                return
            self.apply(commands)
            self.backend.poll()
            if not self.backend.has_work:
                if self.publisher is not None:
                    self.publisher.flush_notices()  # a setup answer or notice with no step to carry it
                trimmer.idle()
                continue
            trimmer.busy()
            report = self.backend.step()
            self._last_step_did_work = report.did_work
            if self.publisher is not None:
                self.publisher.publish(report)


def build_model_rank(config: ModelRankConfig) -> ModelRank:
    """Build this process's rank from ``config``: device, TP group, model, KV cache, backend, and
    (rank 0) the sockets and the step publisher."""
    is_leader = config.rank == 0
    device = torch.device(config.device if config.device == "cpu" else f"cuda:{config.rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    tp = TensorParallelGroup(config.rank, config.tp)
    if config.tp > 1:
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{config.nccl_host}:{config.nccl_port}",
            rank=config.rank,
            world_size=config.tp,
            timeout=timedelta(hours=24),
        )
        tp.group = dist.group.WORLD
    # Created right after the model group, while every rank is at the same point of start-up
    # (creating a group is collective); None with TP = 1.
    channel = TpCommandChannel.open(config.rank, config.tp)
    model = load_model(
        config.model_dir, dtype=parse_dtype(config.dtype), device=device, tp=tp,
        attention=build_attention_backend(config.attention_backend), linear_backend=config.linear_backend,
    )
    threads = _forward_threads(config, model) if config.torch_threads else None
    kv_cache = model.new_kv_cache(config.max_total_token_num)
    # A PD node's notices travel in the step output stream, so the HTTP process gets each one
    # before the tokens and finish it explains (one path, one order).  The publisher reports on
    # the backend, so it is built after the transfer the backend carries: notices reach it late-bound.
    publishers: List[StepPublisher] = []
    mode_settings = pd_backend_settings(
        config, kv_cache,
        agree=_gather_objects if config.tp > 1 else None,
        notify=(lambda message: publishers[0].notify(message)) if is_leader else None,
    )
    req_manager = ReqManager(config.running_max_req_size, config.max_req_total_len + 1, device=device)
    lengths = startup_forward_lengths(config.batch_max_tokens, config.chunked_prefill_size, config.max_req_total_len,
                                      config.running_max_req_size, kv_cache.available)
    seconds = run_startup_forward(model, kv_cache, req_manager, lengths, threads)
    if is_leader:
        log.info("start-up forward: %d prompt tokens in %d request%s, %.0f ms", sum(lengths), len(lengths),
                 "" if len(lengths) == 1 else "s", seconds * 1000)
    context = InferenceContext(kv_cache, req_manager, use_prefix_cache=config.use_prefix_cache)
    backend = build_rank_backend(
        config.run_mode,
        model,
        context,
        build_prefill_queue_strategy(config.prefill_queue_strategy, config.prefill_overtake_bound),
        StepPlanner(config.batch_max_tokens, config.chunked_prefill_size, mixed=config.mixed_batches),
        Sampler(config.sampling_seed),
        config.eos_token_ids,
        config.max_req_total_len,
        token_sync=_broadcast_tokens if config.tp > 1 else None,
        grammar=GrammarConstraints(lambda: load_tokenizer(config.model_dir)),
        threads=threads,
        **mode_settings,
    )
    shm = config.layout.open_requests()
    if not is_leader:
        return ModelRank(backend, shm, is_leader=False, channel=channel,
                         idle_trim_seconds=config.idle_malloc_trim_seconds)
    layout = config.layout
    zmq_ctx = zmq.Context()  # its sockets keep it alive
    inbox = zmq_socket(zmq_ctx, zmq.PULL, layout.model_rank0_address, bind=True)
    to_router = zmq_socket(zmq_ctx, zmq.PUSH, layout.router_address, bind=False)
    to_detokenization = zmq_socket(zmq_ctx, zmq.PUSH, layout.detokenization_address, bind=False)
    wait_tracker = PrefillWaitTracker(config.prefill_overtake_bound)
    publisher = StepPublisher(shm, layout.open_stats(), backend, context, wait_tracker, to_detokenization, to_router)
    publishers.append(publisher)
    publisher.start(config.max_total_token_num)
    return ModelRank(backend, shm, is_leader=True, channel=channel, inbox=inbox, publisher=publisher,
                     wait_tracker=wait_tracker, idle_trim_seconds=config.idle_malloc_trim_seconds)


def _gather_objects(value: Any) -> List[Any]:
    """Every TP rank's ``value``, in rank order (a collective: every rank calls it alike)."""
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _broadcast_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """Rank 0's sampled tokens on every TP rank."""
    tokens = tokens.contiguous()
    dist.broadcast(tokens, src=0)
    return tokens


def _forward_threads(config: ModelRankConfig, model: Any) -> ForwardThreads:
    """The rank's thread counts, with the wide-forward rule priced by rates measured here (CPU)."""
    narrow, wide = config.torch_threads, config.prefill_torch_threads or config.torch_threads
    threads = ForwardThreads(narrow, wide)
    if wide != narrow:
        shape = ForwardShape.from_config(model.config, config.tp, parse_dtype(config.dtype))
        rule = WideForwardRule(ForwardCostModel(shape, measure_rates(shape, parse_dtype(config.dtype), model.attention, model.head_dim,
                                                                model.linear_backend)),
                               config.wide_forward_ms_per_token / 1000)
        threads = ForwardThreads(narrow, wide, rule)
        if config.rank == 0:
            log.info("threads: %d, %d in a wide forward; %s", narrow, wide, rule.describe())
    threads.apply()
    return threads


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
        rank = build_model_rank(resolved)
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
