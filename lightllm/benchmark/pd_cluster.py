"""A PD cluster (PD master + x prefill nodes + y decode nodes) as one benchmark deployment.

:class:`PdTopology` (``--topology 1p1d``, ``2p1d``, ``1p2d`` or ``2p2d`` of ``compare_strategies``)
starts, per :class:`~lightllm.benchmark.deployment.ServerSpec`, ``1 + x + y``
``python -m lightllm.server.api_server`` processes on this host:

* the master (``--run_mode pd_master``) with ``--model_dir`` and the topology's ``master_args``
  (not the spec's extra flags: the master runs no model and refuses node flags);
* each prefill node (``--run_mode prefill``) with the spec's strategy and extra flags, then the
  topology's ``prefill_args``: the prefill-queue strategy runs where prompts wait for prefill;
* each decode node (``--run_mode decode``) with the spec's extra flags (the same TP size and
  dtype as the prefill nodes, which the master requires), then the topology's ``decode_args``,
  without the strategy.

The spec's extra flags thus reach every prefill and decode node and must be flags both roles
accept; a flag only one role reads (the prefill step and queue's flags, the decode side's
``--pd_max_segment_tokens``) goes in ``prefill_args`` or ``decode_args``.  A node that refuses its
flags exits within a second of its start with a one-line error, and the launch fails with it
(:class:`~lightllm.benchmark.server_process.ServerStartError`, the node's log named).

All start at once (the nodes retry their registration until the master answers); the cluster
serves once the master counts every node alive. Processes are named ``prefill``, ``prefill_2``,
..., ``decode``, ``decode_2``, ... Clients talk to the master only, so the benchmark measures a
cluster exactly as a normal server.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

from lightllm.benchmark.launch_guard import LaunchGuard
from lightllm.benchmark.port_range import PortRange, confined_port_flags, ports_of_model_process
from lightllm.benchmark.deployment import RESERVED_FLAGS, Deployment, ServerSpec
from lightllm.benchmark.server_launcher import Topology, launch_concurrently, safe_label
from lightllm.benchmark.server_process import ServerProcess
from lightllm.server.pd.protocol.membership import NODES_PATH
from lightllm.utils.free_ports import free_port

# Flags the cluster launcher sets itself on the nodes (besides ServerSpec's reserved ones).
PD_RESERVED_FLAGS: tuple[str, ...] = ("--pd_master_ip", "--pd_master_port")
ROLES: tuple[str, ...] = ("master", "prefill", "decode")
# The node roles that take flags of their own (prefill_args / decode_args).
NODE_ROLES: tuple[str, ...] = ("prefill", "decode")


def node_names(role: str, count: int) -> list[str]:
    """Process names of ``count`` nodes of ``role``: ``prefill``, ``prefill_2``, ..."""
    return [role if index == 0 else f"{role}_{index + 1}" for index in range(count)]


def _check_flags(args: Sequence[str], where: str, reserved: Sequence[str] = ()) -> None:
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in PD_RESERVED_FLAGS or flag in ("--run_mode", "--model_dir", "--host", "--port", *reserved):
            raise ValueError(f"{where} must not set {flag}: the PD cluster launcher sets it (got {list(args)})")


def _flag_names(args: Sequence[str]) -> set[str]:
    """The flags written in ``args`` (``--flag value`` or ``--flag=value``)."""
    return {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}


def cluster_commands(spec: ServerSpec, master_args: Sequence[str], host: str, master_port: int,
                     prefill_nodes: int = 1, decode_nodes: int = 1, *, prefill_args: Sequence[str] = (),
                     decode_args: Sequence[str] = ()) -> dict[str, list[str]]:
    """Server flags (without ``--host``/``--port``) of the master and every node, by process name.

    ``spec.extra_args`` reach every prefill and decode node, ``prefill_args`` / ``decode_args``
    (after them) only the nodes of that role, ``master_args`` only the master.

    Raises:
        ValueError: one of them sets a flag the launcher owns.
    """
    _check_flags(spec.extra_args, "extra_args")
    _check_flags(master_args, "master_args")
    # The strategy is the spec's: a second one in a role's flags would make it ambiguous.
    _check_flags(prefill_args, "prefill_args", RESERVED_FLAGS)
    _check_flags(decode_args, "decode_args", RESERVED_FLAGS)
    membership = ["--pd_master_ip", host, "--pd_master_port", str(master_port)]
    commands = {"master": ["--run_mode", "pd_master", "--model_dir", str(spec.model_dir), *master_args]}
    # Several nodes of a role on one host need names of their own (one node keeps its default id).
    for name in node_names("prefill", prefill_nodes):
        node_id = ["--pd_node_id", name] if prefill_nodes > 1 else []
        commands[name] = ["--run_mode", "prefill", *spec.server_args(), *prefill_args, *membership, *node_id]
    for name in node_names("decode", decode_nodes):
        node_id = ["--pd_node_id", name] if decode_nodes > 1 else []
        commands[name] = ["--run_mode", "decode", "--model_dir", str(spec.model_dir), *spec.extra_args, *decode_args,
                          *membership, *node_id]
    return commands


class PdCluster(Deployment):
    """A running master and its nodes; clients use the master's URL."""

    def __init__(self, processes: dict[str, ServerProcess]) -> None:
        missing = [role for role in ROLES if role not in processes]
        if missing:
            raise ValueError(f"processes must hold {list(ROLES)}, missing {missing}")
        self.processes = dict(processes)

    @property
    def names(self) -> list[str]:
        """Process names: the master, then the prefill nodes, then the decode nodes."""
        order = {"master": 0, "prefill": 1, "decode": 2}
        return sorted(self.processes, key=lambda name: (order[name.split("_")[0]], name))

    @property
    def base_url(self) -> str:
        """The master's URL: clients send every request to the master."""
        return self.processes["master"].base_url

    @property
    def log_paths(self) -> list[Path]:
        """Each process's log, in :attr:`names` order."""
        return [self.processes[name].log_paths[0] for name in self.names]

    def is_alive(self) -> bool:
        """True while the master and every node run."""
        return all(process.is_alive() for process in self.processes.values())

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the decode nodes, then the prefill nodes, then the master (each as :meth:`ServerProcess.stop`)."""
        # Nodes first, so the master never reports them dropped while it still serves; each
        # stop() is SIGTERM, a bounded wait, then SIGKILL of its process group.
        for name in reversed(self.names):
            self.processes[name].stop(timeout_s)

    def describe(self) -> dict[str, Any]:
        """The deployment's facts, the master's pid and command, and every process's own description."""
        return {
            **super().describe(),
            "pid": self.processes["master"].pid,
            "command": self.processes["master"].command,
            "processes": {name: self.processes[name].describe() for name in self.names},
        }


