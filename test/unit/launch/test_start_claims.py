"""What a start claims before its children (owner locks, IPC folder, segments) goes when it fails.

The lock of the segments was claimed outside any cleanup, so a start that failed afterwards (a temp
dir that could not take the IPC folder, any error before the children) kept it held until the
process exited, and the resource tracker then reported a leaked object; the folder's failure was a
traceback.  The temporary directory is pointed at a missing one through ``tempfile.tempdir``, which
is what Python's choice of it caches.
"""

from __future__ import annotations

import argparse
import logging
import socket
import tempfile
from pathlib import Path
from typing import Tuple

import pytest

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.launch import start
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.child_readiness import StartupError
from lightllm.server.launch.sizing import ServerSizing, plan_sizing
from lightllm.utils.owner_locks import SHM_DIR, held_shm_locks, ipc_temp_dir, own_shm_tags


def _start_inputs(model_dir: Path) -> Tuple[argparse.Namespace, ServerSizing, ModelConfig]:
    args = make_argument_parser().parse_args(["--model_dir", str(model_dir), "--device", "cpu",
                                              "--max_total_token_num", "512", "--max_req_total_len", "256"])
    validate_args(args, 0)
    config = ModelConfig.from_dir(args.model_dir)
    return args, plan_sizing(args, config, "cpu"), config


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _claimed_since(tags_before: set) -> str:
    (tag,) = own_shm_tags() - tags_before
    return tag


def test_a_temp_dir_that_cannot_take_the_folder_is_one_line_and_the_lock_goes(
        tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "missing"
    monkeypatch.setattr(tempfile, "tempdir", str(missing))
    args, sizing, config = _start_inputs(tiny_llama_dir)
    tags_before = own_shm_tags()
    with pytest.raises(StartupError) as failed:
        start.start_processes(args, sizing, config)
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(f"cannot create the server's IPC folder in {missing} (the temporary directory, "
                              "TMPDIR): No such file or directory; set TMPDIR"), message
    tag = _claimed_since(tags_before)
    assert not list(SHM_DIR.glob(f"{tag}_*"))  # the segments' lock file, claimed first, is gone
    assert tag not in [lock.name for lock in held_shm_locks()]


def test_a_failure_after_the_claims_releases_everything(
        tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The segments exist by then; nothing of the start may stay until the process exits.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def no_configs(*args: object, **kwargs: object) -> None:
        raise RuntimeError("planned failure before any child")

    monkeypatch.setattr(start, "build_process_configs", no_configs)
    args, sizing, config = _start_inputs(tiny_llama_dir)
    tags_before = own_shm_tags()
    with pytest.raises(RuntimeError, match="planned failure"):
        start.start_processes(args, sizing, config)
    tag = _claimed_since(tags_before)
    assert not list(SHM_DIR.glob(f"{tag}_*"))
    assert list(tmp_path.iterdir()) == []
    assert held_shm_locks() == [lock for lock in held_shm_locks() if lock.name in tags_before]


def test_the_server_exits_1_with_one_line(tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    code = start.run_server(["--model_dir", str(tiny_llama_dir), "--device", "cpu", "--port", str(_free_port()),
                             "--max_total_token_num", "512", "--max_req_total_len", "256", "--log_level", "warning"])
    err = capsys.readouterr().err
    assert code == 1, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == [f"error: cannot create the server's IPC folder in {tmp_path / 'missing'} (the temporary "
                     "directory, TMPDIR): No such file or directory; set TMPDIR to a writable directory with free "
                     "space"], err
    assert "Traceback" not in err


def test_a_tmpdir_python_passes_over_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    # Python falls back to /tmp (or the next candidate) without a word.
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "missing"))
    with caplog.at_level(logging.WARNING, logger="lightllm.stale_resources"):
        chosen = ipc_temp_dir()
    assert chosen != str(tmp_path / "missing")
    assert [record.getMessage() for record in caplog.records] == [
        f"TMPDIR={tmp_path / 'missing'} is not a writable directory: the server's IPC folder goes to {chosen} instead"]

    caplog.clear()
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="lightllm.stale_resources"):
        assert ipc_temp_dir() == str(tmp_path)
    assert caplog.records == []


def test_no_usable_temp_dir_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Python's own candidates (TMPDIR, /tmp, ..., the working directory) all unusable: simulated by
    # its candidate list, as root can write to every real one.
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(tempfile, "_candidate_tempdir_list", lambda: [str(tmp_path / "missing")])
    with pytest.raises(ValueError) as refused:
        ipc_temp_dir()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("no temporary directory for the server's IPC folder: [Errno 2] No usable temporary "
                              "directory found in"), message
    assert message.endswith("; set TMPDIR to a writable directory")
