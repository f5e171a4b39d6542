"""The simulator's tools write their files first, refuse what they cannot write in one line, and end
quietly when stdout's reader is gone.

An outside pass found: ``--json /dev/full`` (and ``--markdown``, schedule_cost's ``--json``,
derive_h100_profile's ``--out``) ended in an OSError traceback; the report was printed before the
files were written, so ``| head -1`` raised BrokenPipeError and a whole simulation's --json file
was never written; ``--json X --markdown X`` let one output silently replace the other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_refusal_support import one_line_refusal
from simulator_test_support import assert_refused_in_one_line

from lightllm.benchmark.simulator import __main__ as simulator_cli
from lightllm.benchmark.simulator import derive_h100_profile, schedule_cost

ROOT = Path(__file__).resolve().parents[3]
_CELL = ["--scenario", "long_first", "--modes", "normal", "--budget", "1024", "--strategies", "default"]
_SCHEDULE = ["--layout", "engine", "--sizes", "10", "--repeats", "1", "--warmup", "0"]
needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a full disk)")


@needs_dev_full
@pytest.mark.parametrize("main, argv, flag", [
    (simulator_cli.main, _CELL, "--json"),
    (simulator_cli.main, _CELL, "--markdown"),
    (schedule_cost.main, _SCHEDULE, "--json"),
    (derive_h100_profile.main, [], "--out"),
])
def test_an_output_that_cannot_be_written_is_one_line_naming_it(main, argv, flag, capsys):
    # The last stderr line: the simulator announces its cells there first.
    assert_refused_in_one_line(main, [*argv, flag, "/dev/full"], f"error: {flag} '/dev/full' could not be written: ",
                               capsys)


def test_the_same_file_for_json_and_markdown_is_refused_before_simulating(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(simulator_cli, "run_matrix", lambda *a, **k: pytest.fail("simulated before refusing"))
    monkeypatch.chdir(tmp_path)
    line = one_line_refusal(simulator_cli.main, [*_CELL, "--json", "out", "--markdown", str(tmp_path / "out")],
                            capsys)
    assert "--json and --markdown name the same file" in line, line
    (tmp_path / "link").symlink_to(tmp_path / "out")
    line = one_line_refusal(simulator_cli.main, [*_CELL, "--json", "out", "--markdown", "link"], capsys)
    assert "--json and --markdown name the same file" in line, line


def _run_with_stdout_closed(args: list[str]) -> subprocess.CompletedProcess:
    """Run a tool whose stdout is a pipe nobody reads any more (``| head -1`` once head left)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout now fails with EPIPE
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.run([sys.executable, "-m", *args], stdout=write_end, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT, env=env, timeout=300)
    finally:
        os.close(write_end)


def test_a_closed_stdout_ends_quietly_after_the_files_are_written(tmp_path):
    out_json, out_md = tmp_path / "out.json", tmp_path / "out.md"
    done = _run_with_stdout_closed(["lightllm.benchmark.simulator", *_CELL, "--json", str(out_json),
                                    "--markdown", str(out_md)])
    assert done.returncode == 0 and "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr
    assert json.loads(out_json.read_text())["results"]
    assert out_md.read_text().startswith("## Scheduling simulator")


def test_schedule_cost_writes_its_json_before_a_closed_stdout(tmp_path):
    out_json = tmp_path / "rows.json"
    done = _run_with_stdout_closed(["lightllm.benchmark.simulator.schedule_cost", *_SCHEDULE,
                                    "--json", str(out_json)])
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert [row["layout"] for row in json.loads(out_json.read_text())] == ["engine"] * len(
        json.loads(out_json.read_text()))
