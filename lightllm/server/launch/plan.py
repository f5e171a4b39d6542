"""What a normal-mode server start decides before any process exists: its layout and every config.

:func:`plan_layout` builds the one :class:`~lightllm.server.server_layout.ServerLayout`;
:func:`build_process_configs` hands it, with the parsed flags, to the config of every process.
Both are pure (no process, no shared memory), so tests can check what each process would get.
A new run mode adds its own ``build_*_configs`` next to this one and reuses the layout.
"""

from __future__ import annotations

import argparse
import os
import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.detokenization.manager import DetokenizationConfig
from lightllm.server.httpserver.manager import HttpServerConfig
from lightllm.server.pd.node.transfer_ports import TransferPortBlock
from lightllm.server.pd.transfer_defaults import connect_timeout_for
from lightllm.server.router.manager import RouterConfig
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec
from lightllm.server.model_rank.rank_config import ModelRankConfig, PdRankSettings
from lightllm.server.request_defaults import RequestDefaults, resolve_eos_token_ids
from lightllm.server.run_mode import PD_NODE_MODES, PREFILLING_MODES, RunMode
from lightllm.server.server_layout import ServerLayout
from lightllm.server.launch.sizing import ServerSizing
from lightllm.utils.envs_utils import pd_transfer_failure_probability
from lightllm.utils.owner_locks import RANDOM_CHARS

# Drawn seeds stay below 2**63 so they print and pass through any signed 64-bit field.
SAMPLING_SEED_BITS = 63


def resolve_sampling_seed(args: argparse.Namespace) -> int:
    """``--sampling_seed`` when given, else a fresh seed from the OS entropy pool.

    Drawn once per start and handed to every TP rank, so the ranks agree while two starts
    without the flag sample differently.
    """
    if args.sampling_seed is not None:
        return args.sampling_seed
    return secrets.randbits(SAMPLING_SEED_BITS)


IPC_SOCKET_NAMES = ("router", "rank0", "detok", "http")
# zmq's limit for an ipc:// path: a Unix socket address holds 107 bytes and a terminating NUL.
MAX_IPC_PATH_BYTES = 107


def check_ipc_path_room(temp_dir: str, ipc_prefix: str) -> None:
    """Refuse a temporary directory too deep for the zmq socket paths the server creates in it.

    Found before anything starts, this is one line naming ``TMPDIR``; unchecked, the server built
    its shared memory and loaded the model, and a child then failed binding its socket.
    """
    longest = max(len(f"{name}.sock") for name in IPC_SOCKET_NAMES)
    path_bytes = len(os.fsencode(temp_dir)) + 1 + len(ipc_prefix) + RANDOM_CHARS + 1 + longest
    if path_bytes > MAX_IPC_PATH_BYTES:
        raise ValueError(
            f"the temporary directory {temp_dir!r} (TMPDIR) is too deep for the server's IPC sockets: their paths "
            f"would be {path_bytes} bytes, and a Unix socket path holds at most {MAX_IPC_PATH_BYTES}; set TMPDIR "
            "to a shorter directory")


def child_process_names(tp: int) -> Tuple[str, ...]:
    """The server's child processes, in spawn order, by their one name: the launcher's log and spawn, the
    child's own log and ``/proc`` name, its heartbeat field (the watchdog).  :func:`build_process_configs`
    hands each child its name in its config; nothing else spells them."""
    return ("detokenization", "router", *(f"model_rank{rank}" for rank in range(tp)))


def plan_layout(sizing: ServerSizing, shm_tag: str, ipc_dir: str,
                heartbeat_processes: Sequence[str] = ()) -> ServerLayout:
    """The layout of one server whose segments are named after ``shm_tag`` and whose zmq
    sockets live in ``ipc_dir``; ``heartbeat_processes``: the children the watchdog watches
    (:func:`child_process_names`; none with ``--watchdog_timeout 0``)."""
    address = {name: f"ipc://{ipc_dir}/{name}.sock" for name in IPC_SOCKET_NAMES}
    return ServerLayout(
        shm_req_name=f"{shm_tag}_req",
        shm_stats_name=f"{shm_tag}_stats",
        heartbeat_processes=tuple(heartbeat_processes),
        shm_heartbeat_name=f"{shm_tag}_beat" if heartbeat_processes else "",
        slot_num=sizing.slot_num,
        top_slot_num=sizing.top_slot_num,
        max_req_total_len=sizing.max_req_total_len,
        max_total_token_num=sizing.max_total_token_num,
        router_address=address["router"],
        model_rank0_address=address["rank0"],
        detokenization_address=address["detok"],
        http_address=address["http"],
    )


def pd_rank_settings(args: argparse.Namespace) -> PdRankSettings:
    """The KV transfer settings of a PD node's ranks, from the flags.

    ``--pd_transfer_port`` is resolved (a free block of TP ports when not given) by the node
    launch before the plan, so the ranks and the registration agree on it; a prefill rank's
    listening socket is added per rank by :func:`build_process_configs`.  A prefill node's injected
    transfer failure probability is read from its variable here, once (the environment check
    refused a bad value at start-up; a decode node does not read it).
    """
    return PdRankSettings(
        page_size=args.pd_kv_page_size,
        transfer_host=args.host,
        transfer_port=args.pd_transfer_port or 0,
        transfer_timeout_s=args.pd_transfer_timeout_seconds,
        connect_timeout_s=connect_timeout_for(args.pd_transfer_timeout_seconds),
        reserve_lease_s=args.pd_reserve_lease_seconds,
        max_segment_tokens=args.pd_max_segment_tokens,
        transfer_failure_probability=(
            pd_transfer_failure_probability() if args.run_mode == RunMode.PREFILL else 0.0),
    )