class PdTopology(Topology):
    """One PD cluster of ``prefill_nodes`` P and ``decode_nodes`` D per spec on this host.

    Args:
        prefill_nodes / decode_nodes: how many nodes of each role (1P1D by default).
        host: listen address of every process.
        start_timeout_s: bound on the start-up, until the master's ``/health`` answers 200.
        master_args: extra flags of the master (e.g. ``--pd_prefill_timeout_seconds 60``).
        prefill_devices / decode_devices: ``CUDA_VISIBLE_DEVICES`` of each node of that role on GPUs.
        prefill_args / decode_args: flags of every node of that role only, after the spec's extra
            flags (e.g. ``--prefill_max_overtake_tokens 64`` / ``--pd_max_segment_tokens 64``).
        ports: the range every port of the cluster comes from: the master's and each node's HTTP
            port, each prefill node's ``--pd_transfer_port`` block and, with more than one TP rank,
            each node's ``--nccl_port`` (default: any free HTTP port, the nodes pick the others).
    """

    name = "1p1d"
    prefill_nodes = 1
    decode_nodes = 1

    def __init__(
        self,
        host: str = "127.0.0.1",
        start_timeout_s: float = 300.0,
        master_args: Sequence[str] = (),
        prefill_devices: str | None = None,
        decode_devices: str | None = None,
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        ports: PortRange | None = None,
    ) -> None:
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be > 0, got {start_timeout_s}")
        self.host = host
        self.start_timeout_s = start_timeout_s
        self.master_args = tuple(str(a) for a in master_args)
        _check_flags(self.master_args, "master_args")
        self.role_args = {"prefill": tuple(str(a) for a in prefill_args), "decode": tuple(str(a) for a in decode_args)}
        for role, args in self.role_args.items():
            _check_flags(args, f"{role}_args", RESERVED_FLAGS)
            if self._count(role) > 1 and "--pd_node_id" in _flag_names(args):
                raise ValueError(f"{role}_args must not set --pd_node_id: the {self.name} launcher names its "
                                 f"{self._count(role)} {role} nodes itself")
        self.devices = {"prefill": prefill_devices, "decode": decode_devices}
        self.ports = ports

    def _count(self, role: str) -> int:
        return self.prefill_nodes if role == "prefill" else self.decode_nodes

    def commands(self, spec: ServerSpec, master_port: int) -> dict[str, list[str]]:
        """The server flags of every process of this cluster for ``spec`` (see :func:`cluster_commands`)."""
        return cluster_commands(spec, self.master_args, self.host, master_port, self.prefill_nodes, self.decode_nodes,
                                prefill_args=self.role_args["prefill"], decode_args=self.role_args["decode"])

    def process_flags(self, spec: ServerSpec) -> dict[str, dict[str, tuple[str, ...]]]:
        """The master's flags, and every node role's: the spec's extra flags, then the role's own."""
        return {
            "master": {"master_args": self.master_args},
            **{role: {"extra_args": spec.extra_args, f"{role}_args": self.role_args[role]} for role in NODE_ROLES},
        }

    def _node_flags(self, spec: ServerSpec, role: str) -> list[str]:
        """The flags a node of ``role`` reads its TP size and port flags from."""
        return [*spec.extra_args, *self.role_args[role]]

    def ports_needed(self, spec: ServerSpec) -> int:
        """The master's port, and each node's (see :func:`~lightllm.benchmark.port_range.ports_of_model_process`)."""
        return 1 + sum(self._count(role) * ports_of_model_process(self._node_flags(spec, role),
                                                                  prefill_node=role == "prefill")
                       for role in NODE_ROLES)

    def check_spec(self, spec: ServerSpec) -> None:
        """Refuse (one line), before any process starts, flags the launch would override or make ambiguous.

        A flag given both in ``extra_args`` and a role's flags would reach that role twice, the
        later value silently winning; ``--pd_node_id`` on a role of several nodes would be
        replaced by the names the launcher gives them.  Whether each role accepts its flags is
        the node's own check, at its start.
        """
        for role, args in self.role_args.items():
            both = sorted(_flag_names(spec.extra_args) & _flag_names(args))
            if both:
                raise ValueError(f"{', '.join(both)} given in both extra_args and {role}_args; give each flag once "
                                 f"(extra_args reach every prefill and decode node, {role}_args the {role} nodes only)")
        if any(self._count(role) > 1 for role in NODE_ROLES) and "--pd_node_id" in _flag_names(spec.extra_args):
            raise ValueError(f"extra_args must not set --pd_node_id: the {self.name} launcher names its nodes itself")

    def _env(self, role: str) -> dict[str, str] | None:
        devices = self.devices.get(role)
        if devices is not None:
            return {"CUDA_VISIBLE_DEVICES": devices}
        if "LIGHTLLM_TORCH_THREADS" in os.environ:
            return None
        # On CPU both nodes share this machine's cores, so neither may borrow the front end's
        # core for prefill (forward_threads.py): one thread count for every forward, the
        # standing (cores - 1) of a node that had the machine to itself, or fewer when the user
        # set the wide forwards' count lower (the server refuses wide forwards narrower than it).
        threads = max(1, (os.cpu_count() or 1) - 1)
        wide = os.environ.get("LIGHTLLM_PREFILL_TORCH_THREADS", "").strip()
        if wide.isdigit() and int(wide) >= 1:
            threads = min(threads, int(wide))
        return {"LIGHTLLM_TORCH_THREADS": str(threads)}

    def launch(self, spec: ServerSpec, log_dir: Path, guard: LaunchGuard | None = None) -> PdCluster:
        """Start the master and every node of ``spec`` at once; return when the master counts every node alive.

        All or none: a failed or cancelled start stops whatever had started, then re-raises.
        """
        # A launch of its own when the caller gives no guard: the node threads below must be
        # cancellable even when this runs in the main thread (a Ctrl-C lands there).
        guard = LaunchGuard() if guard is None else guard
        cluster = f"the {spec.strategy} cluster"
        master_port = (free_port(self.host) if self.ports is None
                       else self.ports.take(self.host, what=f"{cluster}'s master"))
        commands = self.commands(spec, master_port)
        # Without a range each node's HTTP port is any free one (ServerProcess picks it).
        node_ports: dict[str, int | None] = {name: None for name in commands if name != "master"}
        if self.ports is not None:
            for name in node_ports:
                role, node = name.split("_")[0], f"{cluster}'s {name} node"
                node_ports[name] = self.ports.take(self.host, what=node)
                commands[name] += confined_port_flags(self.ports, self.host, self._node_flags(spec, role),
                                                      prefill_node=role == "prefill", what=node)
        label = safe_label(spec.strategy)
        logs = {name: Path(log_dir) / f"server_{label}_{name}.log" for name in commands}
        nodes = [name for name in commands if name != "master"]
        started: dict[str, ServerProcess] = {}
        deadline = time.monotonic() + self.start_timeout_s
        try:
            # The master is not waited for here: the nodes retry their registration until it
            # answers, so its start-up overlaps theirs.
            started["master"] = ServerProcess.start(
                commands["master"], logs["master"], host=self.host, port=master_port,
                start_timeout_s=self.start_timeout_s, ready=lambda _url: True, guard=guard,
            )
            # Every node loads at once; each is up when its own /health answers 200.  All or
            # none: a failed or interrupted node start stops the others (launch_concurrently).
            node_starts = [
                functools.partial(
                    ServerProcess.start, commands[name], logs[name], host=self.host, port=node_ports[name],
                    start_timeout_s=self.start_timeout_s, env=self._env(name.split("_")[0]), guard=guard,
                )
                for name in nodes
            ]
            for name, process in zip(nodes, launch_concurrently(guard, node_starts, "pd-node")):
                started[name] = process  # type: ignore[assignment]
            # Serving only once the master counts every node alive.
            started["master"].wait_ready(max(deadline - time.monotonic(), 1.0), guard=guard)
            _wait_for_nodes(started["master"].base_url, len(nodes), deadline, guard)
        except BaseException:
            for name in reversed(list(started)):
                started[name].stop()
            raise
        return PdCluster(started)

    def describe(self) -> dict[str, Any]:
        """JSON-serialisable description for reports: node counts, host, timeout, flags and devices per role."""
        return {
            "name": self.name,
            "prefill_nodes": self.prefill_nodes,
            "decode_nodes": self.decode_nodes,
            "host": self.host,
            "start_timeout_s": self.start_timeout_s,
            "master_args": list(self.master_args),
            "prefill_args": list(self.role_args["prefill"]),
            "decode_args": list(self.role_args["decode"]),
            "prefill_devices": self.devices["prefill"],
            "decode_devices": self.devices["decode"],
            **({} if self.ports is None else {"ports": str(self.ports)}),
        }



