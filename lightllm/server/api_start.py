"""Launching and supervising the server's processes (normal mode).

The main process owns the shared-memory segments and runs the HTTP server; it spawns the
detokenization process, the router and one model process per TP rank, waits until each reports
ready, and tears everything down (children, segments, socket files) on exit.  If a child dies
every request fails with an error and the server exits non-zero; SIGTERM drains (see
:mod:`lightllm.server.supervisor`).  Resources left by a killed server are removed at start.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Tuple

from lightllm.common.basemodel.attention.selection import resolve_attention_backend
from lightllm.common.basemodel.model_config import ModelConfig, ModelConfigError
from lightllm.server.api_cli import ArgumentError, make_argument_parser, validate_args
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.core.objs.shm_stats import ShmStats
from lightllm.server.detokenization.manager import DetokenizationConfig, detokenization_process_main
from lightllm.server.httpserver.manager import HttpServerConfig
from lightllm.server.router.manager import RouterConfig, router_process_main
from lightllm.server.router.model_infer.model_rank_process import ModelRankConfig, model_rank_process_main
from lightllm.server.server_sizing import ServerSizing, plan_sizing
from lightllm.utils.log_utils import init_logging
from lightllm.utils.malloc_tuning import apply_child_malloc_env
from lightllm.utils.process_utils import free_port
from lightllm.utils.stale_resources import ipc_dir_prefix, remove_stale_resources, shm_segment_prefix

log = logging.getLogger("lightllm.api_start")

READY_TIMEOUT_SECONDS = 900.0
# How long children get to exit after SIGTERM before they are killed.
CHILD_STOP_SECONDS = 2.0


class StartupError(RuntimeError):
    """The server could not start; the message is one line for the user."""


@dataclass
class ServerProcesses:
    """The children and shared resources of a running server."""

    children: List[Tuple[str, mp.process.BaseProcess]] = field(default_factory=list)
    shm_req: Optional[ShmReqBuffer] = None
    shm_stats: Optional[ShmStats] = None
    ipc_dir: Optional[str] = None
    # Set before children are stopped on purpose, so their exits are not reported as failures.
    stopping: threading.Event = field(default_factory=threading.Event)

    def shutdown(self) -> None:
        """Stop every child and remove every shared resource (idempotent)."""
        self.stopping.set()
        if self.children:
            log.info("stopping child processes")
        for _, proc in self.children:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + CHILD_STOP_SECONDS
        for _, proc in self.children:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for _, proc in self.children:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.children.clear()
        for segment in (self.shm_req, self.shm_stats):
            if segment is not None:
                segment.close()
                segment.unlink()
        self.shm_req = self.shm_stats = None
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None
            log.info("children stopped; shared memory and IPC folder removed")


def resolve_device(args: argparse.Namespace) -> str:
    """``cpu`` or ``cuda`` from ``--device`` and what is available."""
    import torch

    if args.device == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if args.device == "cuda":
        raise StartupError("--device cuda was given but no CUDA device is visible")
    return "cpu"


def start_processes(args: argparse.Namespace, sizing: ServerSizing, model_config: ModelConfig) -> Tuple[ServerProcesses, HttpServerConfig]:
    """Create shared memory, spawn and wait for every child; returns the HTTP side's config."""
    procs = ServerProcesses()
    remove_stale_resources()
    # Both names carry this process's pid so a later server can tell when their owner is gone.
    tag = f"{shm_segment_prefix()}{uuid.uuid4().hex[:8]}"
    procs.ipc_dir = tempfile.mkdtemp(prefix=ipc_dir_prefix())
    address = {name: f"ipc://{procs.ipc_dir}/{name}.sock" for name in ("router", "rank0", "detok", "http")}
    slot_num = sizing.slot_num
    procs.shm_req = ShmReqBuffer(f"{tag}_req", slot_num, sizing.max_req_total_len, create=True)
    procs.shm_stats = ShmStats(f"{tag}_stats", create=True)
    eos = list(args.eos_id) if args.eos_id else list(model_config.eos_token_ids)
    # Large activations stay in the heap (no page faults per forward) but a rare peak is given
    # back; lightllm/utils/malloc_tuning.py has the numbers. Children read these at start, so
    # they are set before spawning (user values win).
    apply_child_malloc_env(os.environ)
    ctx = mp.get_context("spawn")
    try:
        pending = []

        def spawn(name: str, target: Any, config: Any) -> None:
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=target, args=(config, child_conn), name=name, daemon=False)
            proc.start()
            procs.children.append((name, proc))
            pending.append((name, proc, parent_conn))

        spawn(
            "detokenization",
            detokenization_process_main,
            DetokenizationConfig(
                model_dir=args.model_dir, tokenizer_mode=args.tokenizer_mode, detokenization_address=address["detok"],
                http_address=address["http"], router_address=address["router"], shm_req_name=procs.shm_req.name,
                slot_num=slot_num, max_req_total_len=sizing.max_req_total_len, log_level=args.log_level,
            ),
        )
        spawn(
            "router",
            router_process_main,
            RouterConfig(
                router_address=address["router"], model_rank0_address=address["rank0"],
                detokenization_address=address["detok"], shm_req_name=procs.shm_req.name,
                shm_stats_name=procs.shm_stats.name, slot_num=slot_num, max_req_total_len=sizing.max_req_total_len,
                max_total_token_num=sizing.max_total_token_num, running_max_req_size=args.running_max_req_size,
                router_token_ratio=args.router_token_ratio, router_max_wait_tokens=args.router_max_wait_tokens,
                schedule_time_interval=args.schedule_time_interval, log_level=args.log_level,
                prefill_max_wait_tokens=args.prefill_max_wait_tokens,
            ),
        )
        nccl_port = args.nccl_port or free_port(args.nccl_host)
        for rank in range(args.tp):
            spawn(
                f"model_rank{rank}",
                model_rank_process_main,
                ModelRankConfig(
                    rank=rank, tp=args.tp, model_dir=args.model_dir, dtype=sizing.dtype_name, device=sizing.device,
                    nccl_host=args.nccl_host, nccl_port=nccl_port, model_rank0_address=address["rank0"],
                    router_address=address["router"], detokenization_address=address["detok"],
                    shm_req_name=procs.shm_req.name, shm_stats_name=procs.shm_stats.name, slot_num=slot_num,
                    max_req_total_len=sizing.max_req_total_len, max_total_token_num=sizing.max_total_token_num,
                    running_max_req_size=args.running_max_req_size, batch_max_tokens=sizing.batch_max_tokens,
                    chunked_prefill_size=None if args.disable_chunked_prefill else args.chunked_prefill_size,
                    prefill_queue_strategy=args.prefill_queue_strategy,
                    attention_backend=args.attention_backend,
                    prefill_max_wait_tokens=args.prefill_max_wait_tokens,
                    use_prefix_cache=not args.disable_dynamic_prompt_cache, eos_token_ids=eos,
                    log_level=args.log_level, torch_threads=sizing.torch_threads,
                ),
            )
        for name, proc, conn in pending:
            if not conn.poll(READY_TIMEOUT_SECONDS):
                raise StartupError(f"{name} did not report ready within {READY_TIMEOUT_SECONDS:.0f}s")
            try:
                kind, detail = conn.recv()
            except EOFError:
                raise StartupError(f"{name} exited during start-up (exit code {proc.exitcode})") from None
            if kind != "ready":
                raise StartupError(detail)
        log.info("children ready: %s", ", ".join(f"{name} pid={proc.pid}" for name, proc in procs.children))
    except BaseException:
        procs.shutdown()
        raise
    http_config = HttpServerConfig(
        model_dir=args.model_dir,
        model_name=args.model_name[0] if args.model_name else Path(args.model_dir.rstrip("/")).name,
        served_model_names=list(args.model_name or []),
        tokenizer_mode=args.tokenizer_mode,
        router_address=address["router"],
        http_address=address["http"],
        shm_req_name=procs.shm_req.name,
        shm_stats_name=procs.shm_stats.name,
        slot_num=slot_num,
        max_req_total_len=sizing.max_req_total_len,
        vocab_size=model_config.vocab_size,
        eos_token_ids=eos,
        prefill_queue_strategy=args.prefill_queue_strategy,
        max_new_tokens_default=args.max_new_tokens_default,
    )
    return procs, http_config


