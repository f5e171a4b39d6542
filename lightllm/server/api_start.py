"""Launching and supervising the server's processes (normal mode).

The main process owns the shared-memory segments and runs the HTTP server; it spawns the
detokenization process, the router and one model process per TP rank, waits until each reports
ready, and tears everything down (children, segments, socket files) on exit.  If a child dies
the server logs which one and exits non-zero.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Tuple

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
from lightllm.utils.process_utils import free_port

log = logging.getLogger("lightllm.api_start")

READY_TIMEOUT_SECONDS = 900.0


class StartupError(RuntimeError):
    """The server could not start; the message is one line for the user."""


@dataclass
class ServerProcesses:
    """The children and shared resources of a running server."""

    children: List[Tuple[str, mp.process.BaseProcess]] = field(default_factory=list)
    shm_req: Optional[ShmReqBuffer] = None
    shm_stats: Optional[ShmStats] = None
    ipc_dir: Optional[str] = None

    def shutdown(self) -> None:
        """Stop every child and remove every shared resource (idempotent)."""
        for _, proc in self.children:
            if proc.is_alive():
                proc.terminate()
        for _, proc in self.children:
            proc.join(timeout=10)
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
    tag = f"lightllm_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    procs.ipc_dir = tempfile.mkdtemp(prefix="lightllm-")
    address = {name: f"ipc://{procs.ipc_dir}/{name}.sock" for name in ("router", "rank0", "detok", "http")}
    slot_num = sizing.slot_num
    procs.shm_req = ShmReqBuffer(f"{tag}_req", slot_num, sizing.max_req_total_len, create=True)
    procs.shm_stats = ShmStats(f"{tag}_stats", create=True)
    eos = list(args.eos_id) if args.eos_id else list(model_config.eos_token_ids)
    # glibc would otherwise mmap and unmap every large activation tensor, paying page faults in
    # every forward; keeping large blocks in the heap made CPU prefill about 15% faster.
    # Children read these when they start, so they are set before spawning (user values win).
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        os.environ.setdefault(name, str(1 << 32))
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
    except BaseException:
        procs.shutdown()
        raise
    http_config = HttpServerConfig(
        model_dir=args.model_dir,
        model_name=args.model_name or Path(args.model_dir.rstrip("/")).name,
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
    """A thread that calls ``on_death(name, exitcode)`` when any child exits."""

    def run() -> None:
        import time

        while procs.children:
            for name, proc in list(procs.children):
                if not proc.is_alive():
                    on_death(name, proc.exitcode)
                    return
            time.sleep(0.5)

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
    except (ArgumentError, ModelConfigError, StartupError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info(
        "starting: model=%s device=%s dtype=%s tp=%d prefill_queue_strategy=%s kv_tokens=%d max_req_total_len=%d",
        args.model_dir, sizing.device, sizing.dtype_name, args.tp, args.prefill_queue_strategy,
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

    exit_code = 0
    try:
        manager = HttpServerManager(http_config)
        app = create_app(manager)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False))

        def on_death(name: str, code: Optional[int]) -> None:
            nonlocal exit_code
            log.error("child process %s exited unexpectedly (exit code %s); shutting down", name, code)
            exit_code = 1
            server.should_exit = True

        def on_signal(signum: int, frame: Any) -> None:
            # uvicorn replays the signal that stopped it once it returns; landing here instead of
            # the default action lets the cleanup below run.
            server.should_exit = True

        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, on_signal)
        watch_children(procs, on_death)
        log.info("serving on http://%s:%d (prefill_queue_strategy=%s)", args.host, args.port, args.prefill_queue_strategy)
        server.run()
        if not server.started and exit_code == 0:
            exit_code = 1
    finally:
        procs.shutdown()
    return exit_code
