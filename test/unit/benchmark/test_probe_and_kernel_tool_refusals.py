"""health_latency, process_footprint and the kernel benchmarks refuse what would measure nothing.

An outside pass found health_latency exiting 0 with no server listening, with negative durations
or with zero-token streams every one of which the server refused; process_footprint ending in a
traceback (and a temporary directory left behind) when the server refused its flags; and the
kernel benchmarks accepting ``--threads 0``, negative seeds and thresholds, and contexts past the
checkpoint's.  Each refusal here is one ``error:`` line before any work (exit 2), or, for what can
only be known once a server runs, one line and exit 1.
"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path
from typing import List

import pytest
import torch
from cli_refusal_support import one_line_refusal

from lightllm.benchmark import (bench_attention_backends, bench_decode_attention, bench_linear_backends, bench_runtime,
                                health_latency, process_footprint)
from lightllm.benchmark import server_process
from lightllm.common.basemodel.attention.selection import cpp_compiler


def _never(*args, **kwargs):
    raise AssertionError("the tool started its work before checking its flags")


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


# --- health_latency ----------------------------------------------------------------------------

_URL = ["--url", "http://127.0.0.1:9"]


@pytest.mark.parametrize("argv, flag", [
    (["--url", "notaurl"], "--url"),
    (["--url", "https://127.0.0.1:8000"], "--url"),
    (["--url", "http://127.0.0.1:99999"], "--url"),
    ([*_URL, "--duration", "-1"], "--duration"),
    ([*_URL, "--duration", "0"], "--duration"),
    ([*_URL, "--streams", "-1"], "--streams"),
    ([*_URL, "--hold", "-1"], "--hold"),
    ([*_URL, "--warmup", "-1"], "--warmup"),
    ([*_URL, "--probe_interval", "0"], "--probe_interval"),
    ([*_URL, "--max_new_tokens", "0"], "--max_new_tokens"),
    ([*_URL, "--probe_path", "health"], "--probe_path"),
    ([*_URL, "--server_args", "--max_total_token_num 4096"], "--server_args"),
    ([*_URL, "--hold", "1", "--hold_source", "192.0.2.1"], "--hold_source"),
    (["--model_dir", "/no/such/model"], "--model_dir"),
])
def test_health_latency_refuses_values_that_measure_nothing(argv, flag, monkeypatch, capsys) -> None:
    monkeypatch.setattr(health_latency, "_load", _never)
    assert flag in one_line_refusal(health_latency.main, argv, capsys)


def _ipv6_listener() -> socket.socket:
    try:
        sock = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    return sock


@pytest.mark.parametrize("source, message", [
    (None, "--hold against an IPv6 server (http://[::1]:PORT) needs --hold_source"),
    ("127.0.0.2", "--hold_source 127.0.0.2 is an IPv4 address and the server (http://[::1]:PORT) an IPv6 one"),
])
def test_health_latency_hold_against_ipv6_needs_an_ipv6_source_up_front(source, message, monkeypatch, capsys) -> None:
    """The default 127.0.0.2 reached no IPv6 server, and that was said only after the full run."""
    monkeypatch.setattr(health_latency, "_load", _never)
    with _ipv6_listener() as listener:
        url = f"http://[::1]:{listener.getsockname()[1]}"
        argv = ["--url", url, "--hold", "1", *([] if source is None else ["--hold_source", source])]
        line = one_line_refusal(health_latency.main, argv, capsys)
    assert message.replace("http://[::1]:PORT", url) in line


def test_health_latency_holds_from_an_ipv6_source(monkeypatch, capsys) -> None:
    """--hold_source ::1 was refused ("Address family for hostname not supported"): the check bound an IPv4 socket."""
    reached = []

    async def load(args, host, port):
        reached.append((args.hold_source, host))
        raise health_latency.ProberEnded("stopped here")

    monkeypatch.setattr(health_latency, "_load", load)
    with _ipv6_listener() as listener:
        assert health_latency.main(["--url", f"http://[::1]:{listener.getsockname()[1]}", "--hold", "1",
                                    "--hold_source", "::1"]) == 1
    assert reached == [("::1", "::1")]


@pytest.mark.parametrize("server_args", ["--port 8000", "--host=0.0.0.0", "--model_dir /x"])
def test_health_latency_refuses_server_flags_it_sets_itself(server_args, tiny_llama_dir, monkeypatch, capsys) -> None:
    monkeypatch.setattr(server_process.ServerProcess, "start", _never)
    line = one_line_refusal(health_latency.main, ["--model_dir", str(tiny_llama_dir), f"--server_args={server_args}"],
                            capsys)
    assert "--server_args" in line and server_args.split("=")[0].split()[0] in line


def test_health_latency_names_a_server_it_cannot_reach(monkeypatch, capsys) -> None:
    monkeypatch.setattr(health_latency, "_load", _never)
    # Bound but not listening: connecting is refused, and no other program can take the port meanwhile.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        assert health_latency.main(["--url", url, "--duration", "1"]) == 1
    line = _one_error_line(capsys)
    assert f"cannot reach the server at {url}" in line


def test_health_latency_reports_a_server_refusal_in_one_line_and_leaves_no_log(tiny_llama_dir, tmp_path, monkeypatch,
                                                                                capsys) -> None:
    log_dir = tmp_path / "logs"

    def refuse(args, log_path: Path, **kwargs):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("loading\nerror: argument --max_total_token_num: invalid int value: 'abc'\n")
        raise server_process.ServerRefusedError(f"server refused to start (exit code 2, log {log_path}): error: ...")

    monkeypatch.setattr(health_latency.tempfile, "mkdtemp", lambda prefix: str(log_dir))
    monkeypatch.setattr(server_process.ServerProcess, "start", refuse)
    monkeypatch.setattr(health_latency, "_load", _never)
    argv = ["--model_dir", str(tiny_llama_dir), "--server_args", "--max_total_token_num abc"]
    assert health_latency.main(argv) == 1
    line = _one_error_line(capsys)
    assert line == "error: the server refused to start: argument --max_total_token_num: invalid int value: 'abc'"
    assert not log_dir.exists()


def _args(streams: int = 4, hold: int = 0) -> argparse.Namespace:
    return argparse.Namespace(streams=streams, hold=hold, hold_source="127.0.0.2")


def _report(ok: int = 5, held: int = 0, statuses=None) -> dict:
    statuses = {"200": 10} if statuses is None else statuses
    return {"probes": sum(statuses.values()), "statuses": statuses,
            "load": {"ok": ok, "refused": 7, "broken": 0, "connect_errors": 0, "held": held}}


def test_health_latency_calls_a_run_without_served_streams_or_answers_a_failure() -> None:
    assert health_latency.measured_nothing(_args(), _report()) is None
    assert health_latency.measured_nothing(_args(streams=0), _report(ok=0)) is None  # probing an idle server on purpose
    assert "no stream was served (7 refused" in health_latency.measured_nothing(_args(), _report(ok=0))
    assert "--hold_source" in health_latency.measured_nothing(_args(hold=3), _report(held=0))
    assert health_latency.measured_nothing(_args(hold=3), _report(held=3)) is None
    assert "none of the 10 probes" in health_latency.measured_nothing(_args(), _report(statuses={"0": 10}))
    assert health_latency.measured_nothing(_args(), _report(statuses={"0": 9, "200": 1})) is None


# --- process_footprint -------------------------------------------------------------------------


@pytest.mark.parametrize("server_args", ["--port 4", "--host=0.0.0.0"])
def test_process_footprint_refuses_server_flags_it_sets_itself(server_args, tiny_llama_dir, monkeypatch,
                                                               capsys) -> None:
    monkeypatch.setattr(process_footprint, "launch_and_measure", _never)
    line = one_line_refusal(process_footprint.main, ["--model_dir", str(tiny_llama_dir), "--skip_imports",
                                                     f"--server_args={server_args}"], capsys)
    assert "--server_args" in line and server_args.split("=")[0].split()[0] in line


def test_process_footprint_reports_a_refused_start_in_one_line_and_removes_its_logs(tiny_llama_dir, tmp_path,
                                                                                    monkeypatch, capsys) -> None:
    log_dir = tmp_path / "footprint"
    log_dir.mkdir()
    monkeypatch.setattr(process_footprint.tempfile, "mkdtemp", lambda prefix: str(log_dir))
    refusal = process_footprint.FootprintStartError("the server refused to start (exit code 2): bad flag", True)

    def refuse(*args, **kwargs):
        raise refusal

    monkeypatch.setattr(process_footprint, "launch_and_measure", refuse)
    assert process_footprint.main(["--model_dir", str(tiny_llama_dir), "--skip_imports"]) == 1
    assert _one_error_line(capsys) == "error: launch 1: the server refused to start (exit code 2): bad flag"
    assert not log_dir.exists()


def test_process_footprint_keeps_the_log_it_names_after_a_crash(tiny_llama_dir, tmp_path, monkeypatch, capsys) -> None:
    log_dir = tmp_path / "footprint"
    log_dir.mkdir()
    monkeypatch.setattr(process_footprint.tempfile, "mkdtemp", lambda prefix: str(log_dir))

    def crash(model_dir, server_args, log_path: Path, timeout_s, ports):
        log_path.write_text("Segmentation fault\n")
        raise process_footprint.FootprintStartError(f"the server exited with code -11 (log {log_path})", False)

    monkeypatch.setattr(process_footprint, "launch_and_measure", crash)
    assert process_footprint.main(["--model_dir", str(tiny_llama_dir), "--skip_imports"]) == 1
    line = _one_error_line(capsys)
    assert str(log_dir / "server_0.log") in line and (log_dir / "server_0.log").exists()


def test_a_server_that_refuses_its_flags_ends_the_launch_with_its_one_line(tiny_llama_dir, tmp_path) -> None:
    log_path = tmp_path / "server.log"
    with pytest.raises(process_footprint.FootprintStartError) as failure:
        process_footprint.launch_and_measure(str(tiny_llama_dir), ["--max_total_token_num", "abc"], log_path, 120.0)
    assert failure.value.refused
    message = str(failure.value)
    assert "\n" not in message and "--max_total_token_num" in message and "error: error" not in message


# --- the kernel benchmarks and bench_runtime ---------------------------------------------------


@pytest.mark.parametrize("extra, flag", [
    (["--threads", "0"], "--threads"),
    (["--min-fused-context", "-1"], "--min-fused-context"),
    (["--seed", "-1"], "--seed"),
    (["--dtype", "int8"], "--dtype"),
    (["--steps", "0"], "--steps"),
    (["--backends", "torch,torch"], "--backends"),
    (["--contexts", "8,1024"], "--contexts"),  # 1024 plus the decode steps' tokens: past the 1024-token context
    (["--contexts", "1025", "--phase", "prefill"], "--contexts"),
])
def test_bench_decode_attention_refuses_before_loading_the_model(extra, flag, tiny_llama_dir, monkeypatch,
                                                                 capsys) -> None:
    monkeypatch.setattr(bench_decode_attention, "load_model", _never)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    argv = ["--model_dir", str(tiny_llama_dir), "--contexts", "8", *extra]
    assert flag in one_line_refusal(bench_decode_attention.main, argv, capsys)


@pytest.mark.skipif(cpp_compiler() is None, reason="no C++ compiler on PATH")
def test_bench_decode_attention_refuses_to_time_sdpa_under_the_cpp_label(tiny_llama_dir, monkeypatch, capsys) -> None:
    """--backends torch,cpp --dtype float16 timed gather + SDPA in the cpp column (review)."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    argv = ["--model_dir", str(tiny_llama_dir), "--backends", "torch,cpp", "--dtype", "float16", "--contexts", "8"]
    line = one_line_refusal(bench_decode_attention.main, argv, capsys)
    assert "--attention_backend cpp: the kernel has no variant" in line and "float16" in line, line


