"""Removal of the temporary resources a killed server left, judged by their owner locks.

A server's resource groups and the owner locks its launcher holds on them are described in
:mod:`lightllm.utils.owner_locks`.  A starting server that can take a group's lock
(``LOCK_EX | LOCK_NB``) knows its owner is dead, and one that cannot knows it lives.

Removal holds the lock it took: the segments (or the folder) first, the lock file last.  A second
server cleaning up at the same time either fails to take the lock or takes it on a file no longer
at its name (checked), and leaves the group alone.

Lock files are readable by their owner alone (0600): a process of another user could otherwise
open one and take or hold its lock (a blocking ``flock`` queued on a live server's lock even gets
it the moment the launcher dies), and keep a dead server's group from ever being removed.  So
another user's server cannot test our locks, and its capacity check judges our groups by the pid
rule below (a server of ours in another PID namespace is not counted there).  And a lock file whose
owner is not the owner of the group's members is no lock of theirs (another user may create a file
at a name in our group that has none, such as an older server's): those members are judged by the
pid rule too.

The pid rule judges groups without a lock file (made by an older version of the server, or on a file
system without flock) and groups whose lock cannot be tested (flock refused, or not a regular file
at the lock's name; a warning names the directory once): such a group is removed when its pid no
longer runs here and is not this process's own, and counted as live otherwise.  Only this user's
resources are ever removed, and never a group this process created.
"""

from __future__ import annotations

import enum
import fcntl
import logging
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

from lightllm.utils.owner_locks import IPC_NAMING, SHM_DIR, SHM_NAMING, GroupNaming, created_here, still_named

log = logging.getLogger("lightllm.stale_resources")


def pid_is_running(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie counts as gone, it holds nothing)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


class _Lock(enum.Enum):
    HELD = "held by a live process"
    FREE = "taken here: the owner is dead"
    REMOVED = "removed or replaced since it was listed"
    MISSING = "no lock file: judged by the pid rule"
    FOREIGN = "another owner's file than the group's: no lock of the group, judged by the pid rule"
    UNREADABLE = "another user's lock file, closed to us: judged by the pid rule"
    UNKNOWN = "cannot be tested (no flock, or not a regular file): judged by the pid rule, as without a lock file"


# The lock states under which a group is judged by its pid, as one without a lock file.
_BY_PID = frozenset({_Lock.MISSING, _Lock.FOREIGN, _Lock.UNREADABLE, _Lock.UNKNOWN})
# Directories whose untestable lock was already reported: one warning each per process.
_WARNED_DIRS: Set[Path] = set()


@dataclass
class _Group:
    name: str
    pid: int
    lock: Path
    members: List[Path] = field(default_factory=list)  # everything of the group but its lock file


