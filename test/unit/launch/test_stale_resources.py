"""Removal of IPC folders and shared-memory segments whose owner pid no longer runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lightllm.utils.stale_resources import (ipc_dir_prefix, make_ipc_dir, new_shm_tag, pid_is_running,
                                            remove_stale_resources, shm_segment_prefix)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_resources_of_dead_owners_are_removed(tmp_path: Path) -> None:
    temp_dir, shm_dir = tmp_path / "tmp", tmp_path / "shm"
    temp_dir.mkdir()
    shm_dir.mkdir()
    dead = _dead_pid()
    assert not pid_is_running(dead)
    stale_dir = temp_dir / f"{ipc_dir_prefix(dead)}abc"
    (stale_dir / "sub").mkdir(parents=True)
    (stale_dir / "router.sock").write_bytes(b"")
    stale_segment = shm_dir / f"{shm_segment_prefix(dead)}1234abcd_req"
    stale_segment.write_bytes(b"x")
    live_dir = temp_dir / f"{ipc_dir_prefix(os.getppid())}abc"
    live_dir.mkdir()
    live_segment = shm_dir / f"{shm_segment_prefix(os.getppid())}1234abcd_req"
    live_segment.write_bytes(b"x")
    # Names without an owner pid (older servers, other programs) are never touched.
    foreign = [temp_dir / "lightllm-xyz", shm_dir / "lightllm_notapid_req", shm_dir / f"other_{dead}_x"]
    foreign[0].mkdir()
    foreign[1].write_bytes(b"x")
    foreign[2].write_bytes(b"x")

    removed = remove_stale_resources(str(temp_dir), shm_dir)

    assert sorted(removed) == sorted([str(stale_dir), str(stale_segment)])
    assert not stale_dir.exists() and not stale_segment.exists()
    assert live_dir.exists() and live_segment.exists()
    assert all(path.exists() for path in foreign)
    assert remove_stale_resources(str(temp_dir), shm_dir) == []


def test_resources_with_this_process_pid_are_never_removed(tmp_path: Path, monkeypatch) -> None:
    # A container's server is PID 1 at every start, so a killed one's leftovers carry our pid; but
    # so do the live resources of a sibling container (PID 1 in its own namespace) sharing this
    # /dev/shm, and a pid cannot tell them apart: both stay (failure_handling.md says how to clear).
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    temp_dir, shm_dir = tmp_path / "tmp", tmp_path / "shm"
    temp_dir.mkdir()
    shm_dir.mkdir()
    predecessor_dir = temp_dir / f"{ipc_dir_prefix()}zz9old"
    predecessor_dir.mkdir()
    predecessor_segment = shm_dir / f"{shm_segment_prefix()}0ld0ld00_req"
    predecessor_segment.write_bytes(b"x")
    own_dir = Path(make_ipc_dir())
    assert own_dir.parent == temp_dir
    own_segments = [shm_dir / f"{new_shm_tag()}_{kind}" for kind in ("req", "stats")]
    for segment in own_segments:
        segment.write_bytes(b"x")
    # A live process other than this one (our parent) still owns its resources.
    live_segment = shm_dir / f"{shm_segment_prefix(os.getppid())}1234abcd_req"
    live_segment.write_bytes(b"x")

    removed = remove_stale_resources(str(temp_dir), shm_dir)

    assert removed == []
    assert predecessor_dir.exists() and predecessor_segment.exists()
    assert own_dir.exists() and all(segment.exists() for segment in own_segments) and live_segment.exists()
    assert remove_stale_resources(str(temp_dir), shm_dir) == []
    own_dir.rmdir()
    predecessor_dir.rmdir()


def test_pid_is_running() -> None:
    assert pid_is_running(os.getpid())
    assert pid_is_running(1)
    assert not pid_is_running(0)
    assert not pid_is_running(_dead_pid())
