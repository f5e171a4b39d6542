"""One real ``python -m lightllm.server.api_server`` process, started and stopped for a benchmark.

:meth:`ServerProcess.start` spawns the server in a session of its own, records it in the
launch's :class:`~lightllm.benchmark.launch_guard.LaunchGuard` the moment it exists, and waits
until the server answers on its own port; :meth:`ServerProcess.stop` ends it and whatever is
left in its session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx

from lightllm.benchmark.deployment import Deployment
from lightllm.benchmark.launch_guard import LaunchGuard
from lightllm.benchmark.server_session import seconds_since_boot, session_listens_on, sweep_session
from lightllm.utils.free_ports import free_port

_LOG_TAIL_CHARS = 4000
_POLL_S = 0.3
# Without /proc a server's ownership of its port cannot be checked; its readiness is then
# re-checked after this pause (see ServerProcess.wait_ready).
_RECHECK_S = 1.0
API_SERVER: tuple[str, ...] = (sys.executable, "-m", "lightllm.server.api_server")


class ServerStartError(RuntimeError):
    """A server exited during start-up; the message has its refusal line or its log's tail."""


class ServerRefusedError(ServerStartError):
    """A server refused its flags or settings at start-up; the message has its one-line refusal."""


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
    does not exit in time, kills its process group.  Whatever the session still holds once
    the server exited (children of a server that died before it could stop them) is killed
    too.
    """

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path, command: list[str]) -> None:
        self._proc = proc
        self._url = url
        self._port = urllib.parse.urlsplit(url).port
        self._log_path = log_path
        self.command = command
        # When this process's exit was first seen (seconds since boot), for sweep_session.
        self._exited_at: float | None = None
        self._swept = False

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
        guard: LaunchGuard | None = None,
        program: Sequence[str] = API_SERVER,
    ) -> "ServerProcess":
        """Start a server with ``args`` (no host/port) and wait until it serves.

        ``env`` adds to (or overrides) this process's environment. ``ready(base_url)`` replaces
        the default check (``/health`` answers 200 and the listening socket is this server's);
        a PD master answers 503 there until its nodes registered. ``guard`` records the process
        as soon as it is spawned and ends the wait once it is cancelled. ``program`` is the
        command before the flags (any server taking ``--host``/``--port``).

        Raises:
            ValueError: ``start_timeout_s`` is not positive.
            ServerStartError: the server exited or stayed unhealthy; the message has its log tail.
            LaunchCancelled: ``guard`` was cancelled (the process is stopped).
        """
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be > 0, got {start_timeout_s}")
        if guard is not None:
            guard.check()  # nothing is spawned for a launch that is already cancelled
        port = free_port(host) if port is None else port
        command = [*program, *args, "--host", host, "--port", str(port)]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
            )
        server = cls(proc, f"http://{host}:{port}", log_path, command)
        try:
            if guard is not None:
                guard.record(server)
            server.wait_ready(start_timeout_s, ready, guard=guard)
        except BaseException:
            server.stop()
            raise
        return server

    def _poll(self) -> int | None:
        """The exit code once the process ended (noting when that was first seen), else ``None``."""
        code = self._proc.poll()
        if code is not None and self._exited_at is None:
            self._exited_at = seconds_since_boot()
        return code

    def _start_failure(self) -> ServerStartError:
        tail = _log_tail(self._log_path)
        refusal = startup_error_line(tail)
        if refusal is not None:  # a refused flag or setting: its one line says it all
            return ServerRefusedError(f"server refused to start (exit code {self._proc.returncode}, "
                                      f"log {self._log_path}): {refusal}")
        return ServerStartError(
            f"server exited with code {self._proc.returncode} during start-up (log {self._log_path}):\n{tail}"
        )

    def _serves_itself(self, ready: Callable[[str], bool], guard: LaunchGuard | None) -> bool:
        """After a passed ``/health``: whether the answer came from this server, not another one on its port.

        The port was free when it was picked, but another program can take it before this server
        binds it (ours then exits with "Address already in use" within seconds).  /health and the
        other endpoints expose no identity of the process (no pid), so the listening socket itself
        is checked: it must belong to a process of this server's session.  Where /proc cannot
        tell, the answer is trusted only if this process is still alive and ready after a short
        pause, which catches a server that lost the port quickly but not one still importing.
        """
        owner = session_listens_on(self._proc.pid, self._port) if self._port is not None else None
        if owner is not None:
            return owner
        if guard is not None:
            guard.sleep(_RECHECK_S)
        else:
            time.sleep(_RECHECK_S)
        return self._poll() is None and ready(self._url)

    def wait_ready(
        self, timeout_s: float, ready: Callable[[str], bool] | None = None, *, guard: LaunchGuard | None = None
    ) -> None:
        """Wait until ``ready(base_url)``; raise with the log tail if the server exits or stays unready.

        The default check is ``/health`` answering 200 from a socket this server owns (see
        :meth:`_serves_itself`); a custom ``ready`` is trusted as it is. Either way the process
        must still be alive once the check passed. ``guard`` ends the wait with
        :class:`LaunchCancelled` as soon as it is cancelled.
        """
        check = ready or _is_healthy
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if guard is not None:
                guard.check()
            if self._poll() is not None:
                raise self._start_failure()
            if check(self._url) and (ready is not None or self._serves_itself(check, guard)):
                if self._poll() is not None:  # it answered, then died: not ready
                    raise self._start_failure()
                return
            if guard is not None:
                guard.sleep(_POLL_S)
            else:
                time.sleep(_POLL_S)
        raise ServerStartError(
            f"server did not become healthy within {timeout_s:.0f}s (log {self._log_path}):\n"
            f"{_log_tail(self._log_path)}"
        )

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT`` of this server's HTTP listener."""
        return self._url

    @property
    def log_paths(self) -> list[Path]:
        """The one log file, holding the stdout and stderr of the server and of the processes it starts."""
        return [self._log_path]

    @property
    def pid(self) -> int:
        """Process id of the server's main process."""
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """Exit code once the process ended, else ``None``."""
        return self._poll()

    def is_alive(self) -> bool:
        """True while the main process runs."""
        return self._poll() is None

    def log_text(self) -> str:
        """Everything the server printed so far."""
        return self._log_path.read_text(errors="replace")

    def terminate(self) -> None:
        """Send SIGTERM (clean shutdown) without waiting; see :meth:`stop`."""
        if self._poll() is None:
            try:
                self._proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM, up to ``timeout_s`` seconds for the exit, then SIGKILL of the process group; idempotent.

        The first call also ends what is left of the server's session (children of a server killed or crashed).
        """
        if self._poll() is None:
            self.terminate()
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
            self._poll()
        if not self._swept:
            # A clean shutdown leaves nothing behind; a server killed before it set up its own
            # SIGTERM handling (e.g. still starting) or one that crashed leaves its children.
            self._swept = True
            sweep_session(self._proc.pid, self._exited_at)

    def describe(self) -> dict[str, Any]:
        """The deployment's facts plus the main process's pid and the command line."""
        return {**super().describe(), "pid": self._proc.pid, "command": self.command}