def _entries(folder: Path) -> List[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def _group_name(path: Path, naming: GroupNaming) -> Optional[str]:
    match = naming.pattern.match(path.name)
    return None if match is None else match.group(1)


def _groups(folder: Path, naming: GroupNaming) -> List[_Group]:
    """The groups whose names appear in ``folder`` (a group may show only its lock file, or lack it)."""
    groups: Dict[str, _Group] = {}
    for path in _entries(folder):
        match = naming.pattern.match(path.name)
        if match is None:
            continue
        name = match.group(1)
        group = groups.setdefault(name, _Group(name, int(match.group(2)), folder / f"{name}{naming.lock_suffix}"))
        if path.name != group.lock.name:
            group.members.append(path)
    return list(groups.values())


def _untestable(path: Path, why: object) -> _Lock:
    """UNKNOWN, with a warning naming ``path``'s directory the first time in this process."""
    if path.parent not in _WARNED_DIRS:
        _WARNED_DIRS.add(path.parent)
        log.warning("cannot test the owner lock %s (%s): groups in %s whose lock cannot be tested are judged by "
                    "their pid, as those without a lock file", path, why, path.parent)
    return _Lock.UNKNOWN


def _try_lock(path: Path, owner_uid: Optional[int] = None) -> Tuple[_Lock, Optional[int], Optional[int]]:
    """Try to take ``path``'s lock without waiting: its state, the descriptor (to close) when it was
    taken, and the lock file's owner uid when known.

    ``owner_uid``: the owner of the group's members, when known; a lock file of another owner is
    no lock of theirs (FOREIGN) and is not opened.
    """
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return _Lock.MISSING, None, None
    except OSError as exc:
        return _untestable(path, exc), None, None
    uid = named.st_uid
    if owner_uid is not None and uid != owner_uid:
        return _Lock.FOREIGN, None, uid
    if not stat.S_ISREG(named.st_mode):
        return _untestable(path, "not a regular file"), None, uid
    try:
        # O_NONBLOCK: a FIFO put there since the lstat must not hang the start.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return _Lock.REMOVED, None, uid
    except PermissionError as exc:
        # Another user's lock file is theirs alone (0600): documented, not worth a warning.
        return (_Lock.UNREADABLE if uid != os.geteuid() else _untestable(path, exc)), None, uid
    except OSError as exc:
        return _untestable(path, exc), None, uid
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (named.st_dev, named.st_ino):
            os.close(fd)
            return _Lock.REMOVED, None, uid
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return _Lock.HELD, None, uid
    except OSError as exc:
        os.close(fd)
        return _untestable(path, exc), None, uid
    if not still_named(fd, path):
        os.close(fd)
        return _Lock.REMOVED, None, uid
    return _Lock.FREE, fd, uid


def _lives_by_pid(pid: int) -> bool:
    """The pid rule in the capacity check: a group's owner runs when its pid runs here and is not
    this process's own (our pid in a name is a same-pid server's in another namespace or our own
    leftover: not counted, though never removed either, see :func:`_remove_by_pid`)."""
    return pid != os.getpid() and pid_is_running(pid)


def live_segments_of_others(shm_dir: Path = SHM_DIR) -> List[Path]:
    """Segments in ``shm_dir`` of other running servers (any user, any PID namespace): not this process's.

    A free lock taken here is let go at once (a flock belongs to that descriptor alone: closing it
    touches nobody else's).  Where the lock says nothing of a segment (no lock file, another
    owner's file, another user's lock closed to us, untestable), the pid rule judges it.
    """
    found: List[Path] = []
    for group in _groups(shm_dir, SHM_NAMING):
        if created_here(group.name) or not group.members:
            continue
        state, fd, lock_uid = _try_lock(group.lock)
        if fd is not None:
            os.close(fd)
        for member in group.members:
            try:
                member_uid = member.lstat().st_uid
            except OSError:
                continue  # its server removed it since the listing
            judged = state if lock_uid is None or member_uid == lock_uid else _Lock.FOREIGN
            if judged is _Lock.HELD or (judged in _BY_PID and _lives_by_pid(group.pid)):
                found.append(member)
    return found


def _mine(path: Path) -> bool:
    try:
        return path.lstat().st_uid == os.geteuid()
    except OSError:
        return False


def _remove(path: Path) -> bool:
    """Remove ``path`` (a folder with its contents); False when it was not there or could not be."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return False  # another starting server removed it first
    except OSError as exc:
        log.warning("could not remove stale %s: %s", path, exc)
        return False
    return True


def _remove_by_pid(group: _Group) -> List[str]:
    """The pid rule's removal: this user's part of ``group`` when its pid no longer runs and is not
    this process's own (a same-pid server's in another namespace, perhaps live), a lock file there last."""
    if group.pid == os.getpid() or pid_is_running(group.pid):
        return []
    removed = [str(path) for path in group.members if _mine(path) and _remove(path)]
    if _mine(group.lock) and _remove(group.lock):  # an untestable one of ours, not another user's
        removed.append(str(group.lock))
    return removed


def _remove_if_stale(group: _Group, naming: GroupNaming) -> List[str]:
    """Remove this user's part of ``group`` when its owner is dead; returns what was removed."""
    state, fd, _ = _try_lock(group.lock, os.geteuid())
    if state in _BY_PID:
        # No lock of ours to go by: an older server's group, one on a file system without flock, or a
        # file another user put at the lock's name (which must not keep our leftovers forever).
        return _remove_by_pid(group)
    if fd is None:
        return []  # held by its live owner (any namespace), or removed since the listing
    try:
        # Listed again under the lock: nothing of a dead owner's can appear any more.
        members = [path for path in _entries(group.lock.parent) if path != group.lock
                   and _group_name(path, naming) == group.name]
        removed = [str(path) for path in members if _mine(path) and _remove(path)]
        if _remove(group.lock):  # last, while held: see the module docstring
            removed.append(str(group.lock))
        return removed
    finally:
        os.close(fd)


def remove_stale_resources(temp_dir: Optional[str] = None, shm_dir: Path = SHM_DIR) -> List[str]:
    """Remove the IPC folders and shared-memory segments of dead launchers; returns what was removed."""
    removed: List[str] = []
    for folder, naming in ((Path(temp_dir or tempfile.gettempdir()), IPC_NAMING), (shm_dir, SHM_NAMING)):
        for group in _groups(folder, naming):
            if not created_here(group.name):
                removed.extend(_remove_if_stale(group, naming))
    if removed:
        log.info("removed %d resource(s) left by killed servers: %s", len(removed), ", ".join(removed))
    return removed