def test_bench_decode_attention_counts_the_decode_tokens_in_the_context(tiny_llama_dir, monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench_decode_attention, "load_model", _never)
    added = bench_decode_attention.decode_tokens_added(2, 6)
    argv = ["--model_dir", str(tiny_llama_dir), "--contexts", str(1024 - added + 1)]
    line = one_line_refusal(bench_decode_attention.main, argv, capsys)
    assert f"plus the {added} tokens the decode steps append is 1025 tokens" in line
    with pytest.raises(AssertionError, match="started its work"):  # one token less fits: the model loads
        bench_decode_attention.main(["--model_dir", str(tiny_llama_dir), "--contexts", str(1024 - added)])


@pytest.mark.parametrize("extra, flag", [
    (["--threads", "1", "0"], "--threads"),
    (["--rows", "0"], "--rows"),
    (["--context", "1024"], "--context"),  # plus the token the decode step appends
    (["--prefill", "1025"], "--prefill"),
    (["--repeats", "0"], "--repeats"),
])
def test_bench_linear_backends_refuses_before_loading_the_model(extra, flag, tiny_llama_dir, monkeypatch,
                                                                capsys) -> None:
    monkeypatch.setattr(bench_linear_backends, "run", _never)
    assert flag in one_line_refusal(bench_linear_backends.main, ["--model_dir", str(tiny_llama_dir), *extra], capsys)


