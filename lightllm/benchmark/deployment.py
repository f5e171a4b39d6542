"""What a benchmark serves and what it gets back: :class:`ServerSpec` and :class:`Deployment`.

A :class:`ServerSpec` says what to serve (model, prefill-queue strategy, other flags); a
topology (:mod:`lightllm.benchmark.server_launcher`) turns it into a running
:class:`Deployment` that answers HTTP at ``base_url``.  Every deployment is a context manager:
leaving the ``with`` block stops it, also when the benchmark raised, and, once a command calls
:func:`stop_servers_on_sigterm`, when it is terminated (``timeout``, a CI cancel, ``kill``).
"""

from __future__ import annotations

import abc
import dataclasses
import signal
from pathlib import Path
from types import TracebackType
from typing import Any, Sequence

# Flags the launcher sets itself; giving them again in extra_args would be ambiguous.
RESERVED_FLAGS: tuple[str, ...] = ("--model_dir", "--prefill_queue_strategy", "--port", "--host", "--run_mode")


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


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value ``args`` give ``flag`` (``--flag value`` or ``--flag=value``; the last one), else ``None``.

    The server refuses a flag given twice, so the last value is the only one a server it starts with.
    """
    value = None
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


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
