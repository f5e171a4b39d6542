"""The launcher's /dev/shm check: segment sizes known before creation, one-line refusal, exit code 2.

The free space is injected; nothing fills /dev/shm.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import traceback
from dataclasses import replace
from pathlib import Path

import pytest

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.argument_error import ArgumentError
from lightllm.server.core.objs.shm_req_layout import record_dtype, top_rows_dtype
from lightllm.server.core.objs.shm_stats import ShmStats
from lightllm.server.launch import start
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.shm_capacity import check_shm_capacity, describe_shm_use, format_bytes, shm_free_bytes
from lightllm.server.launch.sizing import plan_sizing
from lightllm.server.server_layout import ServerLayout
from lightllm.utils.owner_locks import SHM_DIR, ipc_dir_prefix, own_shm_tags, shm_segment_prefix
from lightllm.utils.stale_resources import live_segments_of_others
from owner_lock_support import as_another_user, dead_pid, hold, kill, needs_root, rename_pid, shared_dirs

GIB = 1 << 30


def _layout(max_req_total_len: int, slot_num: int = 1024, top_slot_num: int = 256) -> ServerLayout:
    return ServerLayout("lightllm_test_cap_req", "lightllm_test_cap_stats", slot_num, max_req_total_len, 1 << 20,
                        "ipc://r", "ipc://0", "ipc://d", "ipc://h", top_slot_num=top_slot_num)


def test_the_layout_knows_every_segment_size_before_creating_any() -> None:
    sizes = _layout(4096).shm_segment_bytes()
    assert sizes == {
        "request records": 1024 * record_dtype(4096).itemsize,
        "top-logprob rows": 256 * top_rows_dtype(4096).itemsize,
        "counters": ShmStats.segment_bytes(),
    }


def test_a_long_context_no_longer_maps_twenty_gib() -> None:
    """128k tokens at the default 256-request batch: 22.5 GiB with the alternatives in every record."""
    total = sum(_layout(131072).shm_segment_bytes().values())
    assert 7 * GIB < total < 8 * GIB
    assert sum(_layout(131072, top_slot_num=64).shm_segment_bytes().values()) < 4 * GIB


def test_enough_free_space_passes_and_an_unreadable_dir_is_not_checked(tmp_path) -> None:
    layout = _layout(4096)
    total = sum(layout.shm_segment_bytes().values())
    # An empty directory: other servers' segments in the real /dev/shm would take their share.
    check_shm_capacity(layout, total, tmp_path)
    check_shm_capacity(layout, None)


def test_other_running_servers_untouched_pages_are_not_free(tmp_path) -> None:
    # Two servers on one /dev/shm each passed the check (statvfs counts touched pages only), then
    # both died of SIGBUS under load.
    layout = _layout(4096)
    total = sum(layout.shm_segment_bytes().values())
    other = tmp_path / f"{shm_segment_prefix(os.getppid())}abcd1234_req"  # our parent runs: a live owner
    with open(other, "wb") as handle:
        handle.write(b"x" * 8192)  # touched pages: already off the free space, not counted again
        handle.truncate(GIB)
    untouched = GIB - other.stat().st_blocks * 512
    assert untouched > GIB - (1 << 20)
    # A dead server's segment (removed at start anyway) is nobody's promise.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(tmp_path / f"{shm_segment_prefix(dead.pid)}abcd1234_req", "wb") as handle:
        handle.truncate(4 * GIB)
    check_shm_capacity(layout, total + untouched, tmp_path)
    with pytest.raises(ArgumentError) as refused:
        check_shm_capacity(layout, total + untouched - 1, tmp_path)
    message = str(refused.value)
    assert "the untouched part of their 1 segment(s), written as their requests arrive)" in message
    assert f"and other running servers there may still take {format_bytes(untouched)} of it" in message
    # Promised space beyond what is free is said as such, not as a part larger than the whole.
    with pytest.raises(ArgumentError) as refused:
        check_shm_capacity(layout, untouched // 2, tmp_path)
    assert f"may still take {format_bytes(untouched)} (more than is free)" in str(refused.value)


def test_a_live_server_in_another_pid_namespace_is_counted(tmp_path) -> None:
    # Its pid is not running here (it was not counted, and two containers sharing /dev/shm each
    # passed the check), but it holds its owner lock: its untouched pages are promised.
    layout = _layout(4096)
    total = sum(layout.shm_segment_bytes().values())
    shm_dir, temp_dir = tmp_path / "shm", tmp_path / "tmp"
    shm_dir.mkdir()
    temp_dir.mkdir()
    proc, printed = hold(shm_dir, temp_dir)  # a 1 GiB sparse _req segment, untouched
    try:
        rename_pid(shm_dir, temp_dir, proc.pid, printed, dead_pid())
        with pytest.raises(ArgumentError, match=r"the untouched part of their 1 segment\(s\)"):
            check_shm_capacity(layout, total + GIB // 2, shm_dir)
    finally:
        kill(proc)
    # Killed: its lock is free, and a dead server's segments are nobody's promise.
    check_shm_capacity(layout, total, shm_dir)


@needs_root
def test_another_user_s_server_judges_our_live_server_by_its_pid() -> None:
    # Our lock files are ours alone (another user could otherwise hold them), so another user's
    # check cannot test them: it counts our live server while its pid runs there, and not once
    # the name carries a pid that does not (a server of ours in another PID namespace): the
    # documented limit.
    with shared_dirs() as (temp_dir, shm_dir):
        proc, printed = hold(shm_dir, temp_dir)
        try:
            segments = as_another_user(lambda: [path.name for path in live_segments_of_others(shm_dir)])
            assert sorted(segments) == sorted(f"{printed[0]}_{kind}" for kind in ("req", "req_top", "stats"))
            rename_pid(shm_dir, temp_dir, proc.pid, printed, dead_pid())
            assert as_another_user(lambda: live_segments_of_others(shm_dir)) == []
            assert len(live_segments_of_others(shm_dir)) == 3  # this user's check still sees the lock held
        finally:
            kill(proc)


def test_too_little_free_space_is_one_line_naming_the_sizes_and_the_flags() -> None:
    layout = _layout(131072)
    with pytest.raises(ArgumentError) as refused:
        check_shm_capacity(layout, 64 << 20)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("the server's shared memory needs 7.5 GiB (request records 2.5 GiB, top-logprob rows 5.0 GiB)")
    assert "but /dev/shm has 64.0 MiB free" in message
    for flag in ("--max_req_total_len (131072)", "--running_max_req_size (sets the 1024 request slots)",
                 "--top_logprobs_slots (256)", "--shm-size"):
        assert flag in message


def test_free_space_is_read_from_statvfs(tmp_path: Path) -> None:
    free = shm_free_bytes(tmp_path)
    assert isinstance(free, int) and free > 0
    assert shm_free_bytes(tmp_path / "missing") is None


def test_the_start_up_log_line_names_each_segment() -> None:
    line = describe_shm_use(_layout(4096))
    assert line.startswith("shared memory: 259.6 MiB in all: request records 99.6 MiB (1024 slots x 4096 tokens), "
                           "top-logprob rows 160.0 MiB (256 slots), counters")
    assert "heartbeats" not in line  # --watchdog_timeout 0: no such segment


def test_the_start_up_log_line_names_the_heartbeats_it_counts() -> None:
    watched = replace(_layout(4096), heartbeat_processes=("detokenization", "router", "model_rank0"),
                      shm_heartbeat_name="lightllm_test_cap_beat")
    line = describe_shm_use(watched)
    assert line.endswith(", heartbeats 24 B (detokenization, router, model_rank0)"), line
    assert watched.shm_segment_bytes()["heartbeats"] == 24


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_start_up_refuses_before_any_segment_or_child_exists(tiny_llama_dir, monkeypatch) -> None:
    monkeypatch.setattr(start, "shm_free_bytes", lambda: 4096)
    args = make_argument_parser().parse_args(["--model_dir", str(tiny_llama_dir), "--device", "cpu",
                                              "--max_total_token_num", "512", "--max_req_total_len", "256"])
    validate_args(args, 0)
    sizing = plan_sizing(args, ModelConfig.from_dir(args.model_dir), "cpu")
    created = []
    monkeypatch.setattr(ServerLayout, "open_requests", lambda self, create=False: created.append(self))
    with pytest.raises(ArgumentError, match="but /dev/shm has 4.0 KiB free"):
        start.start_processes(args, sizing, ModelConfig.from_dir(args.model_dir))
    assert created == []


def test_a_refused_start_logs_what_it_removed_and_no_children_stopped(tiny_llama_dir, monkeypatch, caplog) -> None:
    # It logged "children stopped; shared memory and IPC folder removed" though nothing had started.
    monkeypatch.setattr(start, "shm_free_bytes", lambda: 4096)
    args = make_argument_parser().parse_args(["--model_dir", str(tiny_llama_dir), "--device", "cpu",
                                              "--max_total_token_num", "512", "--max_req_total_len", "256"])
    validate_args(args, 0)
    sizing = plan_sizing(args, ModelConfig.from_dir(args.model_dir), "cpu")
    tags_before = own_shm_tags()
    # The launcher's lines, from whichever of its modules (start, server_processes) writes them.
    with caplog.at_level(logging.INFO, logger="lightllm.server.launch"), pytest.raises(ArgumentError):
        start.start_processes(args, sizing, ModelConfig.from_dir(args.model_dir))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("lightllm.server.launch.")]
    assert "IPC folder removed (no child process had started)" in lines, lines
    assert not any("children stopped" in line or "stopping child" in line for line in lines), lines
    # The owner lock files went too (created before the segments and the folder, removed after them).
    (tag,) = own_shm_tags() - tags_before
    assert not list(SHM_DIR.glob(f"{tag}_*"))
    assert not list(Path(tempfile.gettempdir()).glob(f"{ipc_dir_prefix()}*"))


def test_the_server_exits_2_with_one_line(tiny_llama_dir, monkeypatch, capsys) -> None:
    monkeypatch.setattr(start, "shm_free_bytes", lambda: 4096)
    spawned = []
    real_get_context = start.mp.get_context

    def get_context(*args):
        # Only the launcher's own call counts: the patch is process-wide, and importing uvicorn
        # (the first import of it, when this test runs alone) asks for a spawn context too.
        if traceback.extract_stack()[-2].filename == start.__file__:
            spawned.append(args)
        return real_get_context(*args)

    monkeypatch.setattr(start.mp, "get_context", get_context)
    code = start.run_server(["--model_dir", str(tiny_llama_dir), "--device", "cpu", "--port", str(_free_port()),
                             "--max_total_token_num", "512", "--max_req_total_len", "256", "--log_level", "warning"])
    assert code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "--top_logprobs_slots" in lines[0], lines
    assert spawned == []
