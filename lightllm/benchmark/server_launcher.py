"""Topologies that turn a :class:`~lightllm.benchmark.deployment.ServerSpec` into running servers.

:class:`NormalTopology` runs one ``normal``-mode server process
(:class:`~lightllm.benchmark.server_process.ServerProcess`); a PD-disaggregated topology
(:mod:`lightllm.benchmark.pd_cluster`) implements the same two methods and returns a deployment
whose ``base_url`` is the master's, so the comparison runner does not change.

A launch still in progress is covered too: every process is recorded in the launch's
:class:`~lightllm.benchmark.launch_guard.LaunchGuard` the moment it is spawned, and an
interrupted or failed launch cancels the guard, which stops them all (see :func:`launch_all`).
"""

from __future__ import annotations

import abc
import functools
import re
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, Sequence

from lightllm.benchmark.deployment import Deployment, ServerSpec
from lightllm.benchmark.launch_guard import LaunchCancelled, LaunchGuard
from lightllm.benchmark.port_range import PortRange, confined_port_flags, ports_of_model_process
from lightllm.benchmark.server_process import ServerProcess

# How long the waiting thread blocks at a time while launch threads run: a wait that never
# times out is where a signal's exception would have to land, so it is kept short.
_WAIT_SLICE_S = 0.5


class Topology(abc.ABC):
    """How a :class:`ServerSpec` becomes a running :class:`Deployment`."""

    name: str = ""

    @abc.abstractmethod
    def launch(self, spec: ServerSpec, log_dir: Path, guard: LaunchGuard | None = None) -> Deployment:
        """Start the deployment for ``spec``, logging under ``log_dir``; return once it serves.

        Every process is recorded in ``guard`` when it is spawned, and the launch gives up with
        :class:`~lightllm.benchmark.launch_guard.LaunchCancelled` once ``guard`` is cancelled.
        """

    def check_spec(self, spec: ServerSpec) -> None:
        """Raise ``ValueError`` (one line), before anything starts, for flags the launch would override.

        Nothing to check for one server.  Whether a server accepts its flags is its own check: it
        refuses a bad one within a second of its start, and the launch fails with that one line
        (:class:`~lightllm.benchmark.server_process.ServerRefusedError`).
        """

    def process_flags(self, spec: ServerSpec) -> dict[str, dict[str, tuple[str, ...]]]:
        """The flags each kind of process of a launch of ``spec`` gets, by the option that gives them.

        Checks made before anything starts (the context a workload must fit, the ports a launch
        needs) read a process's flags from here and name the option a flag came from.  One
        server gets the spec's ``extra_args``.
        """
        return {"server": {"extra_args": spec.extra_args}}

    def ports_needed(self, spec: ServerSpec) -> int:
        """How many ports of a ``--ports`` range a launch of ``spec`` takes (one server: see
        :func:`~lightllm.benchmark.port_range.ports_of_model_process`)."""
        return ports_of_model_process(spec.extra_args)

    def describe(self) -> dict[str, Any]:
        """JSON-serialisable description for reports."""
        return {"name": self.name}


def safe_label(text: str) -> str:
    """``text`` (a strategy name) with each run of characters unsafe in a file name as ``_``; ``server`` if empty."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text) or "server"


class NormalTopology(Topology):
    """One ``normal``-mode server (prefill and decode in the same process group).

    ``ports``: the range every port the server listens on comes from (default: any free port
    for its HTTP listener, and the server picks its others itself).
    """

    name = "normal"

    def __init__(self, host: str = "127.0.0.1", start_timeout_s: float = 300.0, ports: PortRange | None = None) -> None:
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be > 0, got {start_timeout_s}")
        self.host = host
        self.start_timeout_s = start_timeout_s
        self.ports = ports

    def launch(self, spec: ServerSpec, log_dir: Path, guard: LaunchGuard | None = None) -> ServerProcess:
        """Start one server for ``spec``, logging to ``server_<strategy>.log``; return once it serves."""
        log_path = Path(log_dir) / f"server_{safe_label(spec.strategy)}.log"
        args, port = spec.server_args(), None
        if self.ports is not None:
            what = f"the {spec.strategy} server"
            port = self.ports.take(self.host, what=what)
            args += confined_port_flags(self.ports, self.host, spec.extra_args, what=what)
        return ServerProcess.start(
            args, log_path, host=self.host, port=port, start_timeout_s=self.start_timeout_s, guard=guard
        )

    def describe(self) -> dict[str, Any]:
        """JSON-serialisable description for reports: host, start timeout and the port range, if any."""
        ports = {} if self.ports is None else {"ports": str(self.ports)}
        return {"name": self.name, "host": self.host, "start_timeout_s": self.start_timeout_s, **ports}


def _stop_launched(futures: Sequence[Future]) -> None:
    for future in futures:
        if future.done() and not future.cancelled() and future.exception() is None:
            future.result().stop()


def launch_concurrently(
    guard: LaunchGuard, launches: Sequence[Callable[[], Deployment]], thread_name_prefix: str = "launch"
) -> list[Deployment]:
    """Run ``launches`` in threads of their own and return their deployments in order; all or none.

    The calling thread waits in short slices, so a signal's exception (Ctrl-C, SIGTERM via
    :func:`stop_servers_on_sigterm`) reaches it promptly.  On that exception, or as soon as one
    launch fails, ``guard`` is cancelled: every process any launch spawned is stopped and the
    launches still running give up at once.  Their threads are then waited for (quick now),
    every deployment that did start is stopped, and the exception (the first real failure, not
    a launch that gave up because of it) propagates.  Each launch must pass ``guard`` to every
    process it starts.
    """
    pool = ThreadPoolExecutor(max_workers=max(1, len(launches)), thread_name_prefix=thread_name_prefix)
    futures: list[Future] = []
    try:
        for launch in launches:
            futures.append(pool.submit(launch))
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=_WAIT_SLICE_S, return_when=FIRST_EXCEPTION)
            if any(future.exception() is not None for future in done):
                break
    except BaseException:
        guard.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        _stop_launched(futures)
        raise
    if pending:
        guard.cancel()
    pool.shutdown(wait=True, cancel_futures=True)
    errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
    if errors:
        _stop_launched(futures)
        raise next((e for e in errors if not isinstance(e, LaunchCancelled)), errors[0])
    return [f.result() for f in futures]


def launch_all(
    topology: Topology, specs: Sequence[ServerSpec], log_dir: Path, *, parallel: bool = True
) -> list[Deployment]:
    """Launch one deployment per spec and return them in spec order; all or none.

    With ``parallel`` the start-ups overlap (a start-up is mostly imports and loading,
    which overlap well even on few cores). If any launch fails or the caller is
    interrupted (Ctrl-C, SIGTERM), every server process spawned so far is stopped before
    the error propagates, including those of launches still in progress, so no server
    outlives a failed start.
    """
    if not specs:
        raise ValueError("specs must name at least one server")
    guard = LaunchGuard()
    if not parallel or len(specs) == 1:
        started: list[Deployment] = []
        try:
            for spec in specs:
                started.append(topology.launch(spec, log_dir, guard=guard))
        except BaseException:
            guard.cancel()
            for deployment in started:
                deployment.stop()
            raise
        return started
    launches = [functools.partial(topology.launch, spec, log_dir, guard=guard) for spec in specs]
    return launch_concurrently(guard, launches)
