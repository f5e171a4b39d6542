"""A server's temporary resources: their names, who owns them, and removal of those left by a killed server.

A server's resources outside its processes form two groups, each named after the launcher's pid and a
random part, and each owned through a lock file of its own:

- the IPC socket folder ``<tmp>/lightllm-<pid>-<random>``, owned through ``<tmp>/lightllm-<pid>-<random>.owner``;
- the shared-memory segments ``/dev/shm/lightllm_<pid>_<random>_<kind>``, owned through
  ``/dev/shm/lightllm_<pid>_<random>_owner``.

Ownership is a lock, not the pid in the name.  The launcher creates a group's lock file before
anything else of the group (:func:`claim_shm_tag`, :func:`create_ipc_dir`) and holds an exclusive
``flock`` on it for its whole life.  The kernel keeps a flock on the file itself and lets it go only
when the holder is gone, however it ended and whatever PID namespace it ran in; so a starting
server that can take a group's lock (``LOCK_EX | LOCK_NB``) knows its owner is dead, and one that
cannot knows it lives.  A pid could not tell either: in a container the server is PID 1 at every
start, so a killed predecessor's ``lightllm_1_*`` carried the new server's own pid and were never
removed, while a server in another PID namespace sharing the directory (another container) carried
a pid not running here, and its live segments were removed under it.  Now both are judged by their
lock: the predecessor's is free (removed), the live one's is held (kept).

Removal holds the lock it took: the segments (or the folder) first, the lock file last.  A second
server cleaning up at the same time either fails to take the lock or takes it on a file no longer
at its name (checked), and leaves the group alone.  A creator that finds its new lock file locked
by someone else in the instant before it locks it (a cleaner, or another server's capacity probe,
which takes a free lock for a moment and removes nothing) removes the file itself while it is still
at its name, and starts over with a new name.

Only the launcher holds the lock: the descriptor is close-on-exec and the children are spawned, so
none inherits it.  The launcher outlives its children in a normal stop; when it is killed they die
with it (``PR_SET_PDEATHSIG``, :mod:`lightllm.utils.process_utils`), so a group whose lock is free
is at most a few milliseconds away from having no process at all, and removing a segment's name
leaves a mapping a dying child still has intact.  The segments' lock file is registered with
multiprocessing's resource tracker like the segments, so a killed launcher leaves nothing in
``/dev/shm`` when the tracker survives it.

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
import re
import secrets
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

log = logging.getLogger("lightllm.stale_resources")

SHM_DIR = Path("/dev/shm")
# Length of a group name's random part (the IPC socket path check in launch/plan.py counts it).
RANDOM_CHARS = 8
# What follows a segment tag in the name of the segments' owner lock file (no segment itself).
SHM_LOCK_SUFFIX = "_owner"
# Owner lock files are their owner's alone (see the module docstring).
LOCK_FILE_MODE = 0o600
# Tries for a fresh lock file name: only someone holding the new file's lock in the instant before
# its creator locks it, or an existing name, costs one.
_CREATE_TRIES = 16


@dataclass(frozen=True)
class _Naming:
    """How one kind of group is named: ``pattern``'s group 1 is the group's name, group 2 its pid."""

    pattern: "re.Pattern[str]"
    lock_suffix: str


_IPC = _Naming(re.compile(r"^(lightllm-(\d+)-.*?)(?:\.owner)?$"), ".owner")
_SHM = _Naming(re.compile(r"^(lightllm_(\d+)_[^_]*)"), SHM_LOCK_SUFFIX)

# Names of the groups this process created (segment tags, IPC folder names): never removed by it.
_OWN_GROUPS: Set[str] = set()


class OwnerLock:
    """This process's held lock on one of its resource groups (see the module docstring)."""

    def __init__(self, name: str, lock_path: Path, fd: Optional[int], tracked: bool) -> None:
        self.name = name  # the segments' tag, or the IPC folder's name
        self.lock_path = lock_path
        self._fd = fd  # None: no flock on this file system, the group is judged by its pid
        self._tracked = tracked

    @property
    def held(self) -> bool:
        """Whether the lock is still held (not released, and taken at all)."""
        return self._fd is not None

    def tracker_name(self) -> Optional[str]:
        """The lock file's name as multiprocessing's resource tracker has it, None when not tracked."""
        return f"/{self.lock_path.name}" if self._tracked and self._fd is not None else None

    def release(self) -> None:
        """Remove the lock file, then let the lock go (idempotent).

        Call it after the group's other resources are gone: while the file exists and is held,
        nobody removes them.
        """
        fd, self._fd = self._fd, None
        _HELD.pop(self.name, None)
        if fd is None:
            return
        try:
            if _still_named(fd, self.lock_path):
                self.lock_path.unlink()
        except OSError as exc:
            log.warning("could not remove the owner lock %s: %s", self.lock_path, exc)
        if self._tracked:
            from multiprocessing import resource_tracker

            resource_tracker.unregister(f"/{self.lock_path.name}", "shared_memory")
        os.close(fd)


# The held locks, so that their descriptors stay open for the process's life whoever keeps the
# OwnerLock (an int descriptor is never closed by the garbage collector, but a lost one could not
# be released at a normal stop).
_HELD: Dict[str, OwnerLock] = {}


def ipc_dir_prefix(pid: Optional[int] = None) -> str:
    """Prefix of the IPC socket folder of the launcher ``pid`` (default: this process)."""
    return f"lightllm-{os.getpid() if pid is None else pid}-"


