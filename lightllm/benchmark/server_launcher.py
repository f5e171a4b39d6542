"""Start and stop real server processes for benchmarks.

A :class:`ServerSpec` says what to serve (model, prefill-queue strategy, other flags);
a :class:`Topology` turns a spec into a running :class:`Deployment` that answers HTTP
at ``base_url``. :class:`NormalTopology` runs one ``normal``-mode server process; a
PD-disaggregated topology (PD master + prefill node + decode node) can be added by
implementing the same two methods and returning a deployment whose ``base_url`` is the
master's, so the comparison runner does not change.

Every deployment is a context manager: leaving the ``with`` block stops it, also when
the benchmark raised, and, once a command calls :func:`stop_servers_on_sigterm`, when it is
terminated (``timeout``, a CI cancel, ``kill``).
"""

from __future__ import annotations

import abc
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Sequence

import httpx

from lightllm.utils.process_utils import free_port

# Flags the launcher sets itself; giving them again in extra_args would be ambiguous.
RESERVED_FLAGS: tuple[str, ...] = ("--model_dir", "--prefill_queue_strategy", "--port", "--host", "--run_mode")
_LOG_TAIL_CHARS = 4000


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """What one server serves: ``model_dir``, ``strategy`` and every other flag.

    ``extra_args`` are passed to ``python -m lightllm.server.api_server`` unchanged, so
    two specs that differ only in ``strategy`` start servers with identical flags.
    """

    model_dir: str
    strategy: str
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir must be a non-empty path")
        if not self.strategy or not isinstance(self.strategy, str):
            raise ValueError(f"strategy must be a non-empty name, got {self.strategy!r}")
        object.__setattr__(self, "extra_args", tuple(str(a) for a in self.extra_args))
        for arg in self.extra_args:
            flag = arg.split("=", 1)[0]
            if flag in RESERVED_FLAGS:
                raise ValueError(f"extra_args must not set {flag}: the launcher sets it (got {list(self.extra_args)})")

    def server_args(self) -> list[str]:
        """Server flags without host and port (the topology chooses those)."""
        return ["--model_dir", str(self.model_dir), "--prefill_queue_strategy", self.strategy, *self.extra_args]

    def has_flag(self, flag: str) -> bool:
        """Whether ``extra_args`` sets ``flag`` (as ``--flag value`` or ``--flag=value``)."""
        return any(a == flag or a.startswith(flag + "=") for a in self.extra_args)


class Deployment(abc.ABC):
    """Server process(es) answering HTTP at :attr:`base_url`; stop with :meth:`stop` or ``with``."""

    @property
    @abc.abstractmethod
    def base_url(self) -> str:
        """Root URL of the HTTP API clients talk to."""

    @property
    @abc.abstractmethod
    def log_paths(self) -> list[Path]:
        """Files holding the output of every process of the deployment."""

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """True while every process of the deployment runs."""

    @abc.abstractmethod
    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop every process; idempotent."""

    def describe(self) -> dict[str, Any]:
        """JSON-serialisable facts for reports."""
        return {"base_url": self.base_url, "logs": [str(p) for p in self.log_paths]}

    def __enter__(self) -> "Deployment":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def stop_servers_on_sigterm() -> None:
    """Make SIGTERM unwind the benchmark like an exit, so every open ``with`` block stops its servers.

    Python's default SIGTERM action ends the process at once, without ``finally`` blocks or
    ``__exit__``: a benchmark stopped by ``timeout``, a CI cancel or ``kill`` would leave every
    server it started running.  The exit code stays the conventional 128 + 15.
    """

    def terminate(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)


class ServerStartError(RuntimeError):
    """A server exited during start-up; the message has its refusal line or its log's tail."""


def startup_error_line(log_text: str) -> str | None:
    """The server's one-line start-up refusal (``error: ...`` or argparse's ``...: error: ...``) in its log, if any."""
    for line in reversed(log_text.splitlines()):
        if line.startswith("error: ") or ": error: " in line:
            return line.strip()
    return None


def _log_tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-_LOG_TAIL_CHARS:]


def _is_healthy(url: str) -> bool:
    try:
        # trust_env=False: a proxy from the environment must not intercept loopback checks.
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            return client.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


