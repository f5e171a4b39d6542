"""Starting a real 1P1D cluster (PD master, prefill node, decode node) on loopback for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import httpx

from lightllm.utils.free_ports import free_port
from server_process import ServerHandle

START_TIMEOUT_SECONDS = 180


def launch(model_dir: Path, log_dir: Path, name: str, args: List[str], env: Optional[Dict[str, str]] = None,
           port: Optional[int] = None, own_process_group: bool = False) -> ServerHandle:
    """Start one ``api_server`` process (any run mode) without waiting for it.

    ``own_process_group``: the server leads a process group of its own, so a test can signal
    the whole server (``os.killpg``) without signalling itself.
    """
    port = port or free_port()
    log_path = log_dir / f"{name}_{port}.log"
    cmd = [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", str(model_dir), "--port", str(port), *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=own_process_group)
    return ServerHandle(f"http://127.0.0.1:{port}", proc, log_path, Path(model_dir).name)


def wait_healthy(handle: ServerHandle, timeout: float = START_TIMEOUT_SECONDS) -> None:
    """Wait until ``handle``'s /health answers 200 (fails with its log if it exits first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if handle.proc.poll() is not None:
            raise RuntimeError(f"{handle.url} exited with {handle.proc.returncode}:\n{handle.log()}")
        try:
            if httpx.get(f"{handle.url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{handle.url} did not become healthy in {timeout:.0f}s:\n{handle.log()}")


@dataclass
class Cluster:
    """A master and its nodes; ``stop`` ends every process it started."""

    model_dir: Path
    log_dir: Path
    master: ServerHandle
    master_port: int
    master_env: Dict[str, str] = field(default_factory=dict)
    nodes: Dict[str, ServerHandle] = field(default_factory=dict)
    # LIGHTLLM_PD_CLUSTER_KEY for every process of the cluster (master restarts and new nodes too).
    cluster_env: Dict[str, str] = field(default_factory=dict)
    # The master's flags (a restarted master gets them too).
    master_args: List[str] = field(default_factory=list)

    def start_node(self, role: str, args: Optional[List[str]] = None, env: Optional[Dict[str, str]] = None,
                   wait: bool = True) -> ServerHandle:
        """Start a ``role`` node registered with this cluster's master."""
        node = launch(self.model_dir, self.log_dir, role, [
            "--run_mode", role, "--pd_master_ip", "127.0.0.1", "--pd_master_port", str(self.master_port), *(args or [])
        ], {**self.cluster_env, **(env or {})})
        self.nodes[role] = node
        if wait:
            wait_healthy(node)
        return node

    def wait_ready(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        """Wait until the master's /health is 200 (a prefill and a decode node are alive)."""
        wait_healthy(self.master, timeout)

    def restart_master(self, env: Optional[Dict[str, str]] = None) -> None:
        """Replace the master on the same port (the nodes register again by themselves)."""
        self.master.stop()
        self.master_env = env or {}
        self.master = launch(self.model_dir, self.log_dir, "master", ["--run_mode", "pd_master", *self.master_args],
                             {**self.cluster_env, **self.master_env}, port=self.master_port)

    def stop(self) -> None:
        """Stop the nodes, then the master."""
        for node in self.nodes.values():
            node.stop(signal.SIGTERM, timeout=30)
        self.master.stop(signal.SIGTERM, timeout=30)


def start_cluster(model_dir: Path, log_dir: Path, prefill_args: Optional[List[str]] = None,
                  decode_args: Optional[List[str]] = None, prefill_env: Optional[Dict[str, str]] = None,
                  master_env: Optional[Dict[str, str]] = None, cluster_key: Optional[str] = None,
                  master_args: Optional[List[str]] = None) -> Cluster:
    """A ready 1P1D cluster on the CPU; ``cluster_key`` goes to every process as LIGHTLLM_PD_CLUSTER_KEY."""
    master_port = free_port()
    cluster_env = {"LIGHTLLM_PD_CLUSTER_KEY": cluster_key} if cluster_key else {}
    master = launch(model_dir, log_dir, "master", ["--run_mode", "pd_master", *(master_args or [])],
                    {**cluster_env, **(master_env or {})}, port=master_port)
    cluster = Cluster(model_dir, log_dir, master, master_port, dict(master_env or {}), cluster_env=cluster_env,
                      master_args=list(master_args or []))
    try:
        cluster.start_node("prefill", prefill_args, prefill_env, wait=False)
        cluster.start_node("decode", decode_args, wait=False)
        for node in cluster.nodes.values():
            wait_healthy(node)
        cluster.wait_ready()
    except BaseException:
        cluster.stop()
        raise
    return cluster
