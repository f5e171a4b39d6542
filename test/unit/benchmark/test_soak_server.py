"""Pure parts of the soak script: arguments, /proc memory reading, the leak criterion, the report."""

from __future__ import annotations

import mmap
import os

import pytest

from lightllm.benchmark.process_memory import (
    LeakVerdict,
    child_pids,
    leak_verdicts,
    parse_status,
    read_memory,
    server_processes,
    shm_usage,
)
from lightllm.benchmark.soak_report import render_markdown
from lightllm.benchmark.soak_server import parse_args, server_shm_usage
from lightllm.utils.envs_utils import DEFAULT_IDLE_MALLOC_TRIM_SECONDS


def test_defaults_describe_the_documented_soak(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # --model_dir must be a checkpoint directory
    model = ["--model_dir", str(tmp_path)]
    monkeypatch.delenv("LIGHTLLM_IDLE_MALLOC_TRIM", raising=False)
    args = parse_args(model)
    assert (args.rounds, args.streams, args.requests, args.tolerance) == (3, 1000, 1000, 0.05)
    assert args.prompt_len == [8, 64]
    # Memory is sampled after the ranks' idle heap trim, whatever its delay.
    assert args.settle_s == DEFAULT_IDLE_MALLOC_TRIM_SECONDS + 3
    monkeypatch.setenv("LIGHTLLM_IDLE_MALLOC_TRIM", "2")
    assert parse_args(model).settle_s == 5
    monkeypatch.setenv("LIGHTLLM_IDLE_MALLOC_TRIM", "0")  # never trims: nothing to wait for
    assert parse_args(model).settle_s == 3
    assert parse_args([*model, "--settle-s", "1"]).settle_s == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "exactly one of"),
        (["--model_dir", "m", "--base-url", "http://127.0.0.1:1", "--server-pid", "1"], "exactly one of"),
        (["--base-url", "http://10.0.0.5:8000", "--server-pid", "1"], "loopback"),
        (["--base-url", "http://127.0.0.1:8000"], "--server-pid"),
        (["--model_dir", "m", "--server-pid", "5"], "only goes with --base-url"),
        (["--model_dir", "m", "--rounds", "1"], "--rounds must be in [2, 20]"),
        (["--model_dir", "m", "--streams", "20000"], "--streams must be in"),
        (["--model_dir", "m", "--prompt-len", "9", "3"], "must not exceed"),
        (["--model_dir", "m", "--streams", "0", "--aborts", "0", "--requests", "0"], "nothing to send"),
        (["--model_dir", "m", "--max-seconds", "0"], "--max-seconds must be positive"),
        (["--model_dir", "m", "--settle-s", "-1"], "--settle-s and --tolerance must be >= 0"),
    ],
)
def test_bad_arguments_end_in_a_one_line_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_status_reads_the_resident_fields():
    text = "Name:\tpython\nVmPeak:\t 9000 kB\nVmRSS:\t  1234 kB\nRssAnon:\t  1000 kB\nRssFile:\t 200 kB\nRssShmem:\t 34 kB\n"
    sample = parse_status(text)
    assert (sample.rss_kib, sample.anon_kib, sample.file_kib, sample.shmem_kib) == (1234, 1000, 200, 34)
    with pytest.raises(ValueError, match="VmRSS"):
        parse_status("Name:\tkthreadd\n")


