"""bench_serving's output files and Ctrl-C (outside tester's report on the tools, items 1, 2, 6 and 13).

* --output-json and --output-jsonl naming one file are refused before anything is sent (the
  summary silently replaced the records);
* a file that cannot be written (/dev/full) is one line naming the flag and the path, after the
  summary was printed (a traceback before; with --output-jsonl the summary was not printed at all);
* Ctrl-C is one ``error: interrupted; ...`` line, exit 130, and the records of the measured
  requests that finished are written to --output-jsonl (or the line says they were not);
* --max-concurrency 0 and a --base-url port out of range are refused naming the flag.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from canned_server import serve
from cli_refusal_support import one_line_refusal
from lightllm.benchmark import bench_serving, serving_run
from lightllm.benchmark.metrics import RequestRecord, read_records_jsonl
from test_bench_client_outcomes import make_app

FULL = "/dev/full"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serve(make_app([])) as base_url:
        yield base_url


def _argv(base_url: str, tokenizer: Path, *extra: str) -> list[str]:
    return ["--base-url", base_url, "--tokenizer", str(tokenizer), "--no-progress", "--long-count", "1",
            "--long-len", "40", "--short-count", "2", "--short-len", "8", "--output-len", "3", *extra]


def test_one_file_for_both_outputs_is_refused(tokenizer_dir, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(bench_serving, "check_reachable", lambda *_a: pytest.fail("the server was asked"))
    same = str(tmp_path / "same.json")
    line = one_line_refusal(bench_serving.main, _argv("http://127.0.0.1:9", tokenizer_dir, "--output-json", same,
                                                      "--output-jsonl", same), capsys)
    assert "--output-jsonl and --output-json name the same file" in line
    assert not Path(same).exists()


@pytest.mark.skipif(not Path(FULL).exists(), reason="needs /dev/full")
@pytest.mark.parametrize("flag", ["--output-json", "--output-jsonl"])
def test_an_output_that_cannot_be_written_is_one_line_after_the_summary(server, tokenizer_dir, tmp_path, capsys,
                                                                        flag) -> None:
    other = "--output-jsonl" if flag == "--output-json" else "--output-json"
    kept = tmp_path / "kept"
    with pytest.raises(SystemExit) as exit_info:
        bench_serving.main(_argv(server, tokenizer_dir, flag, FULL, other, str(kept)))
    captured = capsys.readouterr()
    assert exit_info.value.code == 2
    assert "duration_s:" in captured.out and "ttft_ms p99" in captured.out  # the summary was printed
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert lines == [f"error: {flag} {FULL!r} could not be written: No space left on device (--help lists the flags)"]
    if other == "--output-jsonl":  # written first: the records are kept
        assert len(read_records_jsonl(kept)) == 3


def test_both_outputs_are_written(server, tokenizer_dir, tmp_path) -> None:
    records, summary = tmp_path / "records.jsonl", tmp_path / "summary.json"
    assert bench_serving.main(_argv(server, tokenizer_dir, "--output-jsonl", str(records),
                                    "--output-json", str(summary))) == 0
    assert [r.index for r in read_records_jsonl(records)] == [0, 1, 2]
    assert json.loads(summary.read_text())["overall"]["completed"] == 3


def _interrupted_after(finished_indexes: list[int]):
    """A send_all that finishes the requests ``finished_indexes`` and is then interrupted."""

    async def send_all(*_args: Any, finished: list[RequestRecord] | None = None, **_kwargs: Any):
        for index in finished_indexes:
            finished.append(RequestRecord(index=index, request_class="short", prompt_tokens=8, scheduled_time=0.0,
                                          send_time=0.0, first_token_time=0.1, token_times=[0.1], end_time=0.1,
                                          output_tokens=1, requested_output_tokens=1))
        raise KeyboardInterrupt

    return send_all


def _interrupt(main_argv: list[str], capsys) -> str:
    capsys.readouterr()
    status = bench_serving.main(main_argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 130 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: interrupted; ")
    return lines[0]


def test_ctrl_c_writes_the_records_of_the_requests_that_finished(server, tokenizer_dir, tmp_path, capsys,
                                                                 monkeypatch) -> None:
    monkeypatch.setattr(serving_run, "send_all", _interrupted_after([2, 0]))
    records, summary = tmp_path / "records.jsonl", tmp_path / "summary.json"
    line = _interrupt(_argv(server, tokenizer_dir, "--output-jsonl", str(records), "--output-json", str(summary)),
                      capsys)
    assert "the records of the 2 measured requests that finished were written to --output-jsonl" in line
    assert [r.index for r in read_records_jsonl(records)] == [0, 2]
    assert not summary.exists()


def test_ctrl_c_before_any_request_finished_says_nothing_was_written(server, tokenizer_dir, tmp_path, capsys,
                                                                     monkeypatch) -> None:
    monkeypatch.setattr(serving_run, "send_all", _interrupted_after([]))
    records = tmp_path / "records.jsonl"
    line = _interrupt(_argv(server, tokenizer_dir, "--output-jsonl", str(records)), capsys)
    assert "no measured request had finished; --output-jsonl" in line and "was not written" in line
    assert not records.exists()


def test_ctrl_c_while_the_tokenizer_loads_is_one_line(server, tokenizer_dir, capsys, monkeypatch) -> None:
    def interrupted(_path):  # where torch is imported (transformers)
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_serving, "load_tokenizer", interrupted)
    assert _interrupt(_argv(server, tokenizer_dir), capsys) == "error: interrupted; nothing was measured"


@pytest.mark.parametrize("extra, message", [
    (["--max-concurrency", "0"], "argument --max-concurrency: must be an integer >= 1, got 0"),
    (["--base-url", "http://127.0.0.1:99999"], "argument --base-url: 'http://127.0.0.1:99999' has no valid port"),
    (["--base-url", "127.0.0.1:8000"], "argument --base-url: must be http://HOST[:PORT] or https://HOST[:PORT]"),
    (["--warmup-runs", "-1"], "argument --warmup-runs: must be an integer >= 0, got -1"),
])
def test_bad_values_are_refused_naming_the_flag(tokenizer_dir, capsys, extra, message) -> None:
    argv = _argv("http://127.0.0.1:9", tokenizer_dir)
    assert message in one_line_refusal(bench_serving.main, argv + extra, capsys)
