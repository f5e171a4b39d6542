"""Removal of IPC folders and shared-memory segments whose owner is gone, judged by the owner's lock.

The groups are made by real processes through the real functions (owner_lock_support.py) in
temporary directories standing for ``/dev/shm`` and the temp dir; another PID namespace's server
is such a group renamed to carry a pid that is not running here, or our own.  Where ``unshare``
works without privileges, one test runs the holder in a real PID namespace.  Another user is a
forked child as ``nobody`` (root only).  A file system without flock is simulated by patching
``fcntl.flock`` in this process: it stands for the file system, not for the code under test.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, List, Tuple

import pytest

from lightllm.server.launch.server_processes import ServerProcesses
from lightllm.utils.owner_locks import claim_shm_tag, create_ipc_dir, ipc_dir_prefix, shm_segment_prefix
from lightllm.utils.stale_resources import live_segments_of_others, pid_is_running, remove_stale_resources
from owner_lock_support import (dead_pid, held_by_another_user, hold, kill, needs_root, open_fails_for_another_user,
                                rename_pid, shared_dirs)


def _dirs(tmp_path: Path) -> Tuple[Path, Path]:
    temp_dir, shm_dir = tmp_path / "tmp", tmp_path / "shm"
    temp_dir.mkdir()
    shm_dir.mkdir()
    return temp_dir, shm_dir


def _names(folder: Path) -> List[str]:
    return sorted(path.name for path in folder.iterdir())


def test_a_live_owner_keeps_its_group_whatever_pid_its_name_carries(tmp_path: Path) -> None:
    # Another PID namespace's live server (its pid not running here), and a same-pid live sibling
    # (containers of one pod are both PID 1): the pid said "dead" and "ours", the lock says "live".
    temp_dir, shm_dir = _dirs(tmp_path)
    dead = dead_pid()
    holders = []
    for pid in (dead, os.getpid()):
        proc, printed = hold(shm_dir, temp_dir)
        holders.append(proc)
        rename_pid(shm_dir, temp_dir, proc.pid, printed, pid)
    before = (_names(temp_dir), _names(shm_dir))
    assert len(before[0]) == 4 and len(before[1]) == 8  # folder + lock, 3 segments + lock, twice
    assert any(name.startswith(shm_segment_prefix(dead)) for name in before[1])

    assert remove_stale_resources(str(temp_dir), shm_dir) == []
    assert (_names(temp_dir), _names(shm_dir)) == before

    # Killed: the kernel let the locks go, and everything goes, the lock files last.
    for proc in holders:
        kill(proc)
    removed = remove_stale_resources(str(temp_dir), shm_dir)
    assert sorted(removed) == sorted([str(temp_dir / name) for name in before[0]] +
                                     [str(shm_dir / name) for name in before[1]])
    assert _names(temp_dir) == [] and _names(shm_dir) == []
    assert remove_stale_resources(str(temp_dir), shm_dir) == []


def test_a_same_pid_leftover_with_a_free_lock_is_removed(tmp_path: Path) -> None:
    # A container's killed server: PID 1 again at the next start, its lock file held by nobody.
    temp_dir, shm_dir = _dirs(tmp_path)
    segments = [shm_dir / f"{shm_segment_prefix()}0ld0ld00_{kind}" for kind in ("req", "stats")]
    shm_lock = shm_dir / f"{shm_segment_prefix()}0ld0ld00_owner"
    folder = temp_dir / f"{ipc_dir_prefix()}0ld0ld00"
    folder_lock = temp_dir / f"{folder.name}.owner"
    folder.mkdir()
    for path in (*segments, shm_lock, folder / "router.sock", folder_lock):
        path.write_bytes(b"")

    removed = remove_stale_resources(str(temp_dir), shm_dir)

    assert sorted(removed) == sorted(str(path) for path in (*segments, shm_lock, folder, folder_lock))
    # Each group's lock file goes after the rest of it.
    assert removed.index(str(folder_lock)) > removed.index(str(folder))
    assert all(removed.index(str(shm_lock)) > removed.index(str(segment)) for segment in segments)
    assert _names(temp_dir) == [] and _names(shm_dir) == []


def test_children_do_not_hold_the_lock(tmp_path: Path) -> None:
    # The launcher alone holds it: a child it started (with every inheritable descriptor) does not
    # keep a killed launcher's group alive.
    temp_dir, shm_dir = _dirs(tmp_path)
    proc, (_, _, child) = hold(shm_dir, temp_dir, "child")
    try:
        proc.kill()  # the holder alone: the child runs in a session of its own
        proc.wait(30)
        proc.stdout.close()
        assert pid_is_running(int(child))
        assert len(remove_stale_resources(str(temp_dir), shm_dir)) == 6
    finally:
        os.kill(int(child), signal.SIGKILL)


def test_groups_without_a_lock_file_follow_the_pid_rule(tmp_path: Path) -> None:
    # Made by an older server: removed when their pid no longer runs, never with our own pid.
    temp_dir, shm_dir = _dirs(tmp_path)
    dead = dead_pid()
    assert not pid_is_running(dead)
    stale_dir = temp_dir / f"{ipc_dir_prefix(dead)}abc"
    (stale_dir / "sub").mkdir(parents=True)
    (stale_dir / "router.sock").write_bytes(b"")
    stale_segment = shm_dir / f"{shm_segment_prefix(dead)}1234abcd_req"
    stale_segment.write_bytes(b"x")
    kept = [temp_dir / f"{ipc_dir_prefix(os.getppid())}abc", temp_dir / f"{ipc_dir_prefix()}zz9old"]
    for folder in kept:
        folder.mkdir()
    kept += [shm_dir / f"{shm_segment_prefix(pid)}1234abcd_req" for pid in (os.getppid(), os.getpid())]
    for segment in kept[2:]:
        segment.write_bytes(b"x")
    # Names without an owner pid (other programs) are never touched.
    foreign = [temp_dir / "lightllm-xyz", shm_dir / "lightllm_notapid_req", shm_dir / f"other_{dead}_x"]
    foreign[0].mkdir()
    foreign[1].write_bytes(b"x")
    foreign[2].write_bytes(b"x")

    removed = remove_stale_resources(str(temp_dir), shm_dir)

    assert sorted(removed) == sorted([str(stale_dir), str(stale_segment)])
    assert all(path.exists() for path in kept + foreign)
    assert remove_stale_resources(str(temp_dir), shm_dir) == []


def test_this_process_groups_are_kept_and_removed_at_a_normal_stop(tmp_path: Path) -> None:
    temp_dir, shm_dir = _dirs(tmp_path)
    owner = claim_shm_tag(shm_dir)
    assert owner.name.startswith(shm_segment_prefix()) and owner.lock_path == shm_dir / f"{owner.name}_owner"
    segments = [shm_dir / f"{owner.name}_{kind}" for kind in ("req", "stats")]
    for segment in segments:
        segment.write_bytes(b"x")
    ipc_dir, ipc_owner = create_ipc_dir(str(temp_dir))
    assert Path(ipc_dir).parent == temp_dir and Path(ipc_dir).name.startswith(ipc_dir_prefix())
    assert ipc_owner.lock_path == temp_dir / f"{Path(ipc_dir).name}.owner"
    for lock in (owner, ipc_owner):  # their owner's alone: no other user can take or hold the lock
        assert (lock.lock_path.stat().st_mode & 0o777) == 0o600

    assert remove_stale_resources(str(temp_dir), shm_dir) == []
    assert len(_names(shm_dir)) == 3 and len(_names(temp_dir)) == 2

    for segment in segments:
        segment.unlink()  # what the segments' own close does at a stop
    ServerProcesses(ipc_dir=ipc_dir, shm_owner=owner, ipc_owner=ipc_owner).shutdown()
    assert _names(shm_dir) == [] and _names(temp_dir) == []
    assert not owner.held and not ipc_owner.held
    owner.release()  # idempotent


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-rpf", "--mount-proc", "true"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_a_server_in_another_pid_namespace(tmp_path: Path) -> None:
    if not _unshare_works():
        pytest.skip("unshare -rpf needs privileges here")
    temp_dir, shm_dir = _dirs(tmp_path)
    proc, (tag, ipc_name, _) = hold(shm_dir, temp_dir, prefix=("unshare", "-rpf", "--mount-proc"))
    try:
        # PID 1 there; here PID 1 is someone else (and runs): the pid could never tell.
        assert tag.startswith(shm_segment_prefix(1)) and ipc_name.startswith(ipc_dir_prefix(1))
        assert remove_stale_resources(str(temp_dir), shm_dir) == []
    finally:
        kill(proc)
    assert len(remove_stale_resources(str(temp_dir), shm_dir)) == 6
    assert _names(temp_dir) == [] and _names(shm_dir) == []


def test_pid_is_running() -> None:
    assert pid_is_running(os.getpid())
    assert pid_is_running(1)
    assert not pid_is_running(0)
    assert not pid_is_running(dead_pid())


@needs_root
def test_another_user_cannot_open_a_lock_file() -> None:
    # Open, it could take a dead server's lock and keep it, or queue a blocking flock on a live
    # one's and get it the moment the launcher dies: our leftovers would stay for good.
    with shared_dirs() as (temp_dir, shm_dir):
        proc, (tag, ipc_name, _) = hold(shm_dir, temp_dir)
        try:
            for lock in (shm_dir / f"{tag}_owner", temp_dir / f"{ipc_name}.owner"):
                assert open_fails_for_another_user(lock), lock
        finally:
            kill(proc)
        assert len(remove_stale_resources(str(temp_dir), shm_dir)) == 6


def _legacy_groups(temp_dir: Path, shm_dir: Path, pid: int) -> List[Path]:
    """An older server's groups of the launcher ``pid`` (no lock files): its segments and folder."""
    folder = temp_dir / f"{ipc_dir_prefix(pid)}0ld0ld00"
    folder.mkdir()
    (folder / "router.sock").write_bytes(b"")
    segments = [shm_dir / f"{shm_segment_prefix(pid)}0ld0ld00_{kind}" for kind in ("req", "stats")]
    for segment in segments:
        segment.write_bytes(b"x")
    return [folder, *segments]


