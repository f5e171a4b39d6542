"""The launcher's watch over its child processes and multiprocessing's resource tracker.

A child that exits on its own is reported at once (the supervisor then fails every request and
stops the server); so is one whose heartbeat went stale (``--watchdog_timeout``, checked by a
:class:`~lightllm.server.launch.watchdog.Watchdog` every round of 0.2 s).  The resource tracker is
kept alive while the server runs.

The tracker is the process that unlinks the server's shared memory if the main process is killed
(SIGKILL, the OOM killer).  It is not one of the server's children in the supervisor's sense (it
serves no request), but a stray ``kill`` of it silently removed that guarantee: nothing was
logged, a later SIGKILL of the server left its segments behind, and at a normal shutdown the
tracker multiprocessing relaunched printed a ``KeyError`` traceback for every segment it had never
been told about.  The launcher's child watcher therefore probes it about once a second; when it
is gone, the watcher logs a warning, starts a new one and registers the server's segments with
it, so that both the clean-up guarantee and a quiet shutdown hold again.

The probe and the pid use ``multiprocessing.resource_tracker``'s private state (``_check_alive``,
``_fd``, ``_pid``; CPython 3.8-3.13): where they are missing, :func:`tracker_watchable` is False and
the watcher does not probe.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import threading
import warnings
from multiprocessing import resource_tracker
from multiprocessing.process import BaseProcess
from typing import Any, Callable, List, Optional, Sequence, Tuple

from lightllm.server.launch.watchdog import WATCH_ROUND_SECONDS, Stall, Watchdog
from lightllm.utils.process_utils import start_resource_tracker_deaf_to_hangup
from lightllm.utils.owner_locks import SHM_DIR, held_shm_locks, own_shm_tags

log = logging.getLogger(__name__)


def tracker_watchable() -> bool:
    """Whether this process started a tracker that can be probed."""
    tracker = resource_tracker._resource_tracker
    return callable(getattr(tracker, "_check_alive", None)) and getattr(tracker, "_fd", None) is not None


def tracker_alive() -> bool:
    """Whether the tracker this process started still reads its pipe."""
    return bool(resource_tracker._resource_tracker._check_alive())


def own_segment_names() -> List[str]:
    """The names (as the tracker records them, with the leading ``/``) of this server's segments."""
    # The tags this process created, not its pid prefix: a dead same-pid server's names share that.
    prefixes = tuple(f"{tag}_" for tag in own_shm_tags())
    if not prefixes:
        return []
    # Not the owner lock files: they are no segments (restart_tracker registers them apart).
    locks = {lock.lock_path.name for lock in held_shm_locks()}
    try:
        return sorted(f"/{path.name}" for path in SHM_DIR.iterdir()
                      if path.name.startswith(prefixes) and path.name not in locks)
    except OSError:
        return []


def restart_tracker() -> None:
    """Start a new tracker in place of a dead one and register this server's segments with it."""
    old_pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    names = own_segment_names()
    log.warning("multiprocessing's resource tracker (pid %s) exited; starting a new one and registering the "
                "server's %d shared-memory segment(s) with it, so they are still removed if the server is killed",
                old_pid, len(names))
    with warnings.catch_warnings():
        # multiprocessing's own "died unexpectedly, relaunching" warning: the line above says it.
        warnings.simplefilter("ignore", UserWarning)
        start_resource_tracker_deaf_to_hangup()
    # The segments' owner lock files too, so that a later kill leaves nothing in /dev/shm.
    owner_names = [name for name in (lock.tracker_name() for lock in held_shm_locks()) if name is not None]
    for name in names + owner_names:
        resource_tracker.register(name, "shared_memory")


def watch_children(children: Sequence[Tuple[str, BaseProcess]], stopping: threading.Event,
                   on_death: Any, watchdog: Optional[Watchdog] = None,
                   on_stall: Optional[Callable[[List[Stall], float], None]] = None) -> threading.Thread:
    """A thread that calls ``on_death(name, exitcode)`` as soon as any of ``children`` exits on its own.

    With a ``watchdog`` (armed here: call this once the children are ready) it calls
    ``on_stall(stalls, timeout_seconds)`` when live children made no progress for its timeout.
    Either call is the last: the thread then ends.  It watches until ``stopping`` is set (the
    launcher sets it before stopping them on purpose).

    It also replaces multiprocessing's resource tracker if that dies (:func:`restart_tracker`).
    """
    if watchdog is not None and on_stall is None:
        raise ValueError("a watchdog needs on_stall")
    if watchdog is not None:
        watchdog.arm()

    def run() -> None:
        watched = list(children)
        probe_tracker = tracker_watchable()
        rounds = 0
        while not stopping.is_set():
            # A process's sentinel becomes readable the moment it exits; the timeout only bounds
            # how late a shutdown in progress is noticed.
            multiprocessing.connection.wait([proc.sentinel for _, proc in watched], timeout=WATCH_ROUND_SECONDS)
            if stopping.is_set():
                return
            rounds += 1
            if probe_tracker and rounds % 5 == 0 and not tracker_alive():
                restart_tracker()
            for name, proc in watched:
                if not proc.is_alive():
                    on_death(name, proc.exitcode)
                    return
            # After the deaths: a child that died is reported dead, not silent.
            stalls = watchdog.stalled() if watchdog is not None else []
            # Checked again: the launcher unmaps the heartbeats only after it set ``stopping``.
            if stalls and not stopping.is_set():
                on_stall(stalls, watchdog.timeout_seconds)
                return

    thread = threading.Thread(target=run, name="child-watch", daemon=True)
    thread.start()
    return thread