def test_read_memory_of_this_process_sees_a_new_allocation():
    before = read_memory(os.getpid())
    assert before.rss_kib > 0 and before.anon_kib > 0
    # A fresh anonymous mapping, every page written: malloc could hand back heap memory that an
    # earlier test freed but left resident (the server's malloc settings keep freed memory), so a
    # bytearray need not grow the resident set.
    block = mmap.mmap(-1, 64 << 20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    after = read_memory(os.getpid())
    block.close()
    assert after.rss_kib - before.rss_kib > 32 << 10
    with pytest.raises(ProcessLookupError):
        read_memory(2**22 + 12345)  # above the kernel's pid_max limit


def test_server_processes_lists_the_children_of_a_process():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in child_pids(os.getpid())
        labels = dict((pid, label) for label, pid in server_processes(os.getpid()))
        assert labels[os.getpid()] == "main" and child.pid in labels
    finally:
        child.kill()
        child.wait()


def test_shm_usage_counts_only_matching_files(tmp_path):
    (tmp_path / "lightllm_a").write_bytes(b"x" * 10000)
    (tmp_path / "other").write_bytes(b"y" * 10000)
    only = shm_usage(str(tmp_path), prefix="lightllm_")
    both = shm_usage(str(tmp_path))
    assert only["files"] == 1 and both["files"] == 2
    assert 0 < only["bytes"] < both["bytes"]
    assert shm_usage(str(tmp_path / "missing")) == {"bytes": 0, "files": 0}


def test_the_server_s_segments_are_counted_without_its_owner_lock_file(tmp_path):
    # The launcher's lock file shares its segments' prefix; it is no segment (the count was one too many).
    tag = f"lightllm_{os.getpid()}_0a1b2c3d"
    for kind in ("req", "req_top", "stats"):
        (tmp_path / f"{tag}_{kind}").write_bytes(b"x" * 10000)
    (tmp_path / f"{tag}_owner").write_bytes(b"")
    (tmp_path / f"lightllm_{os.getpid() + 1}_0a1b2c3d_req").write_bytes(b"x")  # another server's
    usage = server_shm_usage(os.getpid(), str(tmp_path))
    assert usage["files"] == 3
    assert usage["bytes"] == shm_usage(str(tmp_path), prefix=tag)["bytes"] > 0  # the lock file holds nothing


def test_leak_criterion_compares_last_round_with_first():
    rounds = [{"rank": 1000, "http": 400}, {"rank": 1200, "http": 400}, {"rank": 1049, "http": 421}]
    verdicts = {v.label: v for v in leak_verdicts(rounds, 0.05)}
    assert verdicts["rank"].holds and abs(verdicts["rank"].growth - 0.049) < 1e-9
    assert not verdicts["http"].holds  # 5.25% growth
    assert all(v.holds for v in leak_verdicts(rounds, 0.06))


def test_leak_criterion_fails_a_process_that_died_and_needs_two_rounds():
    verdicts = leak_verdicts([{"rank": 1000, "router": 200}, {"router": 200}])
    assert verdicts == [LeakVerdict("rank", 1000, 0, float("inf"), False), LeakVerdict("router", 200, 200, 0.0, True)]
    with pytest.raises(ValueError, match="two rounds"):
        leak_verdicts([{"rank": 1}])
    with pytest.raises(ValueError, match="tolerance"):
        leak_verdicts([{"rank": 1}, {"rank": 1}], -0.1)


def test_markdown_report_has_a_row_per_process_and_the_verdict():
    memory = lambda rss: {"pid": 1, "rss_kib": rss, "anon_kib": rss, "file_kib": 0, "shmem_kib": 0}  # noqa: E731
    phase = {"sent": 10, "ok": 10, "errors": 0, "seconds": 1.5, "error_samples": []}
    rounds = [{"round": i + 1, "phases": {"streams": phase}, "went_idle": True, "memory": {"model_rank0": memory(rss)},
               "shm": {"bytes": 2 << 20, "files": 2}} for i, rss in enumerate([2048, 4096])]
    verdicts = [v.__dict__ for v in leak_verdicts([{"model_rank0": 2048}, {"model_rank0": 4096}])]
    text = render_markdown({"start": {"memory": {"model_rank0": memory(1024)}}, "rounds": rounds,
                            "verdicts": verdicts, "criterion_holds": False, "errors": 0, "args": {"tolerance": 0.05}})
    assert "| model_rank0 | 1 | 2 | 4 | +100.0% GREW |" in text
    assert "| 1 | 10/10 (0, 1.5) | — | — | yes | 2.0 (2) |" in text
    assert "**fails**" in text
    assert "left after it stopped" not in text  # a server it did not start
    stopped = render_markdown({"rounds": rounds, "verdicts": verdicts, "shm_left_after_stop": {"bytes": 0, "files": 0},
                               "shm_owner_lock_left_after_stop": True})
    assert "Shared-memory segments of the server left after it stopped: 0. Its owner lock file was left too." in stopped