def test_bench_runtime_refuses_a_negative_seed(tiny_llama_dir, monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench_runtime, "run", _never)
    line = one_line_refusal(bench_runtime.main, ["--model_dir", str(tiny_llama_dir), "--seed", "-1"], capsys)
    assert "--seed" in line


def _attention_argv(tiny_llama_dir: Path, *extra: str) -> List[str]:
    return ["--model_dir", str(tiny_llama_dir), "--device", "cpu", "--context", "64", "--decode-steps", "4", *extra]


@pytest.mark.parametrize("extra, flag", [(["--dtype", "int8"], "--dtype"), (["--seed", "-1"], "--seed")])
def test_bench_attention_backends_checks_dtype_and_seed_on_cpu_too(extra, flag, tiny_llama_dir, monkeypatch,
                                                                   capsys) -> None:
    monkeypatch.setattr(bench_attention_backends, "measure_backend", _never)
    assert flag in one_line_refusal(bench_attention_backends.main, _attention_argv(tiny_llama_dir, *extra), capsys)


def test_bench_attention_backends_refuses_a_context_past_the_models(tiny_llama_dir, monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench_attention_backends, "measure_backend", _never)
    argv = ["--model_dir", str(tiny_llama_dir), "--device", "cpu", "--context", "1000", "--decode-steps", "64"]
    assert bench_attention_backends.main(argv) == 2
    assert "--context 1000 plus --decode-steps 64 is 1064 tokens" in _one_error_line(capsys)


