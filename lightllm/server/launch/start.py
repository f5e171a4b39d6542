"""Launching and supervising the server's processes (normal mode).

The main process owns the shared-memory segments and runs the HTTP server; it builds the one
:class:`~lightllm.server.server_layout.ServerLayout` and every process config
(:mod:`lightllm.server.launch.plan`), spawns the detokenization process, the router and one
model process per TP rank, waits until each reports ready, and tears everything down (children,
segments, socket files) on exit (:mod:`lightllm.server.launch.server_processes`).  If a child dies,
or makes no progress for ``--watchdog_timeout`` seconds (:mod:`lightllm.server.launch.watchdog`),
every request fails with an error and the server exits non-zero; SIGTERM drains (see
:mod:`lightllm.server.launch.supervisor`).  Resources left by a killed server are removed at start.
A PD prefill or decode node (``--run_mode prefill|decode``) starts the same tree plus its PD
service around the HTTP manager, its control endpoints and master registration
(:mod:`lightllm.server.launch.pd_node`).

This process imports no torch, and neither does anything it spawns but the model ranks
(test/unit/launch/test_torch_free_processes.py keeps it so): CUDA facts come from a short-lived probe
child (:mod:`lightllm.server.launch.device_probe`), dtypes are names, and each rank resolves its
attention and linear backends itself, where torch is loaded anyway; a rank that refuses an
explicit backend reports it here, and the start ends in one line with exit code 2 as for any
other impossible flag.
"""

from __future__ import annotations

import argparse
import functools
import logging
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from lightllm.common.basemodel.attention.selection import attention_device_problem
from lightllm.common.basemodel.model_config import ModelConfig, ModelConfigError
from lightllm.server.argument_error import ArgumentError
from lightllm.server.request_defaults import RequestDefaults
from lightllm.server.launch.environment_check import (
    check_environment_values,
    cpu_only_variable_warnings,
    unread_variable_warnings,
)
from lightllm.server.launch.args_check import resolve_args, validate_args, validate_device_args
from lightllm.server.launch.device_probe import DeviceFacts, DeviceProbeError, read_device_facts
from lightllm.server.launch.arg_parser import parse_server_args
from lightllm.server.detokenization.manager import detokenization_process_main
from lightllm.server.httpserver.manager import HttpServerConfig
from lightllm.server.http.transport.listen_sockets import PortUnavailableError, display_address, is_loopback
from lightllm.server.launch.exit_codes import EXIT_FAILED, EXIT_INVALID_CONFIG, EXIT_PORT_UNAVAILABLE, EXIT_STOPPED
from lightllm.server.launch.plan import (
    build_process_configs,
    check_ipc_path_room,
    child_process_names,
    overtake_bound_caveat,
    overtake_bound_from_args,
    plan_layout,
    resolve_sampling_seed,
)
from lightllm.server.pd.node.transfer_ports import TransferPortBlock
from lightllm.server.router.manager import router_process_main
from lightllm.server.launch.child_entry import model_rank_entry, torch_free_entry
from lightllm.server.launch.child_readiness import StartingChild, StartupError, wait_for_children_ready
from lightllm.server.launch.shm_capacity import check_shm_capacity, describe_shm_use, shm_free_bytes
from lightllm.server.launch.checkpoint_checks import (check_args_against_checkpoint, check_attention_backend_fits,
                                                     check_linear_backend_fits, generation_default_beyond_context)
from lightllm.server.launch.checkpoint_reading import check_weight_files, log_checkpoint_limits, read_checkpoint
from lightllm.server.launch.nccl_rendezvous import check_nccl_rendezvous
from lightllm.server.launch.child_watch import watch_children
from lightllm.server.launch.server_processes import ServerProcesses
from lightllm.server.launch.sizing import ServerSizing, plan_sizing
from lightllm.utils.log_utils import init_logging
from lightllm.utils.malloc_tuning import apply_child_malloc_env
from lightllm.utils.process_utils import start_resource_tracker_deaf_to_hangup
from lightllm.utils.free_ports import free_port
from lightllm.utils.owner_locks import SHM_DIR, claim_shm_tag, create_ipc_dir, ipc_dir_prefix, ipc_temp_dir
from lightllm.utils.stale_resources import remove_stale_resources
from lightllm.server.run_mode import PD_NODE_MODES, RunMode, prefill_queue_description

if TYPE_CHECKING:
    from lightllm.server.http.transport.front_door import FrontDoor
    from lightllm.server.http.server_options import AuthPolicy
    from lightllm.server.pd.protocol.node_info import NodeInfo

log = logging.getLogger(__name__)