class ServerProcess(Deployment):
    """One ``python -m lightllm.server.api_server`` subprocess with its output in a log file.

    The server runs in a session of its own so a Ctrl-C meant for the benchmark does not
    reach it directly; the benchmark stops it with SIGTERM (clean shutdown) and, if it
    does not exit in time, kills its process group.
    """

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path, command: list[str]) -> None:
        self._proc = proc
        self._url = url
        self._log_path = log_path
        self.command = command

    @classmethod
    def start(
        cls,
        args: Sequence[str],
        log_path: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        start_timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
        ready: Callable[[str], bool] | None = None,
    ) -> "ServerProcess":
        """Start a server with ``args`` (no host/port) and wait until ``/health`` answers 200.

        ``env`` adds to (or overrides) this process's environment. ``ready(base_url)`` replaces
        the ``/health`` check (a PD master answers 503 there until its nodes registered).

        Raises:
            ValueError: ``start_timeout_s`` is not positive.
            RuntimeError: the server exited or stayed unhealthy; the message has its log tail.
        """
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be > 0, got {start_timeout_s}")
        port = free_port(host) if port is None else port
        command = [sys.executable, "-m", "lightllm.server.api_server", *args, "--host", host, "--port", str(port)]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
            )
        server = cls(proc, f"http://{host}:{port}", log_path, command)
        try:
            server.wait_ready(start_timeout_s, ready or _is_healthy)
        except BaseException:
            server.stop()
            raise
        return server

    def wait_ready(self, timeout_s: float, ready: Callable[[str], bool] | None = None) -> None:
        """Wait until ``ready(base_url)`` (default: ``/health`` answers 200); raise with the log tail."""
        ready = ready or _is_healthy
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail = _log_tail(self._log_path)
                refusal = startup_error_line(tail)
                if refusal is not None:  # a refused flag or setting: its one line says it all
                    raise ServerStartError(f"server refused to start (exit code {self._proc.returncode}, "
                                       f"log {self._log_path}): {refusal}")
                raise ServerStartError(
                    f"server exited with code {self._proc.returncode} during start-up "
                    f"(log {self._log_path}):\n{tail}"
                )
            if ready(self._url):
                return
            time.sleep(0.3)
        raise ServerStartError(
            f"server did not become healthy within {timeout_s:.0f}s (log {self._log_path}):\n"
            f"{_log_tail(self._log_path)}"
        )

    @property
    def base_url(self) -> str:
        return self._url

    @property
    def log_paths(self) -> list[Path]:
        return [self._log_path]

    @property
    def pid(self) -> int:
        """Process id of the server's main process."""
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """Exit code once the process ended, else ``None``."""
        return self._proc.poll()

    def is_alive(self) -> bool:
        return self._proc.poll() is None

    def log_text(self) -> str:
        """Everything the server printed so far."""
        return self._log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 60.0) -> None:
        if self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            # The session id equals the server's pid (start_new_session), so this reaches
            # exactly the processes this server started.
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait(10)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "pid": self._proc.pid, "command": self.command}


class Topology(abc.ABC):
    """How a :class:`ServerSpec` becomes a running :class:`Deployment`."""

    name: str = ""

    @abc.abstractmethod
    def launch(self, spec: ServerSpec, log_dir: Path) -> Deployment:
        """Start the deployment for ``spec``, logging under ``log_dir``; return once it serves."""

    def describe(self) -> dict[str, Any]:
        """JSON-serialisable description for reports."""
        return {"name": self.name}


def safe_label(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text) or "server"


class NormalTopology(Topology):
    """One ``normal``-mode server (prefill and decode in the same process group)."""

    name = "normal"

    def __init__(self, host: str = "127.0.0.1", start_timeout_s: float = 300.0) -> None:
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be > 0, got {start_timeout_s}")
        self.host = host
        self.start_timeout_s = start_timeout_s

    def launch(self, spec: ServerSpec, log_dir: Path) -> ServerProcess:
        log_path = Path(log_dir) / f"server_{safe_label(spec.strategy)}.log"
        return ServerProcess.start(
            spec.server_args(), log_path, host=self.host, start_timeout_s=self.start_timeout_s
        )

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "host": self.host, "start_timeout_s": self.start_timeout_s}


def _stop_launched(futures: Sequence[Future]) -> None:
    for future in futures:
        if future.done() and not future.cancelled() and future.exception() is None:
            future.result().stop()


def launch_all(
    topology: Topology, specs: Sequence[ServerSpec], log_dir: Path, *, parallel: bool = True
) -> list[Deployment]:
    """Launch one deployment per spec and return them in spec order; all or none.

    With ``parallel`` the start-ups overlap (a start-up is mostly imports and loading,
    which overlap well even on few cores). If any launch fails or the caller is
    interrupted, the deployments that did start are stopped before the error propagates,
    so no server outlives a failed start.
    """
    if not specs:
        raise ValueError("specs must name at least one server")
    if not parallel or len(specs) == 1:
        started: list[Deployment] = []
        try:
            for spec in specs:
                started.append(topology.launch(spec, log_dir))
        except BaseException:
            for deployment in started:
                deployment.stop()
            raise
        return started
    futures: list[Future] = []
    try:
        # Leaving the pool waits for every launch in flight, so each one is known below.
        with ThreadPoolExecutor(max_workers=len(specs), thread_name_prefix="launch") as pool:
            futures = [pool.submit(topology.launch, spec, log_dir) for spec in specs]
    except BaseException:
        _stop_launched(futures)
        raise
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        _stop_launched(futures)
        raise errors[0]
    return [f.result() for f in futures]