def _wait_for_nodes(master_url: str, count: int, deadline: float, guard: LaunchGuard) -> None:
    """Wait until the master lists ``count`` registered nodes (its /health needs only one per role)."""
    key = os.environ.get("LIGHTLLM_PD_CLUSTER_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    while True:
        guard.check()
        try:
            answer = httpx.get(f"{master_url}{NODES_PATH}", headers=headers, timeout=5)
            if answer.status_code == 200 and len(answer.json().get("nodes", [])) >= count:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the PD master at {master_url} did not list {count} nodes in time")
        guard.sleep(0.2)


def _sized(prefill_nodes: int, decode_nodes: int) -> type[PdTopology]:
    name = f"{prefill_nodes}p{decode_nodes}d"
    return type(f"PdTopology{prefill_nodes}P{decode_nodes}D", (PdTopology,), {
        "name": name, "prefill_nodes": prefill_nodes, "decode_nodes": decode_nodes,
        "__doc__": f"A PD cluster of {prefill_nodes} prefill and {decode_nodes} decode nodes (see PdTopology).",
    })


# The xPyD shapes the benchmark runner knows besides 1P1D.
XPYD_TOPOLOGIES: tuple[type[PdTopology], ...] = (_sized(2, 1), _sized(1, 2), _sized(2, 2))
