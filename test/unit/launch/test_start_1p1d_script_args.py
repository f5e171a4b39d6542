"""scripts/start_1p1d.sh refuses bad options with a one-line error before starting anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "start_1p1d.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_help_lists_every_option():
    proc = _run("--help")
    assert proc.returncode == 0
    for option in ("--model_dir", "--master_port", "--prefill_port", "--decode_port", "--prefill_devices",
                   "--decode_devices", "--node_args", "--decode_args", "--master_args", "--log_dir",
                   "--start_timeout", "--stop_timeout"):
        assert option in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--master_port", "70000"], "--master_port must be a port in 1..65535, got '70000'"),
        (["--decode_port", "x"], "--decode_port must be a port in 1..65535, got 'x'"),
        (["--prefill_port", "1212"], "ports must differ"),
        (["--start_timeout", "0"], "--start_timeout must be a whole number of seconds >= 1"),
        (["--node_args", "'unclosed"], "--node_args is not a valid shell-quoted string"),
        (["--node_args", "--tp 1 --port 9"], "--port is set by the script"),
        (["--master_args", "--run_mode=normal"], "--run_mode is set by the script"),
        (["--", "--pd_master_port", "5"], "--pd_master_port is set by the script"),
        (["--model_dir"], "--model_dir needs a value"),
        (["--bogus"], "unknown option --bogus"),
    ],
)
def test_bad_options_are_refused(args, message, tmp_path):
    proc = _run("--log_dir", str(tmp_path / "logs"), *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "logs").exists()  # nothing was started


def test_missing_model_dir_is_refused(tmp_path):
    proc = _run("--model_dir", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "is not a directory" in proc.stderr