def shm_segment_prefix(pid: Optional[int] = None) -> str:
    """Prefix of the shared-memory segment names of the launcher ``pid`` (default: this process)."""
    return f"lightllm_{os.getpid() if pid is None else pid}_"


def _still_named(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a cleaner may have removed it)."""
    try:
        opened, named = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (opened.st_dev, opened.st_ino) == (named.st_dev, named.st_ino)


def _create_locked(folder: Path, naming: _Naming, prefix: str) -> Tuple[str, Path, Optional[int]]:
    """A new group name in ``folder`` and its lock file, created and locked; the descriptor is
    None where the file system has no flock (the file is then removed again)."""
    for _ in range(_CREATE_TRIES):
        name = f"{prefix}{secrets.token_hex(RANDOM_CHARS // 2)}"
        path = folder / f"{name}{naming.lock_suffix}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, LOCK_FILE_MODE)
        except FileExistsError:
            continue
        try:
            # Whatever the umask: no other user may open it, so none can take or hold the lock.
            os.fchmod(fd, LOCK_FILE_MODE)
        except OSError as exc:
            # A file system without modes (some FUSE/CIFS mounts): the lock still works.
            log.warning("could not make the owner lock file %s private (%s)", path, exc)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # A cleaner (which removes the file) or a capacity probe (which removes nothing) has it
            # for a moment: the file is ours (O_EXCL), and an empty lock file must not stay behind.
            if _still_named(fd, path):
                path.unlink(missing_ok=True)
            os.close(fd)
            continue
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            log.warning("no flock in %s (%s): its resources are judged by their pid, as an older server's", folder, exc)
            return name, path, None
        if _still_named(fd, path):
            return name, path, fd
        os.close(fd)  # a cleaner took it and removed it before we locked it
    raise OSError(f"could not create an owner lock file in {folder}")


def claim_shm_tag(shm_dir: Path = SHM_DIR) -> OwnerLock:
    """A fresh segment name tag of this process (``lightllm_<pid>_<random>``, the lock's ``name``),
    owned through its lock file, created and locked before any segment of it exists."""
    tag, path, fd = _create_locked(shm_dir, _SHM, shm_segment_prefix())
    tracked = fd is not None and shm_dir == SHM_DIR  # the tracker removes names in /dev/shm only
    if tracked:
        from multiprocessing import resource_tracker

        # So that a killed launcher's tracker removes the lock file with the segments.
        resource_tracker.register(f"/{path.name}", "shared_memory")
    return _record(OwnerLock(tag, path, fd, tracked))


def ipc_temp_dir() -> str:
    """The temporary directory the IPC folder goes to: Python's choice, ``$TMPDIR`` when usable.

    Python passes over a ``$TMPDIR`` that is missing or not writable and falls back to ``/tmp``
    (then ``/var/tmp``, ``/usr/tmp``, the working directory) without a word: that is logged as a
    warning here.  :class:`ValueError` (one line) when no candidate is usable.
    """
    try:
        chosen = tempfile.gettempdir()
    except FileNotFoundError as exc:  # Python's own "No usable temporary directory found in [...]"
        raise ValueError(f"no temporary directory for the server's IPC folder: {exc}; set TMPDIR to a writable "
                         "directory") from exc
    wanted = os.environ.get("TMPDIR")
    if wanted and os.path.abspath(wanted) != os.path.abspath(chosen):
        log.warning("TMPDIR=%s is not a writable directory: the server's IPC folder goes to %s instead", wanted, chosen)
    return chosen


def create_ipc_dir(temp_dir: Optional[str] = None) -> Tuple[str, OwnerLock]:
    """Create this process's IPC socket folder in ``temp_dir`` (default: the temporary directory)
    after its lock file; returns the folder's path and the lock."""
    folder = Path(temp_dir or tempfile.gettempdir())
    name, path, fd = _create_locked(folder, _IPC, ipc_dir_prefix())
    lock = _record(OwnerLock(name, path, fd, tracked=False))
    try:
        os.mkdir(folder / name, 0o700)
    except BaseException:
        lock.release()
        raise
    return str(folder / name), lock


def _record(lock: OwnerLock) -> OwnerLock:
    _OWN_GROUPS.add(lock.name)
    if lock.held:
        _HELD[lock.name] = lock
    return lock


def own_shm_tags() -> Set[str]:
    """The segment tags this process created (see :func:`claim_shm_tag`)."""
    return {name for name in _OWN_GROUPS if _SHM.pattern.match(name)}


def held_shm_locks() -> List[OwnerLock]:
    """This process's held segment owner locks."""
    return [lock for lock in _HELD.values() if _SHM.pattern.match(lock.name)]


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


def _group_name(path: Path, naming: _Naming) -> Optional[str]:
    match = naming.pattern.match(path.name)
    return None if match is None else match.group(1)


def _groups(folder: Path, naming: _Naming) -> List[_Group]:
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
    if not _still_named(fd, path):
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
    for group in _groups(shm_dir, _SHM):
        if group.name in _OWN_GROUPS or not group.members:
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


def _remove_if_stale(group: _Group, naming: _Naming) -> List[str]:
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
    for folder, naming in ((Path(temp_dir or tempfile.gettempdir()), _IPC), (shm_dir, _SHM)):
        for group in _groups(folder, naming):
            if group.name not in _OWN_GROUPS:
                removed.extend(_remove_if_stale(group, naming))
    if removed:
        log.info("removed %d resource(s) left by killed servers: %s", len(removed), ", ".join(removed))
    return removed