READY_TIMEOUT_SECONDS = 900.0
def resolve_device(args: argparse.Namespace, facts: DeviceFacts) -> str:
    """``cpu`` or ``cuda`` from ``--device`` and what is available (``facts``: see :mod:`.device_probe`)."""
    if args.device == "cpu":
        return "cpu"
    if facts.cuda_available:
        return "cuda"
    if args.device == "cuda":
        raise StartupError("--device cuda was given but no CUDA device is visible")
    return "cpu"


def claim_server_resources(procs: ServerProcesses) -> None:
    """Create the segments' owner lock and the IPC folder (with its lock) into ``procs``.

    Each group's owner lock is created and held before the group itself, so a later server removes
    it only once this process is gone, whatever its PID namespace (utils/owner_locks.py;
    run_server removed dead owners' leftovers before this process's first child).  A directory that
    cannot take them (missing, read-only, full) is a :class:`StartupError` in one line; what was
    claimed before stays in ``procs`` for its shutdown.
    """
    try:
        procs.shm_owner = claim_shm_tag()
    except OSError as exc:
        raise StartupError(f"cannot create the server's shared-memory owner lock in {SHM_DIR}: "
                           f"{exc.strerror or exc}") from exc
    temp_dir = tempfile.gettempdir()
    try:
        procs.ipc_dir, procs.ipc_owner = create_ipc_dir(temp_dir)
    except OSError as exc:
        raise StartupError(f"cannot create the server's IPC folder in {temp_dir} (the temporary directory, TMPDIR): "
                           f"{exc.strerror or exc}; set TMPDIR to a writable directory with free space") from exc


def start_processes(
    args: argparse.Namespace,
    sizing: ServerSizing,
    model_config: ModelConfig,
    transfer_ports: Optional[TransferPortBlock] = None,
    request_defaults: Optional[RequestDefaults] = None,
) -> Tuple[ServerProcesses, HttpServerConfig]:
    """Create shared memory, spawn and wait for every child; returns the HTTP side's config.

    ``transfer_ports``: a prefill node's held KV transfer ports (each rank gets its socket).
    """
    if threading.current_thread() is not threading.main_thread():
        # Each child asks the kernel for SIGKILL when the thread that started it exits
        # (utils/process_utils.py run_child): only the main thread lives as long as the launcher.
        raise RuntimeError("the server's children are started from the launcher's main thread")
    procs = ServerProcesses()
    try:
        claim_server_resources(procs)
        layout = plan_layout(sizing, procs.shm_owner.name, procs.ipc_dir,
                             child_process_names(args.tp) if args.watchdog_timeout > 0 else ())
        log.info("%s", describe_shm_use(layout))
        # After the stale segments are gone (their space is free again), before ours exist.
        check_shm_capacity(layout, shm_free_bytes())
        procs.shm_req = layout.open_requests(create=True)
        procs.shm_stats = layout.open_stats(create=True)
        procs.shm_heartbeats = layout.open_heartbeats(create=True)
        procs.heartbeat_processes = layout.heartbeat_processes
        sampling_seed = resolve_sampling_seed(args)
        if args.sampling_seed is None:
            log.info("sampling seed %d drawn at start (pass --sampling_seed %d to repeat this start's sampling)",
                     sampling_seed, sampling_seed)
        else:
            log.info("sampling seed %d (--sampling_seed)", sampling_seed)
        configs = build_process_configs(
            args, sizing, model_config, layout, request_defaults=request_defaults,
            nccl_port=args.nccl_port or free_port(args.nccl_host), sampling_seed=sampling_seed,
            transfer_ports=transfer_ports,
        )
        # Large activations stay in the heap (no page faults per forward) but a rare peak is given
        # back; lightllm/utils/malloc_tuning.py has the numbers. Children read these at start, so
        # they are set before spawning (user values win).
        apply_child_malloc_env(os.environ)
        # spawn: each child is the launcher's own (a fork and exec), which its parent-death signal relies on.
        ctx = mp.get_context("spawn")
    except BaseException:
        # No child yet: what was claimed goes now. A held lock would otherwise stay until this
        # process exits (a caller may go on), and the tracker would report it as leaked.
        procs.shutdown()
        raise
    try:
        pending: List[StartingChild] = []

        def spawn(target: Any, config: Any) -> None:
            name = config.process_name  # launch/plan.py child_process_names, as the layout's heartbeat fields
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=target, args=(config, child_conn), name=name, daemon=False)
            proc.start()
            procs.children.append((name, proc))
            pending.append(StartingChild(name, proc, parent_conn))

        # Only the ranks load torch (docs/EN/architecture.md, "Which process loads torch").
        spawn(functools.partial(torch_free_entry, detokenization_process_main), configs.detokenization)
        spawn(functools.partial(torch_free_entry, router_process_main), configs.router)
        for rank_config in configs.ranks:
            spawn(model_rank_entry, rank_config)
        wait_for_children_ready(pending, READY_TIMEOUT_SECONDS)
        log.info("children ready: %s", ", ".join(f"{name} pid={proc.pid}" for name, proc in procs.children))
    except BaseException:
        procs.shutdown()
        raise
    return procs, configs.http


