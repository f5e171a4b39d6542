"""soak_server's flags and outputs (outside tester's report on the tools, items 4, 5 and 6).

* --output-json and --output-md naming one file are refused (the Markdown silently replaced the JSON);
* --server-args and --log-dir with --base-url are refused (they were accepted and ignored);
* a report file that cannot be written is one line naming the flag and the path, after the report;
* Ctrl-C is one ``error: interrupted; ...`` line and exit 130.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cli_refusal_support import one_line_refusal

from lightllm.benchmark import soak_server

FULL = "/dev/full"


def _target(*extra: str) -> list[str]:
    return ["--base-url", "http://127.0.0.1:9", "--server-pid", str(os.getpid()), "--vocab", "100",
            "--rounds", "2", "--streams", "1", "--aborts", "0", "--requests", "1", "--settle-s", "0", *extra]


def test_one_file_for_both_reports_is_refused(tmp_path, capsys) -> None:
    same = str(tmp_path / "same.out")
    line = one_line_refusal(soak_server.main, _target("--output-json", same, "--output-md", same), capsys)
    assert "--output-json and --output-md name the same file" in line


@pytest.mark.parametrize("extra, flag", [(["--server-args", "--max_total_token_num 8192"], "--server-args"),
                                         (["--log-dir", "logs"], "--log-dir")])
def test_flags_of_the_started_server_are_refused_with_base_url(tmp_path, capsys, extra, flag) -> None:
    line = one_line_refusal(soak_server.main, _target(*extra), capsys)
    assert line.startswith(f"error: {flag} only goes with --model_dir"), line


@pytest.fixture
def soaked(monkeypatch):
    """A soak that measured something, without a server."""

    async def soak(*_args):
        return {"rounds": [], "criterion_holds": True, "errors": 0}

    monkeypatch.setattr(soak_server, "soak", soak)
    monkeypatch.setattr(soak_server, "render_markdown", lambda report: "# soak report")
    monkeypatch.setattr(soak_server, "_raise_fd_limit", lambda: None)


@pytest.mark.skipif(not Path(FULL).exists(), reason="needs /dev/full")
def test_a_report_that_cannot_be_written_is_one_line_after_the_report(soaked, tmp_path, capsys) -> None:
    kept = tmp_path / "report.json"
    with pytest.raises(SystemExit) as exit_info:
        soak_server.main(_target("--output-json", str(kept), "--output-md", FULL))
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and "# soak report" in captured.out
    assert captured.err.splitlines() == [f"error: --output-md {FULL!r} could not be written: No space left on device "
                                         "(--help lists the flags)"]
    assert kept.exists()


def test_ctrl_c_is_one_line_and_exit_130(soaked, monkeypatch, capsys) -> None:
    async def interrupted(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(soak_server, "soak", interrupted)
    assert soak_server.main(_target()) == 130
    err = capsys.readouterr().err
    assert err.splitlines() == ["error: interrupted; every server it started was stopped; no report was written"], err
