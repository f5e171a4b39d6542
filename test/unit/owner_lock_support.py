"""Real processes holding a server's resource groups (utils/stale_resources.py), for tests.

A holder creates a server's two groups through the real functions, the lock first as the
launcher does, in directories standing for ``/dev/shm`` and the temp dir, and holds their locks
until it is killed.  A server in another PID namespace looks, from here, like a group whose name
carries a pid that is not running (or our own) while a live process holds its lock:
:func:`rename_pid` renames a holder's names so (a rename keeps the file, and the lock is on the file).

Another user is played by a forked child that drops root for ``nobody`` (:func:`as_another_user`,
:func:`held_by_another_user`; root only: this Python may not be executable by ``nobody``, so the
child is forked, not started), in directories every user may enter (:func:`shared_dirs`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, List, Sequence, Tuple

import pytest

import lightllm
from lightllm.utils.owner_locks import ipc_dir_prefix, shm_segment_prefix
from lightllm.utils.stale_resources import pid_is_running

# argv: shm dir, temp dir, and "child" to start a child (with every inheritable descriptor, in a
# session of its own) first.
HOLDER = """
import subprocess, sys, time
from pathlib import Path
from lightllm.utils.owner_locks import claim_shm_tag, create_ipc_dir
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


# The other user of the cross-user tests.
NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")


@contextlib.contextmanager
def shared_dirs() -> Iterator[Tuple[Path, Path]]:
    """A temp dir and a shm dir (sticky and open to every user, as /tmp and /dev/shm) that another
    user can reach: pytest's tmp_path is root's alone."""
    root = Path(tempfile.mkdtemp(prefix="owner-lock-test-"))
    try:
        root.chmod(0o755)
        temp_dir, shm_dir = root / "tmp", root / "shm"
        for folder in (temp_dir, shm_dir):
            folder.mkdir()
            folder.chmod(0o1777)
        yield temp_dir, shm_dir
    finally:
        shutil.rmtree(root)


def _become_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def as_another_user(work: Callable[[], Any]) -> Any:
    """What ``work`` returns when run as ``nobody``, in a forked child (its exception, re-raised here
    as an AssertionError naming it)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(read)
            _become_nobody()
            result = ("ok", work())
        except BaseException as exc:  # reported to the parent, whatever it is
            result = ("error", repr(exc))
        try:
            with os.fdopen(write, "wb") as out:
                pickle.dump(result, out)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        data = answer.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    if kind != "ok":
        raise AssertionError(f"as user {NOBODY}: {value}")
    return value


def open_fails_for_another_user(path: Path) -> bool:
    """Whether ``nobody`` is refused opening ``path`` for reading (a flock needs no more).

    A readable file beside it must open: a refusal on the way to the folder (a temp dir
    ``nobody`` cannot enter) would otherwise pass for the file's own mode.
    """
    probe = path.parent / f"{path.name}.reachable"
    probe.touch(mode=0o644)
    probe.chmod(0o644)

    def try_open() -> bool:
        os.close(os.open(probe, os.O_RDONLY | os.O_NONBLOCK))  # raises if the folder is out of reach
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        except PermissionError:
            return True
        return False

    try:
        return as_another_user(try_open)
    finally:
        probe.unlink()


@contextlib.contextmanager
def held_by_another_user(paths: Sequence[Path]) -> Iterator[None]:
    """``nobody`` creates the files ``paths`` (its own) and holds a flock on each until the block ends."""
    ready_read, ready_write = os.pipe()
    stop_read, stop_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(ready_read)
            os.close(stop_write)
            _become_nobody()
            for path in paths:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(ready_write, b"1")
            os.read(stop_read, 1)  # until the parent closes its end
        finally:
            os._exit(0)
    os.close(ready_write)
    os.close(stop_read)
    try:
        assert os.read(ready_read, 1) == b"1", "the other user's holder failed"
        yield
    finally:
        os.close(stop_write)
        os.close(ready_read)
        os.waitpid(pid, 0)
