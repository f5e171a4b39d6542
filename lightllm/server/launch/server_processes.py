"""The children and shared resources of a running server, and how they are stopped and removed.

:func:`lightllm.server.launch.start.start_processes` fills a :class:`ServerProcesses` as it creates
the shared memory and spawns the children; the launcher calls :meth:`ServerProcesses.shutdown`
whatever way the server ends (a drain, a dead or hung child, a failed start).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from lightllm.server.core.objs.shm_heartbeats import ShmHeartbeats
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.core.objs.shm_stats import ShmStats
from lightllm.server.launch.watchdog import Watchdog
from lightllm.utils.process_utils import CHILD_STOP_SIGNAL
from lightllm.utils.owner_locks import OwnerLock

log = logging.getLogger(__name__)

# How long children get to exit after the stop signal before they are killed.
CHILD_STOP_SECONDS = 2.0
# How long the shutdown waits for the child watcher to end before it unmaps the shared memory.
WATCHER_JOIN_SECONDS = 2.0


def closing_line(children: bool, segments: bool, ipc_dir: bool) -> str:
    """The shutdown's log line saying what it stopped and removed (empty when there was nothing)."""
    removed = " and ".join(what for what, there in (("shared memory", segments), ("IPC folder", ipc_dir)) if there)
    if children:
        return f"children stopped; {removed} removed" if removed else "children stopped"
    if removed:
        return f"{removed} removed (no child process had started)"
    return ""


@dataclass
class ServerProcesses:
    """The children and shared resources of a running server."""

    children: List[Tuple[str, mp.process.BaseProcess]] = field(default_factory=list)
    shm_req: Optional[ShmReqBuffer] = None
    shm_stats: Optional[ShmStats] = None
    # The children's heartbeats (None with --watchdog_timeout 0), and who beats in which field.
    shm_heartbeats: Optional[ShmHeartbeats] = None
    heartbeat_processes: Tuple[str, ...] = ()
    ipc_dir: Optional[str] = None
    # The held owner locks of the segments and of the IPC folder (utils/owner_locks.py):
    # each is released after what it owns is removed, so no starting server removes it under us.
    shm_owner: Optional[OwnerLock] = None
    ipc_owner: Optional[OwnerLock] = None
    # The child watcher (launch/child_watch.py), which reads the heartbeats: joined before they are unmapped.
    watcher: Optional[threading.Thread] = None
    # Set before children are stopped on purpose, so their exits are not reported as failures.
    stopping: threading.Event = field(default_factory=threading.Event)

    def shutdown(self) -> None:
        """Stop every child and remove every shared resource (idempotent)."""
        self.stopping.set()
        # What there was to stop and remove, for the closing log line (a refused start had no child).
        had_children = bool(self.children)
        had_segments = any(segment is not None for segment in (self.shm_req, self.shm_stats, self.shm_heartbeats))
        if self.children:
            log.info("stopping child processes")
        for _, proc in self.children:
            if proc.is_alive() and proc.pid is not None:
                try:
                    os.kill(proc.pid, CHILD_STOP_SIGNAL)  # children ignore SIGTERM (process_utils)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + CHILD_STOP_SECONDS
        for _, proc in self.children:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for _, proc in self.children:
            if proc.is_alive():
                # SIGKILL also ends a stopped (SIGSTOP) child, which holds its SIGUSR1 until continued.
                proc.kill()
                proc.join(timeout=5)
        self.children.clear()
        watcher = self.watcher
        if watcher is not None and watcher is not threading.current_thread():
            # It sees ``stopping`` within one round (0.2 s); a read of the heartbeats in progress ends first.
            watcher.join(timeout=WATCHER_JOIN_SECONDS)
        self.watcher = None
        for segment in (self.shm_req, self.shm_stats, self.shm_heartbeats):
            if segment is not None:
                try:
                    segment.close()
                except BufferError:
                    # Another thread still reads through a view of it (the mapping goes with that view);
                    # the name is removed all the same, so nothing stays in /dev/shm.
                    log.debug("shared-memory segment %s still in use by a reader; unlinking it anyway", segment.name)
                segment.unlink()
        self.shm_req = self.shm_stats = self.shm_heartbeats = None
        if self.shm_owner is not None:
            self.shm_owner.release()
            self.shm_owner = None
        had_ipc_dir = bool(self.ipc_dir)
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None
        if self.ipc_owner is not None:
            self.ipc_owner.release()
            self.ipc_owner = None
        line = closing_line(had_children, had_segments, had_ipc_dir)
        if line:
            log.info("%s", line)

    def watchdog(self, timeout_seconds: float) -> Optional[Watchdog]:
        """The check of the children's heartbeats (``--watchdog_timeout``), or None when none is watched."""
        block = self.shm_heartbeats
        if block is None or timeout_seconds <= 0:
            return None
        return Watchdog(timeout_seconds, self.heartbeat_processes, block.last_beat)
