"""A model rank process's composition root: everything the rank loop runs with, built from its config.

:func:`build_model_rank` sets up the device, the TP group, the model shard (and the threads its
forwards get, priced at start-up), the KV cache, one budget-sized start-up forward, the run mode's
backend and, on rank 0, the sockets and the step publisher, and returns the
:class:`~lightllm.server.model_rank.rank_process.ModelRank` loop; :func:`model_rank_process_main`
is the process's entry point.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import zmq

from lightllm.common.basemodel.attention.selection import AttentionBackendError, build_attention_backend, resolve_attention_backend
from lightllm.common.basemodel.linear_kernels import LinearBackendError, resolve_linear_backend
from lightllm.common.basemodel.serving_dtype import parse_dtype
from lightllm.common.basemodel.parallel import TensorParallelGroup
from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling.sampler import Sampler
from lightllm.models.registry import load_model
from lightllm.server.run_mode import RunMode, prefill_queue_description
from lightllm.server.core.objs.shm_heartbeats import HeartbeatStamp
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.model_rank.command_channel import TpCommandChannel
from lightllm.server.model_rank.execution.forward_cost import ForwardCostModel, ForwardShape, measure_rates
from lightllm.server.model_rank.execution.forward_threads import ForwardThreads, WideForwardRule
from lightllm.server.model_rank.execution.wide_forward_backoff import WideForwardBackoff
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.execution.startup_forward import run_startup_forward, startup_forward_lengths
from lightllm.server.model_rank.execution.structured_output import GrammarConstraints
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.pd_backend_settings import pd_backend_settings
from lightllm.server.model_rank.prefill_wait_tracker import PrefillWaitTracker
from lightllm.server.model_rank.rank_config import ModelRankConfig
from lightllm.server.model_rank.rank_process import ModelRank
from lightllm.server.model_rank.scheduling.backend_registry import ModeBackend
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.model_rank.step_publisher import StepPublisher
from lightllm.server.model_rank.step_trace import StepTrace
from lightllm.server.model_rank.tp_rendezvous import open_rendezvous_store
from lightllm.utils.log_utils import init_logging
from lightllm.server.model_rank.tp_peer_loss import lost_tp_peer
from lightllm.utils.process_utils import run_child, zmq_socket
from lightllm.utils.tokenizer_utils import load_tokenizer

log = logging.getLogger("lightllm.model_rank")


def build_model_rank(config: ModelRankConfig, strict_attention: bool = False) -> ModelRank:
    """Build this process's rank from ``config``: device, TP group, model, KV cache, the start-up
    forward, backend, and (rank 0) the sockets, the step publisher and the step trace.

    ``strict_attention``: the attention backend was named by the flag, not chosen by ``auto``."""
    is_leader = config.rank == 0
    device = _init_device(config)
    tp = _init_tp_group(config, device)
    # Created right after the model group, while every rank is at the same point of start-up
    # (creating a group is collective); None with TP = 1.
    channel = TpCommandChannel.open(config.rank, config.tp)
    model = load_model(
        config.model_dir, dtype=parse_dtype(config.dtype), device=device, tp=tp,
        attention=build_attention_backend(config.attention_backend, strict_attention),
        linear_backend=config.linear_backend,
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
    _run_startup_forward(config, model, kv_cache, req_manager, threads)
    context = InferenceContext(kv_cache, req_manager, use_prefix_cache=config.use_prefix_cache)
    backend = _build_backend(config, model, context, threads, mode_settings)
    shm = config.layout.open_requests()
    heartbeat = config.layout.open_heartbeat(config.process_name)
    if not is_leader:
        return ModelRank(backend, shm, is_leader=False, channel=channel,
                         idle_trim_seconds=config.idle_malloc_trim_seconds, heartbeat=heartbeat)
    return _build_leader_rank(config, backend, shm, context, channel, heartbeat, publishers)


def _init_device(config: ModelRankConfig) -> torch.device:
    """This rank's device (``cuda:<rank>`` made current, or the CPU); torch's thread count is set when given."""
    device = torch.device(config.device if config.device == "cpu" else f"cuda:{config.rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    return device


def _init_tp_group(config: ModelRankConfig, device: torch.device) -> TensorParallelGroup:
    """This rank's place in the TP group; with TP > 1 it joins the process group through the rendezvous
    store (NCCL on a GPU, gloo on the CPU)."""
    tp = TensorParallelGroup(config.rank, config.tp)
    if config.tp > 1:
        store = open_rendezvous_store(config.nccl_host, config.nccl_port, config.rank, config.tp, timedelta(hours=24))
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            store=store,
            rank=config.rank,
            world_size=config.tp,
            timeout=timedelta(hours=24),
        )
        tp.group = dist.group.WORLD
    return tp


def _run_startup_forward(config: ModelRankConfig, model: Any, kv_cache: Any, req_manager: ReqManager,
                         threads: Optional[ForwardThreads]) -> None:
    """Run the budget-sized start-up forward (rank 0 logs its size and time)."""
    lengths = startup_forward_lengths(config.batch_max_tokens, config.chunked_prefill_size, config.max_req_total_len,
                                      config.running_max_req_size, kv_cache.available)
    seconds = run_startup_forward(model, kv_cache, req_manager, lengths, threads)
    if config.rank == 0:
        log.info("start-up forward: %d prompt tokens in %d request%s, %.0f ms", sum(lengths), len(lengths),
                 "" if len(lengths) == 1 else "s", seconds * 1000)


def _build_backend(config: ModelRankConfig, model: Any, context: InferenceContext, threads: Optional[ForwardThreads],
                   mode_settings: Dict[str, Any]) -> ModeBackend:
    """The run mode's backend over ``context``: queue strategy, step planner, sampler and grammar constraints."""
    return build_rank_backend(
        config.run_mode,
        model,
        context,
        build_prefill_queue_strategy(config.prefill_queue_strategy, config.prefill_overtake_bound),
        StepPlanner(config.batch_max_tokens, config.chunked_prefill_size, mixed=config.mixed_batches,
                    defer_repeated_chunks=config.use_prefix_cache,
                    prompt_ends_cached_next_step=config.run_mode != RunMode.PREFILL),
        Sampler(config.sampling_seed, config.logprobs_mode),
        config.eos_token_ids,
        config.max_req_total_len,
        token_sync=_broadcast_tokens if config.tp > 1 else None,
        # TP ranks keep every compile they took in (grammar_compiler.py: a cancel is each rank's own timing).
        grammar=GrammarConstraints(lambda: load_tokenizer(config.model_dir), config.eos_token_ids,
                                   cancel_abandoned=config.tp == 1),
        threads=threads,
        **mode_settings,
    )