@needs_root
def test_a_file_of_another_user_at_our_lock_name_is_no_lock() -> None:
    # Another user puts a file of its own, locked for good, at the lock's name of our groups that
    # have none: they were kept forever (and counted as a live server's); the pid rule judges them.
    with shared_dirs() as (temp_dir, shm_dir):
        dead, live = dead_pid(), os.getppid()
        stale, kept = _legacy_groups(temp_dir, shm_dir, dead), _legacy_groups(temp_dir, shm_dir, live)
        foreign = [lock for pid, folder in ((dead, stale[0]), (live, kept[0]))
                   for lock in (temp_dir / f"{folder.name}.owner", shm_dir / f"{shm_segment_prefix(pid)}0ld0ld00_owner")]
        with held_by_another_user(foreign):
            assert sorted(live_segments_of_others(shm_dir)) == sorted(kept[1:])
            assert sorted(remove_stale_resources(str(temp_dir), shm_dir)) == sorted(map(str, stale))
            assert all(path.exists() for path in kept + foreign)  # the other user's files are not ours to remove


def _no_flock(monkeypatch: pytest.MonkeyPatch) -> None:
    def flock(fd: Any, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", flock)


def test_without_flock_a_new_group_has_no_lock_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    # The creator's fallback: no lock file is left (it could not lock it), so its group is judged
    # by its pid, as an older server's.
    temp_dir, shm_dir = _dirs(tmp_path)
    _no_flock(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="lightllm.stale_resources"):
        owner = claim_shm_tag(shm_dir)
        ipc_dir, ipc_owner = create_ipc_dir(str(temp_dir))
    assert not owner.held and not ipc_owner.held
    assert _names(shm_dir) == [] and _names(temp_dir) == [Path(ipc_dir).name]
    assert sum("no flock in" in record.getMessage() for record in caplog.records) == 2
    # What another server sees: a group without a lock file, kept while its pid runs.
    (shm_dir / f"{owner.name}_req").write_bytes(b"x")
    rename_pid(shm_dir, temp_dir, os.getpid(), [owner.name, Path(ipc_dir).name], os.getppid())
    assert remove_stale_resources(str(temp_dir), shm_dir) == []
    assert live_segments_of_others(shm_dir) == [shm_dir / f"{owner.name.replace(str(os.getpid()), str(os.getppid()), 1)}_req"]
    ServerProcesses(ipc_owner=ipc_owner, shm_owner=owner).shutdown()  # nothing held: nothing to release


def _locked_groups(temp_dir: Path, shm_dir: Path, pid: int) -> List[Path]:
    """Groups of the launcher ``pid`` with a (free) lock file each; the lock files come last."""
    groups = _legacy_groups(temp_dir, shm_dir, pid)
    locks = [temp_dir / f"{groups[0].name}.owner", shm_dir / f"{shm_segment_prefix(pid)}0ld0ld00_owner"]
    for lock in locks:
        lock.write_bytes(b"")
        lock.chmod(0o600)
    return groups + locks


def test_a_lock_flock_refuses_is_judged_by_the_pid_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    # It was kept silently by the removal while the capacity check judged it by its pid: one rule
    # now, the pid's, with one warning per directory.
    temp_dir, shm_dir = _dirs(tmp_path)
    stale, kept = _locked_groups(temp_dir, shm_dir, dead_pid()), _locked_groups(temp_dir, shm_dir, os.getppid())
    _no_flock(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="lightllm.stale_resources"):
        assert sorted(live_segments_of_others(shm_dir)) == sorted(kept[1:3])
        removed = remove_stale_resources(str(temp_dir), shm_dir)
        assert remove_stale_resources(str(temp_dir), shm_dir) == []
    assert sorted(removed) == sorted(map(str, stale))
    # Each lock file after the rest of its group.
    assert removed.index(str(stale[3])) > removed.index(str(stale[0]))
    assert all(removed.index(str(stale[4])) > removed.index(str(segment)) for segment in stale[1:3])
    assert all(path.exists() for path in kept)
    warnings = [record.getMessage() for record in caplog.records if "cannot test the owner lock" in record.getMessage()]
    assert len(warnings) == 2, warnings  # the temp dir and the shm dir, once each
    assert all("judged by their pid" in line for line in warnings)


def test_a_lock_name_that_is_no_regular_file_is_judged_by_the_pid_rule(tmp_path: Path) -> None:
    # A FIFO, a directory or a symlink at the lock's name cannot be locked: the pid decides.
    temp_dir, shm_dir = _dirs(tmp_path)
    groups = {}
    for pid in (dead_pid(), os.getppid()):
        members = _legacy_groups(temp_dir, shm_dir, pid)
        fifo = shm_dir / f"{shm_segment_prefix(pid)}0ld0ld00_owner"
        os.mkfifo(fifo)
        folder_lock = temp_dir / f"{members[0].name}.owner"
        folder_lock.symlink_to(tmp_path)
        groups[pid] = members + [fifo, folder_lock]
    (dead, stale), (_, kept) = groups.items()
    assert sorted(live_segments_of_others(shm_dir)) == sorted(kept[1:3])
    assert sorted(remove_stale_resources(str(temp_dir), shm_dir)) == sorted(map(str, stale))
    assert all(os.path.lexists(path) for path in kept) and tmp_path.is_dir()


@pytest.mark.parametrize("create", ["shm", "ipc"])
def test_a_new_lock_file_someone_holds_for_a_moment_is_not_left_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, create: str) -> None:
    # Someone that removes nothing (another server's capacity probe) holds the creator's new lock
    # file in the instant before the creator locks it: the creator starts over with a new name, and
    # its first file is removed, not left empty.
    temp_dir, shm_dir = _dirs(tmp_path)
    real_flock = fcntl.flock
    probed: List[int] = []

    def flock_while_probed(fd: int, operation: int) -> None:
        if probed:
            return real_flock(fd, operation)
        probe = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)  # another open file, as another process's
        probed.append(probe)
        real_flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            return real_flock(fd, operation)
        finally:
            os.close(probe)  # the probe lets it go and removes nothing

    monkeypatch.setattr(fcntl, "flock", flock_while_probed)
    if create == "shm":
        owner = claim_shm_tag(shm_dir)
        folder, expected = shm_dir, [owner.lock_path.name]
    else:
        ipc_dir, owner = create_ipc_dir(str(temp_dir))
        folder, expected = temp_dir, sorted([Path(ipc_dir).name, owner.lock_path.name])
    monkeypatch.undo()
    assert probed and owner.held
    assert _names(folder) == expected
    owner.release()
