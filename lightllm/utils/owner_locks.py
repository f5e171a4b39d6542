"""A server's own temporary resources: their names, and the owner locks its launcher holds on them.

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

A creator that finds its new lock file locked by someone else in the instant before it locks it (a
cleaner, or another server's capacity probe, which takes a free lock for a moment and removes
nothing) removes the file itself while it is still at its name, and starts over with a new name.

Only the launcher holds the lock: the descriptor is close-on-exec and the children are spawned, so
none inherits it.  The launcher outlives its children in a normal stop; when it is killed they die
with it (``PR_SET_PDEATHSIG``, :mod:`lightllm.utils.process_utils`), so a group whose lock is free
is at most a few milliseconds away from having no process at all, and removing a segment's name
leaves a mapping a dying child still has intact.  The segments' lock file is registered with
multiprocessing's resource tracker like the segments, so a killed launcher leaves nothing in
``/dev/shm`` when the tracker survives it.

Lock files are readable by their owner alone (0600): a process of another user could otherwise
open one and take or hold its lock.  How other servers judge these groups, and remove those of a
server that is gone, is :mod:`lightllm.utils.stale_resources`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

log = logging.getLogger("lightllm.owner_locks")

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
class GroupNaming:
    """How one kind of group is named: ``pattern``'s group 1 is the group's name, group 2 its pid."""

    pattern: "re.Pattern[str]"
    lock_suffix: str


IPC_NAMING = GroupNaming(re.compile(r"^(lightllm-(\d+)-.*?)(?:\.owner)?$"), ".owner")
SHM_NAMING = GroupNaming(re.compile(r"^(lightllm_(\d+)_[^_]*)"), SHM_LOCK_SUFFIX)

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
            if still_named(fd, self.lock_path):
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


def still_named(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a cleaner may have removed it)."""
    try:
        opened, named = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (opened.st_dev, opened.st_ino) == (named.st_dev, named.st_ino)


def _create_locked(folder: Path, naming: GroupNaming, prefix: str) -> Tuple[str, Path, Optional[int]]:
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
            if still_named(fd, path):
                path.unlink(missing_ok=True)
            os.close(fd)
            continue
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            log.warning("no flock in %s (%s): its resources are judged by their pid, as an older server's", folder, exc)
            return name, path, None
        if still_named(fd, path):
            return name, path, fd
        os.close(fd)  # a cleaner took it and removed it before we locked it
    raise OSError(f"could not create an owner lock file in {folder}")


def claim_shm_tag(shm_dir: Path = SHM_DIR) -> OwnerLock:
    """A fresh segment name tag of this process (``lightllm_<pid>_<random>``, the lock's ``name``),
    owned through its lock file, created and locked before any segment of it exists."""
    tag, path, fd = _create_locked(shm_dir, SHM_NAMING, shm_segment_prefix())
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
    name, path, fd = _create_locked(folder, IPC_NAMING, ipc_dir_prefix())
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
    return {name for name in _OWN_GROUPS if SHM_NAMING.pattern.match(name)}


def held_shm_locks() -> List[OwnerLock]:
    """This process's held segment owner locks."""
    return [lock for lock in _HELD.values() if SHM_NAMING.pattern.match(lock.name)]


def created_here(name: str) -> bool:
    """Whether this process created the group ``name`` (it never removes those)."""
    return name in _OWN_GROUPS
