"""The processes of one server's session, read from Linux's ``/proc``.

The launcher starts every server in a session of its own (the session id is the server's pid),
so the session holds exactly the server and the processes it started.  Two questions about it
need ``/proc``:

* :func:`session_listens_on`: does a process of the session hold the socket listening on a
  port?  A ``/health`` answer on a port proves only that *some* server listens there; a port
  picked as free a moment earlier can be taken by another program before ours binds it.
* :func:`sweep_session`: kill what is left of a session after its leader exited.  A server that
  dies before its own shutdown handling is set up (a SIGTERM during start-up) or crashes leaves
  its children running.

Every function answers ``None`` where ``/proc`` cannot tell (another platform), so callers can
fall back to weaker checks.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

_PROC = Path("/proc")
_TCP_TABLES = ("net/tcp", "net/tcp6")
_LISTEN_STATE = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column
# Bound on waiting for SIGKILLed processes to die; reached only by a process stuck in the kernel.
_SWEEP_WAIT_S = 10.0


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` fields after the command name (field 3 onwards), ``None`` if gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may itself hold spaces or parentheses.
    return text.rsplit(")", 1)[-1].split()


def seconds_since_boot() -> float | None:
    """The system uptime in seconds (the clock process start times are counted on), if known."""
    try:
        return float((_PROC / "uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _session_members(session_id: int) -> list[tuple[int, float]] | None:
    """``(pid, start seconds since boot)`` of every live, non-zombie process of the session."""
    if not _PROC.is_dir():
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    members = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        # fields[0] state, [3] session id, [19] start time in clock ticks since boot.
        if fields is None or len(fields) < 20 or fields[0] in ("Z", "X"):
            continue
        if int(fields[3]) == session_id:
            members.append((int(entry.name), int(fields[19]) / ticks))
    return members


def session_alive(session_id: int) -> list[int] | None:
    """Pids of the session's processes that still run (zombies excluded); ``None`` without /proc."""
    members = _session_members(session_id)
    return None if members is None else [pid for pid, _start in members]


def _listening_inodes(port: int) -> set[int] | None:
    """Socket inodes of every TCP socket listening on ``port`` (any address); ``None`` without /proc."""
    inodes: set[int] = set()
    readable = False
    for table in _TCP_TABLES:
        try:
            lines = (_PROC / table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            # fields: sl, local address (hex ip:hex port), remote address, state, ..., inode (10th).
            if len(fields) < 10 or fields[3] != _LISTEN_STATE:
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
    return inodes if readable else None


def session_listens_on(session_id: int, port: int) -> bool | None:
    """Whether a process of the session holds a TCP socket listening on ``port``.

    ``None`` where ``/proc`` cannot tell (no ``/proc/net/tcp``); ``False`` also when nothing
    listens on the port at all.
    """
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    if not inodes:
        return False
    members = _session_members(session_id)
    if members is None:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for pid, _start in members:
        fd_dir = _PROC / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd_dir / fd) in wanted:
                    return True
            except OSError:
                continue
    return False


def sweep_session(session_id: int, leader_exited_at: float | None) -> list[int]:
    """SIGKILL every process left in the session of a leader that exited; return their pids.

    Only processes started no later than ``leader_exited_at`` (seconds since boot, when the
    leader's exit was first seen) are signalled: once the leader and all its orphans are gone
    the kernel may hand the session id to an unrelated new process, which necessarily started
    after the leader exited.  Without ``/proc`` (or without that time) the leader's process
    group, which is the session's, is signalled as a whole.
    """
    members = _session_members(session_id) if leader_exited_at is not None else None
    if members is None:
        try:
            os.killpg(session_id, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return []
    killed = []
    for pid, started in members:
        if started > leader_exited_at:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    # kill() only queues the signal: wait until they are gone (or zombies awaiting their reaper),
    # so a caller that stopped a server can rely on its processes no longer running.
    deadline = time.monotonic() + _SWEEP_WAIT_S
    while killed and time.monotonic() < deadline:
        remaining = set(session_alive(session_id) or [])
        if not remaining.intersection(killed):
            break
        time.sleep(0.02)
    return killed