def _build_leader_rank(config: ModelRankConfig, backend: ModeBackend, shm: ShmReqBuffer, context: InferenceContext,
                       channel: Optional[TpCommandChannel], heartbeat: Optional[HeartbeatStamp],
                       publishers: List[StepPublisher]) -> ModelRank:
    """Rank 0's loop: its sockets, the step publisher (started, and appended to ``publishers`` for the
    notices bound to it late), the prefill wait tracker and the step trace."""
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
                     wait_tracker=wait_tracker, idle_trim_seconds=config.idle_malloc_trim_seconds,
                     step_trace=StepTrace(config.step_trace_path) if config.step_trace_path else None,
                     heartbeat=heartbeat)


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
        threads = ForwardThreads(narrow, wide, rule, WideForwardBackoff())
        if config.rank == 0:
            log.info("threads: %d, %d in a wide forward; %s", narrow, wide, rule.describe())
    elif config.rank == 0 and narrow:
        # One count for every forward (e.g. --tp 2 on two cores: one thread a rank either way).
        log.info("threads: %d in every forward (no core to borrow for a wide one)", narrow)
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
        rank = build_model_rank(resolved, strict_attention=config.attention_backend != "auto")
        log.info(
            "rank %d ready: attention_backend=%s linear_backend=%s %s kv_tokens=%d",
            config.rank,
            resolved.attention_backend,
            resolved.linear_backend,
            prefill_queue_description(config.run_mode, config.prefill_queue_strategy,
                                      config.prefill_overtake_bound.describe()),
            config.max_total_token_num,
        )
        mark_ready()
        rank.serve_forever()

    run_child(config.process_name, ready_conn, body, refused=(AttentionBackendError, LinearBackendError),
              consequential=lost_tp_peer)