def test_bench_attention_backends_on_cpu_says_what_it_needs(tiny_llama_dir, monkeypatch, capsys) -> None:
    pytest.importorskip("triton")
    monkeypatch.setattr(bench_attention_backends, "measure_backend", _never)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # Triton reads this knob on every access
    assert bench_attention_backends.main(_attention_argv(tiny_llama_dir)) == 2
    line = _one_error_line(capsys)
    assert "TRITON_INTERPRET=1" in line and "bench_decode_attention" in line and "--attention_backend" not in line


@pytest.mark.parametrize("main, flag", [
    ("bench_serving", "--base-url"), ("bench_burst", "--base-url"), ("health_latency", "--url"),
])
@pytest.mark.parametrize("url", ["http://::1:18610", "http://2001:db8::5", "http://::1:99999"])
def test_an_unbracketed_ipv6_url_is_refused_saying_to_bracket_it(main, flag, url, capsys) -> None:
    """It was refused with "Port could not be cast to integer value as ':1:18610'", naming no cause;
    then with a rebuilt URL that could carry an invalid port ("http://[::1]:99999")."""
    import importlib

    tool = importlib.import_module(f"lightllm.benchmark.{main}")
    line = one_line_refusal(tool.main, [flag, url], capsys)
    assert f"argument {flag}: {url!r}: put the IPv6 address in brackets (as in http://[::1]:8000)" in line, line


