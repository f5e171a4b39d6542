"""A 1P1D PD cluster (PD master + prefill node + decode node) as one benchmark deployment.

:class:`PdTopology` (``--topology 1p1d`` of ``compare_strategies``) starts, per
:class:`~lightllm.benchmark.server_launcher.ServerSpec`, three
``python -m lightllm.server.api_server`` processes on this host:

* the master (``--run_mode pd_master``) with ``--model_dir`` and the topology's ``master_args``;
* the prefill node (``--run_mode prefill``) with the spec's strategy and extra flags: the
  prefill-queue strategy runs where prompts wait for prefill;
* the decode node (``--run_mode decode``) with the spec's extra flags (the same KV capacity,
  TP size and dtype as the prefill node, which the master requires), without the strategy.

All three start at once (the nodes retry their registration until the master answers); the
cluster serves once the master's ``/health`` answers 200, i.e. both nodes registered. Clients
talk to the master only, so the benchmark measures a 1P1D cluster exactly as a normal server.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from lightllm.benchmark.server_launcher import Deployment, ServerProcess, ServerSpec, Topology, safe_label
from lightllm.utils.process_utils import free_port

# Flags the cluster launcher sets itself on the nodes (besides ServerSpec's reserved ones).
PD_RESERVED_FLAGS: tuple[str, ...] = ("--pd_master_ip", "--pd_master_port")
ROLES: tuple[str, ...] = ("master", "prefill", "decode")


def _check_flags(args: Sequence[str], where: str) -> None:
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in PD_RESERVED_FLAGS or flag in ("--run_mode", "--model_dir", "--host", "--port"):
            raise ValueError(f"{where} must not set {flag}: the 1p1d launcher sets it (got {list(args)})")


def cluster_commands(spec: ServerSpec, master_args: Sequence[str], host: str, master_port: int) -> dict[str, list[str]]:
    """Server flags (without ``--host``/``--port``) of the master, prefill and decode processes.

    Raises:
        ValueError: ``spec.extra_args`` or ``master_args`` set a flag the launcher owns.
    """
    _check_flags(spec.extra_args, "extra_args")
    _check_flags(master_args, "master_args")
    membership = ["--pd_master_ip", host, "--pd_master_port", str(master_port)]
    return {
        "master": ["--run_mode", "pd_master", "--model_dir", str(spec.model_dir), *master_args],
        "prefill": ["--run_mode", "prefill", *spec.server_args(), *membership],
        "decode": ["--run_mode", "decode", "--model_dir", str(spec.model_dir), *spec.extra_args, *membership],
    }


class PdCluster(Deployment):
    """A running master, prefill node and decode node; clients use the master's URL."""

    def __init__(self, processes: dict[str, ServerProcess]) -> None:
        missing = [role for role in ROLES if role not in processes]
        if missing:
            raise ValueError(f"processes must hold {list(ROLES)}, missing {missing}")
        self.processes = dict(processes)

    @property
    def base_url(self) -> str:
        return self.processes["master"].base_url

    @property
    def log_paths(self) -> list[Path]:
        return [self.processes[role].log_paths[0] for role in ROLES]

    def is_alive(self) -> bool:
        return all(process.is_alive() for process in self.processes.values())

    def stop(self, timeout_s: float = 60.0) -> None:
        # Nodes first, so the master never reports them dropped while it still serves; each
        # stop() is SIGTERM, a bounded wait, then SIGKILL of its process group.
        for role in ("decode", "prefill", "master"):
            self.processes[role].stop(timeout_s)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "pid": self.processes["master"].pid,
            "command": self.processes["prefill"].command,
            "processes": {role: self.processes[role].describe() for role in ROLES},
        }


class PdTopology(Topology):
    """One 1P1D cluster per spec on this host (see the module docstring).

    Args:
        host: listen address of all three processes.
        start_timeout_s: bound on the start-up, until the master's ``/health`` answers 200.
        master_args: extra flags of the master (e.g. ``--pd_prefill_timeout_seconds 60``).
        prefill_devices / decode_devices: ``CUDA_VISIBLE_DEVICES`` of each node on GPUs.
    """

    name = "1p1d"

    def __init__(
        self,
        host: str = "127.0.0.1",
        start_timeout_s: float = 300.0,
        master_args: Sequence[str] = (),
        prefill_devices: str | None = None,
        decode_devices: str | None = None,
    ) -> None:
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be > 0, got {start_timeout_s}")
        self.host = host
        self.start_timeout_s = start_timeout_s
        self.master_args = tuple(str(a) for a in master_args)
        _check_flags(self.master_args, "master_args")
        self.devices = {"prefill": prefill_devices, "decode": decode_devices}

    def _env(self, role: str) -> dict[str, str] | None:
        devices = self.devices.get(role)
        if devices is not None:
            return {"CUDA_VISIBLE_DEVICES": devices}
        if "LIGHTLLM_TORCH_THREADS" in os.environ:
            return None
        # On CPU both nodes share this machine's cores, so neither may borrow the front end's
        # core for prefill (forward_threads.py): one thread count for every forward, the
        # standing (cores - 1) of a node that had the machine to itself.
        return {"LIGHTLLM_TORCH_THREADS": str(max(1, (os.cpu_count() or 1) - 1))}

    def launch(self, spec: ServerSpec, log_dir: Path) -> PdCluster:
        master_port = free_port(self.host)
        commands = cluster_commands(spec, self.master_args, self.host, master_port)
        label = safe_label(spec.strategy)
        logs = {role: Path(log_dir) / f"server_{label}_{role}.log" for role in ROLES}
        started: dict[str, ServerProcess] = {}
        deadline = time.monotonic() + self.start_timeout_s
        try:
            # The master is not waited for here: the nodes retry their registration until it
            # answers, so its start-up overlaps theirs.
            started["master"] = ServerProcess.start(
                commands["master"], logs["master"], host=self.host, port=master_port,
                start_timeout_s=self.start_timeout_s, ready=lambda _url: True,
            )
            # Both nodes load at once; each is up when its own /health answers 200.
            with ThreadPoolExecutor(max_workers=2, thread_name_prefix="pd-node") as pool:
                futures = {
                    role: pool.submit(
                        ServerProcess.start, commands[role], logs[role], host=self.host,
                        start_timeout_s=self.start_timeout_s, env=self._env(role),
                    )
                    for role in ("prefill", "decode")
                }
            errors = []
            for role, future in futures.items():
                if future.exception() is None:
                    started[role] = future.result()
                else:
                    errors.append(future.exception())
            if errors:
                raise errors[0]
            # Serving only once the master counts both nodes alive (its /health turns 200).
            started["master"].wait_ready(max(deadline - time.monotonic(), 1.0))
        except BaseException:
            for role in ("decode", "prefill", "master"):
                if role in started:
                    started[role].stop()
            raise
        return PdCluster(started)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "host": self.host,
            "start_timeout_s": self.start_timeout_s,
            "master_args": list(self.master_args),
            "prefill_devices": self.devices["prefill"],
            "decode_devices": self.devices["decode"],
        }

