"""Real processes holding a server's resource groups (utils/stale_resources.py), for tests.

A holder creates a server's two groups through the real functions, the lock first as the
launcher does, in directories standing for ``/dev/shm`` and the temp dir, and holds their locks
until it is killed.  A server in another PID namespace looks, from here, like a group whose name
carries a pid that is not running (or our own) while a live process holds its lock:
:func:`rename_pid` renames a holder's names so (a rename keeps the file, and the lock is on the file).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Sequence, Tuple

import lightllm
from lightllm.utils.stale_resources import ipc_dir_prefix, pid_is_running, shm_segment_prefix

# argv: shm dir, temp dir, and "child" to start a child (with every inheritable descriptor, in a
# session of its own) first.
HOLDER = """
import subprocess, sys, time
from pathlib import Path
from lightllm.utils.stale_resources import claim_shm_tag, create_ipc_dir
shm_dir, temp_dir = Path(sys.argv[1]), sys.argv[2]
owner = claim_shm_tag(shm_dir)
with open(shm_dir / f"{owner.name}_req", "wb") as segment:
    segment.truncate(1 << 30)  # sparse, as the server's: untouched pages another server must not count as free
for kind in ("req_top", "stats"):
    (shm_dir / f"{owner.name}_{kind}").write_bytes(b"x")
ipc_dir, ipc_owner = create_ipc_dir(temp_dir)
(Path(ipc_dir) / "router.sock").write_bytes(b"")
child = 0
if sys.argv[3:] == ["child"]:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], close_fds=False,
                             start_new_session=True).pid
print(owner.name, Path(ipc_dir).name, child, flush=True)
time.sleep(120)
"""
REPO = str(Path(lightllm.__file__).resolve().parent.parent)


def hold(shm_dir: Path, temp_dir: Path, *extra: str, prefix: Sequence[str] = ()) -> Tuple[subprocess.Popen, List[str]]:
    """A live holder of a group in each directory, and what it printed (tag, IPC folder name, child pid)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([*prefix, sys.executable, "-c", HOLDER, str(shm_dir), str(temp_dir), *extra],
                            stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    line = proc.stdout.readline().split()
    assert len(line) == 3, f"the holder printed {line!r} (exit {proc.poll()})"
    return proc, line


def _children(pid: int) -> List[int]:
    found: List[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the holder's process group (with unshare, the namespace's init too) and wait until
    every process of it is gone: its locks go with the last one."""
    inner = _children(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    proc.stdout.close()
    deadline = time.monotonic() + 30
    while any(pid_is_running(pid) for pid in inner) and time.monotonic() < deadline:
        time.sleep(0.02)


def _rename(folder: Path, old: str, new: str) -> None:
    for path in folder.iterdir():
        if path.name.startswith(old):
            path.rename(folder / (new + path.name[len(old):]))


def rename_pid(shm_dir: Path, temp_dir: Path, holder: int, printed: List[str], pid: int) -> None:
    """Rename the groups ``holder`` printed (:func:`hold`) to carry ``pid`` in place of its own."""
    tag, ipc_name = printed[0], printed[1]
    _rename(shm_dir, tag, tag.replace(shm_segment_prefix(holder), shm_segment_prefix(pid), 1))
    _rename(temp_dir, ipc_name, ipc_name.replace(ipc_dir_prefix(holder), ipc_dir_prefix(pid), 1))


def dead_pid() -> int:
    """A pid that ran and no longer does."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