@pytest.mark.parametrize("main, flag", [
    ("bench_serving", "--base-url"), ("bench_burst", "--base-url"), ("health_latency", "--url"),
])
@pytest.mark.parametrize("url", ["http://127.0.0.1:0", "http://[::1]:00", "http://localhost:0/v1"])
def test_port_0_is_refused_while_parsing(main, flag, url, capsys) -> None:
    """"--url http://127.0.0.1:0" passed and was reported as "Connection refused" (the server down),
    the very thing server_url checks the port for; its message offered 0..65535."""
    import importlib

    tool = importlib.import_module(f"lightllm.benchmark.{main}")
    line = one_line_refusal(tool.main, [flag, url], capsys)
    assert (f"argument {flag}: {url!r} has no valid port (a number in 1..65535): port 0 is no port a server "
            "listens on") in line, line


@pytest.mark.parametrize("url", ["http://127.0.0.1:", "http://[::1]:/v1", "http://user:pw@localhost:"])
def test_an_empty_port_is_refused_while_parsing(url) -> None:
    """"http://$HOST:$PORT" with PORT unset dialled port 80."""
    import argparse

    from lightllm.benchmark.cli_args import server_url

    with pytest.raises(argparse.ArgumentTypeError, match=r"has no valid port \(a number in 1\.\.65535\): nothing "
                                                         r"follows the ':'$") as refused:
        server_url(url)
    assert "pw" not in str(refused.value)


def test_an_out_of_range_port_is_refused_with_one_range() -> None:
    import argparse

    from lightllm.benchmark.cli_args import server_url

    with pytest.raises(argparse.ArgumentTypeError) as refused:
        server_url("http://127.0.0.1:65536")
    # Not also urlsplit's "Port out of range 0-65535".
    assert str(refused.value) == "'http://127.0.0.1:65536' has no valid port (a number in 1..65535)"
    assert server_url("http://127.0.0.1:1") == "http://127.0.0.1:1"
    assert server_url("http://127.0.0.1:65535") == "http://127.0.0.1:65535"
    assert server_url("http://127.0.0.1") == "http://127.0.0.1"


@pytest.mark.parametrize("url, message", [
    # The scheme first: "https://::1:8000" was told to use "https://[::1]:8000", then refused for https.
    ("https://::1:8000", "must be http://HOST[:PORT], got 'https://::1:8000'"),
    # The password in userinfo was repeated in the refusal.
    ("http://user:s3cret@::1:8000/v1", "'http://user:***@::1:8000/v1': put the IPv6 address in brackets"),
    ("http://user:s3cret@host:99999", "'http://user:***@host:99999' has no valid port"),
    ("ftp://user:s3cret@host", "must be http://HOST[:PORT], got 'ftp://user:***@host'"),
    ("http://user:s3cret@[::1:8000", "'http://user:***@[::1:8000' is not a URL"),
    # urlsplit ends the userinfo at the last "@" before the first "/", "?" or "#", and the mask
    # followed it: an "@", "/" or "?" in the password, or a one-slash typo, showed the password.
    ("http://user:s3@cret@host:99999", "'http://user:***@host:99999' has no valid port"),
    ("http://user:s3cret?x@host:99999", "'http://user:***@host:99999' has no valid port"),
    ("http://user:s3cret/x@host:99999", "'http://user:***@host:99999' has no valid port"),
    ("http:/user:s3cret@host:99999", "must be http://HOST[:PORT], got 'http:/user:***@host:99999'"),
    ("user:s3cret@host:99999", "must be http://HOST[:PORT], got 'user:***@host:99999'"),
])
def test_server_url_checks_the_scheme_first_and_masks_passwords(url, message) -> None:
    import argparse

    from lightllm.benchmark.cli_args import server_url

    with pytest.raises(argparse.ArgumentTypeError) as refused:
        server_url(url, ("http",))
    # Not even in part: "http://u:s3cret?x@h:1" masked the URL, then quoted urlsplit's
    # "Port could not be cast to integer value as 's3cret'".
    assert message in str(refused.value) and "s3" not in str(refused.value) and "cret" not in str(refused.value)
