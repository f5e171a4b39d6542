"""Refusals an outside pass found reaching long work or a traceback: now one line before any work."""

from __future__ import annotations

import os

from cli_refusal_support import one_line_refusal

from lightllm.benchmark import process_footprint, side_by_side, soak_server
from lightllm.benchmark.simulator import __main__ as simulator
from lightllm.utils import demo_model


def test_process_footprint_checks_its_checkpoint_timeout_and_server_flags_first(tmp_path, capsys) -> None:
    (tmp_path / "ckpt").mkdir()
    line = one_line_refusal(process_footprint.main, ["--model_dir", str(tmp_path / "ckpt")], capsys)
    assert "--model_dir" in line and "no config.json" in line
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    checkpoint = ["--model_dir", str(tmp_path / "ckpt")]
    assert "--timeout_s" in one_line_refusal(process_footprint.main, [*checkpoint, "--timeout_s", "nan"], capsys)
    line = one_line_refusal(process_footprint.main, [*checkpoint, "--server_args", "'x"], capsys)
    assert "--server_args" in line and "shell-quoted" in line


def test_side_by_side_splits_server_flags_as_a_shell_does(capsys) -> None:
    line = one_line_refusal(side_by_side.main, ["--server_args", "'x"], capsys)
    assert "--server_args" in line


def test_soak_server_refuses_a_pid_that_runs_nothing_and_names_an_unreachable_server(capsys) -> None:
    line = one_line_refusal(soak_server.main, ["--base-url", "http://127.0.0.1:9", "--server-pid", "999999999"], capsys)
    assert "--server-pid 999999999 is not a running process" in line
    capsys.readouterr()
    # --vocab: this test process names no --model_dir to read the served vocabulary from.
    status = soak_server.main(["--base-url", "http://127.0.0.1:9", "--server-pid", str(os.getpid()), "--vocab", "100",
                               "--streams", "1", "--aborts", "0", "--requests", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1 and err[0].startswith("error: cannot reach the server at http://127.0.0.1:9")


def test_shortened_flags_and_empty_names_are_refused(tmp_path, capsys) -> None:
    assert "unrecognized arguments: --profil" in one_line_refusal(simulator.main, ["--profil", "cpu_demo_small"], capsys)
    line = one_line_refusal(demo_model.main, ["--out", ""], capsys)
    assert "--out" in line and "must name a directory" in line
    assert not any(tmp_path.iterdir())


def test_an_empty_item_in_a_comma_list_is_refused_not_dropped(capsys) -> None:
    from lightllm.benchmark.simulator import deadline_frontier, frontier

    line = one_line_refusal(simulator.main, ["--budget", "1024,,4096"], capsys)
    assert "--budget" in line and "empty item" in line
    assert "--counts" in one_line_refusal(frontier.main, ["--counts", "1,,2"], capsys)
    assert "--due-ms" in one_line_refusal(deadline_frontier.main, ["--due-ms", "2000,,2100"], capsys)
