"""Names of a server's temporary resources, and removal of those left by a killed server.

A server's IPC socket folder (``<tmp>/lightllm-<pid>-<random>``) and shared-memory segments
(``/dev/shm/lightllm_<pid>_<random>_<kind>``) carry the launcher's pid.  A launcher killed with
SIGKILL cannot remove them; the next server started on the machine removes every one whose
owner pid no longer runs.  Resources of a live process (or of another user) are left alone.

Resources named with this process's own pid are never removed, even those it did not create
(:func:`new_shm_tag` records the segment tags it creates): in a container the server
is PID 1 at every start, so they may be a killed predecessor's, but two containers sharing one
``/dev/shm`` (those of one Kubernetes pod) are both PID 1 too, and a pid cannot tell a dead
predecessor from a live sibling.  docs/EN/failure_handling.md says how to clear a pod's leftovers.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import List, Optional, Set

log = logging.getLogger("lightllm.stale_resources")

SHM_DIR = Path("/dev/shm")
_IPC_DIR = re.compile(r"^lightllm-(\d+)-")
_SHM_SEGMENT = re.compile(r"^lightllm_(\d+)_")

# Segment tags this process created: the resource tracker registers these, not everything that
# carries this process's pid.
_OWN_SHM_TAGS: Set[str] = set()


def ipc_dir_prefix(pid: Optional[int] = None) -> str:
    """Prefix of the IPC socket folder of the launcher ``pid`` (default: this process)."""
    return f"lightllm-{os.getpid() if pid is None else pid}-"


def shm_segment_prefix(pid: Optional[int] = None) -> str:
    """Prefix of the shared-memory segment names of the launcher ``pid`` (default: this process)."""
    return f"lightllm_{os.getpid() if pid is None else pid}_"


def new_shm_tag() -> str:
    """A fresh segment name tag of this process (``lightllm_<pid>_<random>``), recorded as its own."""
    import uuid

    tag = f"{shm_segment_prefix()}{uuid.uuid4().hex[:8]}"
    _OWN_SHM_TAGS.add(tag)
    return tag


def make_ipc_dir() -> str:
    """Create this process's IPC socket folder in the temporary directory."""
    return tempfile.mkdtemp(prefix=ipc_dir_prefix())


def own_shm_tags() -> Set[str]:
    """The segment tags this process created (see :func:`new_shm_tag`)."""
    return set(_OWN_SHM_TAGS)


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


def _stale_owner(path: Path, pattern: re.Pattern) -> Optional[int]:
    match = pattern.match(path.name)
    if match is None:
        return None
    try:
        if path.lstat().st_uid != os.getuid():
            return None
    except OSError:
        return None
    pid = int(match.group(1))
    if pid == os.getpid():
        # Ours, or a same-pid server's in another pid namespace sharing this directory (two
        # containers of one pod are both PID 1): never removed, even when not created here.
        return None
    # A live child of ours is not treated as gone: it may be another server this program started.
    return None if pid_is_running(pid) else pid


def live_segments_of_others(shm_dir: Path = SHM_DIR) -> List[Path]:
    """Segments in ``shm_dir`` of other running servers (any user): not this process's, not stale."""
    found: List[Path] = []
    try:
        entries = list(shm_dir.iterdir())
    except OSError:
        return found
    for path in entries:
        match = _SHM_SEGMENT.match(path.name)
        if match is None:
            continue
        pid = int(match.group(1))
        # Our pid: ours, or a same-pid server's in another pid namespace (never judged; see the
        # module docstring), so not counted as another live server's either.
        if pid != os.getpid() and pid_is_running(pid):
            found.append(path)
    return found


def remove_stale_resources(temp_dir: Optional[str] = None, shm_dir: Path = SHM_DIR) -> List[str]:
    """Remove IPC folders and shared-memory segments of dead launchers; returns what was removed."""
    removed: List[str] = []
    candidates = [(Path(temp_dir or tempfile.gettempdir()), _IPC_DIR), (shm_dir, _SHM_SEGMENT)]
    for folder, pattern in candidates:
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for path in entries:
            if _stale_owner(path, pattern) is None:
                continue
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            except FileNotFoundError:
                continue  # another starting server removed it first
            except OSError as exc:
                log.warning("could not remove stale %s: %s", path, exc)
                continue
            removed.append(str(path))
    if removed:
        log.info("removed %d resource(s) left by killed servers: %s", len(removed), ", ".join(removed))
    return removed