@dataclass
class ProcessConfigs:
    """The config of every process of one normal-mode server."""

    detokenization: DetokenizationConfig
    router: RouterConfig
    ranks: List[ModelRankConfig]
    http: HttpServerConfig


def overtake_bound_from_args(args: argparse.Namespace) -> OvertakeBoundSpec:
    """The prefill-queue overtaking bound the flags describe (checked by ``validate_args``)."""
    if args.disable_prefill_overtake_bound:
        return OvertakeBoundSpec.off()
    return OvertakeBoundSpec(args.prefill_max_overtake_tokens, float(args.prefill_overtake_fraction))


def overtake_bound_caveat(args: argparse.Namespace) -> Optional[str]:
    """A start-up warning where the flags void the overtaking bound for some requests, else None.

    Above ``--router_token_ratio 1`` admission overcommits the KV cache and a request can be paused
    for lack of it; the bound assumes the cache never stops the head, so a paused request is not
    covered, while the start-up line and ``/metrics`` still show the bound as on.
    """
    if (args.run_mode not in PREFILLING_MODES or args.disable_prefill_overtake_bound
            or args.router_token_ratio <= 1):
        return None
    return (f"--router_token_ratio {args.router_token_ratio:g} overcommits the KV cache: a request paused for lack "
            "of KV is not covered by the prefill overtaking bound (it holds for requests the cache never stops)")


def prefix_cache_enabled(args: argparse.Namespace, model_config: ModelConfig) -> bool:
    """Whether the ranks share computed prompt prefixes between requests.

    Off with ``--disable_dynamic_prompt_cache``, and for a length-dependent RoPE (dynamic NTK): a
    cached key was rotated for the length of the request that computed it, and another request
    of another length would read it wrongly.
    """
    return not args.disable_dynamic_prompt_cache and not model_config.rope.length_dependent


def build_process_configs(
    args: argparse.Namespace,
    sizing: ServerSizing,
    model_config: ModelConfig,
    layout: ServerLayout,
    *,
    nccl_port: int,
    sampling_seed: int,
    request_defaults: Optional[RequestDefaults] = None,
    transfer_ports: Optional[TransferPortBlock] = None,
) -> ProcessConfigs:
    """Every process's config from the validated flags, the sizing and the one layout.

    ``transfer_ports`` (a prefill node's held block) gives each rank its listening socket.
    """
    eos = resolve_eos_token_ids(args, model_config)
    detokenization_name, router_name, *rank_names = child_process_names(args.tp)
    run_mode = args.run_mode
    pd_settings = pd_rank_settings(args) if run_mode in PD_NODE_MODES else PdRankSettings()
    detokenization = DetokenizationConfig(
        model_dir=args.model_dir, tokenizer_mode=args.tokenizer_mode, layout=layout, log_level=args.log_level,
        process_name=detokenization_name, eos_token_ids=eos,
    )
    overtake_bound = overtake_bound_from_args(args)
    router = RouterConfig(
        layout=layout,
        running_max_req_size=args.running_max_req_size,
        router_token_ratio=args.router_token_ratio,
        router_max_wait_tokens=args.router_max_wait_tokens,
        schedule_time_interval=args.schedule_time_interval,
        log_level=args.log_level,
        process_name=router_name,
        prefill_overtake_bound=overtake_bound,
        run_mode=run_mode,
    )
    ranks = [
        ModelRankConfig(
            rank=rank, process_name=rank_names[rank], tp=args.tp, model_dir=args.model_dir, dtype=sizing.dtype_name,
            device=sizing.device,
            nccl_host=args.nccl_host, nccl_port=nccl_port, layout=layout,
            running_max_req_size=args.running_max_req_size, batch_max_tokens=sizing.batch_max_tokens,
            chunked_prefill_size=sizing.chunked_prefill_size,
            # Without chunking a prompt must fit one forward beside every decode row, so a long
            # one could wait for the decodes to drain: mixed batches need chunked prefill.
            mixed_batches=not (args.disable_mixed_batches or args.disable_chunked_prefill),
            prefill_queue_strategy=args.prefill_queue_strategy,
            attention_backend=args.attention_backend,
            linear_backend=args.linear_backend,
            prefill_overtake_bound=overtake_bound,
            use_prefix_cache=prefix_cache_enabled(args, model_config), eos_token_ids=eos,
            log_level=args.log_level, torch_threads=sizing.torch_threads,
            prefill_torch_threads=sizing.prefill_torch_threads,
            wide_forward_ms_per_token=sizing.wide_forward_ms_per_token,
            idle_malloc_trim_seconds=sizing.idle_malloc_trim_seconds,
            step_trace_path=sizing.step_trace_path,
            sampling_seed=sampling_seed, logprobs_mode=args.logprobs_mode, run_mode=run_mode,
            pd=pd_settings if transfer_ports is None else replace(
                pd_settings, listen_socket=transfer_ports.socket_for(rank)),
        )
        for rank in range(args.tp)
    ]
    http = HttpServerConfig(
        model_dir=args.model_dir,
        model_name=args.model_name[0] if args.model_name else Path(args.model_dir.rstrip("/")).name,
        served_model_names=list(args.model_name or []),
        tokenizer_mode=args.tokenizer_mode,
        layout=layout,
        vocab_size=model_config.vocab_size,
        eos_token_ids=eos,
        prefill_queue_strategy=args.prefill_queue_strategy,
        slot_wait_seconds=args.slot_wait_seconds,
        max_new_tokens_default=args.max_new_tokens_default,
        request_defaults=request_defaults or RequestDefaults(),
        prefix_cache=prefix_cache_enabled(args, model_config),
    )
    return ProcessConfigs(detokenization, router, ranks, http)