def warn_if_reachable_without_key(args: argparse.Namespace, auth: "AuthPolicy") -> None:
    """One warning line when the server listens beyond loopback and no key guards what it serves."""
    if is_loopback(args.host):
        return
    where = display_address(args.host, args.port)
    if args.run_mode in PD_NODE_MODES:
        # A node refuses the public API; its /pd/ endpoints are what the cluster key guards.
        if auth.cluster_key is None:
            log.warning("listening on %s (beyond loopback) without a PD cluster key: anyone who can reach this port "
                        "can call the node's /pd/ endpoints; set LIGHTLLM_PD_CLUSTER_KEY or --pd_cluster_key", where)
    elif not auth.requires_key:
        log.warning("listening on %s (beyond loopback) without an API key: anyone who can reach this port can use "
                    "the API; set --api_key or LIGHTLLM_API_KEY (docs/EN/limits_and_auth.md)", where)


def run_server(argv: Optional[List[str]] = None) -> int:
    """Parse arguments, start everything, serve HTTP until stopped; returns the exit code.

    Run it in a process that called :func:`lightllm.utils.torch_free.keep_torch_out` first
    (``python -m lightllm.server.api_server`` does): it serves HTTP for the server's life.

    Exit codes: :mod:`lightllm.server.launch.exit_codes` (``EXIT_*``) and docs/*/failure_handling.md.
    """
    args = parse_server_args(argv)
    init_logging(args.log_level)
    try:
        # The GPU count is checked once the device probe answered (_prepare_and_serve).
        validate_args(args)
        resolve_args(args)
        # The LIGHTLLM_* variables this role reads: a bad one is a one-line exit 2, not failed requests.
        check_environment_values(args.run_mode)
        for line in unread_variable_warnings(args):
            log.warning("%s", line)
        from lightllm.server.http.transport.front_door import open_front_door
        from lightllm.server.http.server_options import AuthPolicy

        auth = AuthPolicy.from_args(args)
        auth.check_cluster(args.run_mode)
        for line in auth.key_warnings():
            log.warning("%s", line)
        if args.run_mode != RunMode.PD_MASTER:  # the master runs no model ranks (and refuses the nccl flags)
            check_nccl_rendezvous(args)
            # Python falls back from an unusable TMPDIR without a word: said here, before anything loads.
            check_ipc_path_room(ipc_temp_dir(), ipc_dir_prefix())
        # Before anything loads: a taken port is a one-line error within a second, not after the model.
        front_door = open_front_door(args)
    except PortUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_PORT_UNAVAILABLE
    except (ArgumentError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID_CONFIG
    warn_if_reachable_without_key(args, auth)
    if args.run_mode != RunMode.PD_MASTER:  # the master keeps no shared memory
        # Before this process's first child (the tracker, the device probe): a group's owner lock
        # decides, but an older server's group (no lock file) is judged by its pid, and in a fresh
        # container a child could otherwise take the dead server's pid.
        remove_stale_resources()
        start_resource_tracker_deaf_to_hangup()
    try:
        return _prepare_and_serve(args, front_door)
    finally:
        front_door.close()


def _prepare_and_serve(args: argparse.Namespace, front_door: "FrontDoor") -> int:
    """Read the model's config, plan, bind the PD ports, then start and serve; returns the exit code."""
    pd_node_info = transfer_ports = None
    try:
        if args.run_mode == RunMode.PD_MASTER:
            # One process, no children, no shared memory, no weights.
            from lightllm.server.launch.pd_master import run_pd_master

            return run_pd_master(args, front_door)
        model_config, request_defaults = read_checkpoint(args)
        facts = read_device_facts(args.device)
        if facts.probed:
            log.info("device probe: %d CUDA device(s) visible%s", facts.cuda_device_count,
                     f", {facts.cuda_free_bytes / (1 << 30):.2f} GiB free on the first" if facts.cuda_free_bytes else "")
        validate_device_args(args, facts.cuda_device_count)
        # The attention and linear backends are resolved by each rank (see the module docstring).
        device = resolve_device(args, facts)
        backend_problem = attention_device_problem(args.attention_backend, device)
        if backend_problem is not None:
            # Refused before any child starts (the rank would refuse it seconds later, after its start-up).
            raise ArgumentError(backend_problem)
        for line in cpu_only_variable_warnings(args.run_mode, device):
            log.warning("%s", line)
        sizing = plan_sizing(args, model_config, device, facts.cuda_free_bytes)
        check_args_against_checkpoint(args, model_config, sizing.max_req_total_len)
        check_attention_backend_fits(args, model_config, sizing.dtype_name)
        check_linear_backend_fits(args, device, sizing.dtype_name)
        beyond = generation_default_beyond_context(request_defaults, args.max_new_tokens_default,
                                                   sizing.max_req_total_len)
        if beyond is not None:
            log.warning("%s", beyond)
        # The ranks read these files after the shared memory and every process exist: a
        # directory they cannot load is refused now, in one line (after the flags: a flag the
        # checkpoint's config refuses is the user's first mistake to hear of).
        check_weight_files(args)
        log_checkpoint_limits(args, model_config, sizing)
        if args.run_mode in PD_NODE_MODES:
            # Imported here, like the HTTP modules below: only a PD node needs it.
            from lightllm.server.launch.pd_node import prepare_pd_node

            # Before any process starts: the ranks and the registration must see one transfer port.
            pd_node_info, transfer_ports = prepare_pd_node(args, model_config, sizing)
    except PortUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_PORT_UNAVAILABLE
    except DeviceProbeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (ArgumentError, ModelConfigError, StartupError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID_CONFIG
    try:
        return _start_and_serve(args, sizing, model_config, request_defaults, pd_node_info, transfer_ports, front_door)
    finally:
        if transfer_ports is not None:
            transfer_ports.close()


def _start_and_serve(
    args: argparse.Namespace,
    sizing: ServerSizing,
    model_config: ModelConfig,
    request_defaults: RequestDefaults,
    pd_node_info: Optional["NodeInfo"],
    transfer_ports: Optional[TransferPortBlock],
    front_door: "FrontDoor",
) -> int:
    """Start every process and serve HTTP until stopped; returns the exit code."""
    log.info(
        "starting: model=%s device=%s dtype=%s tp=%d %s kv_tokens=%d max_req_total_len=%d",
        args.model_dir, sizing.device, sizing.dtype_name, args.tp,
        prefill_queue_description(args.run_mode, args.prefill_queue_strategy, overtake_bound_from_args(args).describe()),
        sizing.max_total_token_num, sizing.max_req_total_len,
    )
    caveat = overtake_bound_caveat(args)
    if caveat is not None:
        log.warning("%s", caveat)

    def stop_during_startup(signum: int, frame: Any) -> None:
        # Raising here unwinds start_processes, whose cleanup stops children and unlinks memory.
        raise StartupError(f"interrupted by signal {signum} during start-up")

    previous = {signum: signal.signal(signum, stop_during_startup) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        procs, http_config = start_processes(args, sizing, model_config, transfer_ports, request_defaults)
    except (ArgumentError, StartupError) as exc:
        # Nothing runs now: a caller that goes on in this process gets its own handlers back.
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID_CONFIG if isinstance(exc, ArgumentError) else EXIT_FAILED
    from lightllm.server.http.app import create_app
    from lightllm.server.httpserver.manager import HttpServerManager
    from lightllm.server.http.server_options import HttpServerOptions
    from lightllm.server.http.transport.uvicorn_config import build_uvicorn_config
    from lightllm.server.launch.supervisor import StopOutsideServing, Supervisor, SupervisedServer, run_uvicorn

    exit_code = EXIT_STOPPED
    stop = StopOutsideServing()
    try:
        manager = HttpServerManager.from_config(http_config)
        http_options = HttpServerOptions.from_args(args)
        pd_node = None
        if pd_node_info is not None:
            from lightllm.server.launch.pd_node import PdNodeRuntime

            pd_node = PdNodeRuntime(args, pd_node_info, manager, http_config.layout.model_rank0_address,
                                    http_options.auth.cluster_key)
        app = create_app(manager, http_options, pd_node.routers() if pd_node is not None else ())
        supervisor = Supervisor(manager, args.graceful_shutdown_seconds, app.state.preparing)
        server = stop.server = SupervisedServer(build_uvicorn_config(app, args, http_options), supervisor,
                                                front_door=front_door)
        if pd_node is not None:
            pd_node.attach(app, server, supervisor)
        procs.watcher = watch_children(procs.children, procs.stopping, supervisor.child_died,
                                       watchdog=procs.watchdog(args.watchdog_timeout),
                                       on_stall=supervisor.children_stalled)
        if not stop.requested:
            log.info("serving on http://%s (%s)", display_address(args.host, args.port),
                     prefill_queue_description(args.run_mode, args.prefill_queue_strategy,
                                               overtake_bound_from_args(args).describe()))
            run_uvicorn(server)
        exit_code = stop.exit_code(supervisor)
    finally:
        procs.shutdown()
    interruption = stop.startup_interruption()
    if interruption is not None:
        print(f"error: {interruption}", file=sys.stderr)
    return exit_code