def watch_children(procs: ServerProcesses, on_death: Any) -> threading.Thread:
    """A thread that calls ``on_death(name, exitcode)`` as soon as any child exits on its own."""

    def run() -> None:
        children = list(procs.children)
        while not procs.stopping.is_set():
            # A process's sentinel becomes readable the moment it exits; the timeout only bounds
            # how late a shutdown in progress is noticed.
            multiprocessing.connection.wait([proc.sentinel for _, proc in children], timeout=0.2)
            if procs.stopping.is_set():
                return
            for name, proc in children:
                if not proc.is_alive():
                    on_death(name, proc.exitcode)
                    return

    thread = threading.Thread(target=run, name="child-watch", daemon=True)
    thread.start()
    return thread


def run_server(argv: Optional[List[str]] = None) -> int:
    """Parse arguments, start everything, serve HTTP until stopped; returns the exit code."""
    parser = make_argument_parser()
    args = parser.parse_args(argv)
    init_logging(args.log_level)
    try:
        import torch

        validate_args(args, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        model_config = ModelConfig.from_dir(args.model_dir)
        sizing = plan_sizing(args, model_config, resolve_device(args))
        args.attention_backend = resolve_attention_backend(args.attention_backend, sizing.device)
    except (ArgumentError, ModelConfigError, StartupError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info(
        "starting: model=%s device=%s dtype=%s tp=%d prefill_queue_strategy=%s prefill_max_wait_tokens=%s "
        "kv_tokens=%d max_req_total_len=%d",
        args.model_dir, sizing.device, sizing.dtype_name, args.tp, args.prefill_queue_strategy,
        args.prefill_max_wait_tokens or "0 (waiting bound disabled)",
        sizing.max_total_token_num, sizing.max_req_total_len,
    )
    def stop_during_startup(signum: int, frame: Any) -> None:
        # Raising here unwinds start_processes, whose cleanup stops children and unlinks memory.
        raise StartupError(f"interrupted by signal {signum} during start-up")

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop_during_startup)
    try:
        procs, http_config = start_processes(args, sizing, model_config)
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    import uvicorn

    from lightllm.server.api_http import create_app
    from lightllm.server.httpserver.manager import HttpServerManager
    from lightllm.server.http_server_options import HttpServerOptions, build_uvicorn_config
    from lightllm.server.supervisor import Supervisor, SupervisedServer

    exit_code = 0
    server: Optional[uvicorn.Server] = None
    stop_requested = False

    def on_signal(signum: int, frame: Any) -> None:
        # Outside uvicorn's run: before it starts, and when uvicorn replays the signal that
        # stopped it once it returns; landing here instead of the default action lets the
        # cleanup below run.
        nonlocal stop_requested
        stop_requested = True
        if server is not None:
            server.should_exit = True

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    try:
        manager = HttpServerManager(http_config)
        http_options = HttpServerOptions.from_args(args)
        app = create_app(manager, http_options)
        supervisor = Supervisor(manager, args.graceful_shutdown_seconds)
        server = SupervisedServer(build_uvicorn_config(app, args, http_options), supervisor)
        watch_children(procs, supervisor.child_died)
        if not stop_requested:
            log.info("serving on http://%s:%d (prefill_queue_strategy=%s)", args.host, args.port, args.prefill_queue_strategy)
            server.run()
        exit_code = supervisor.exit_code
        if not server.started and exit_code == 0 and not stop_requested:
            exit_code = 1
    finally:
        procs.shutdown()
    return exit_code
