"""Command line and option checks of the strategy-comparison runner (no servers started)."""

from __future__ import annotations

import dataclasses

import pytest

from lightllm.benchmark.compare_strategies import DEFAULT_KV_TOKENS, build_parser, options_from_args


def _options(tmp_path, *extra):
    (tmp_path / "config.json").write_text("{}")  # the flag's type asks for a checkpoint directory
    argv = ["--model_dir", str(tmp_path), "--out-dir", str(tmp_path / "out"), *extra]
    return options_from_args(build_parser().parse_args(argv), argv)


def test_workload_flags_reach_every_workload(tmp_path):
    options = _options(
        tmp_path, "--workload", "long_first,interleaved", "--long-count", "16", "--long-len", "2048",
        "--request-rate", "0.8", "--duration", "3", "--short-output-len", "8", "--seed", "4",
    )
    assert [w.name for w in options.workloads] == ["long_first", "interleaved"]
    for workload in options.workloads:
        assert (workload.long_count, workload.long_len, workload.seed) == (16, 2048, 4)
        assert (workload.request_rate, workload.duration_s) == (0.8, 3.0)
        assert (workload.short_output_len, workload.long_output_len) == (8, None)
    options.validate()


def test_defaults_and_command(tmp_path):
    options = _options(tmp_path, "--workload", "long_first", "--server-args", "--chunked_prefill_size 256")
    assert options.strategies == ["default", "promote_shortest", "hrrn"]
    assert (options.baseline, options.repeats, options.warmup) == ("default", 3, 1)
    assert options.server_args == ["--chunked_prefill_size", "256"]
    assert "compare_strategies" in options.command and "'--chunked_prefill_size 256'" in options.command


def test_kv_capacity_is_fixed_only_when_not_given(tmp_path):
    options = _options(tmp_path, "--workload", "long_first", "--server-args", "--batch_max_tokens 64")
    expected = ["--batch_max_tokens", "64", "--max_total_token_num", str(DEFAULT_KV_TOKENS)]
    assert options.effective_server_args() == expected
    given = _options(tmp_path, "--workload", "long_first", "--server-args=--max_total_token_num=4096")
    assert given.effective_server_args() == ["--max_total_token_num=4096"]


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--workload", "bogus"], "workload must be one of"),
        (["--workload", "long_first", "--strategies", "default,fifo"], "unknown"),
        (["--workload", "long_first", "--strategies", "hrrn,hrrn"], "must not repeat"),
        (["--workload", "long_first", "--strategies", "hrrn"], "baseline must be one of"),
        (["--workload", "long_first", "--repeats", "0"], "repeats"),
        (["--workload", "long_first", "--warmup", "-1"], "warmup"),
        (["--workload", "long_first", "--long-count", "-2"], "long_count"),
        (["--workload", "interleaved", "--request-rate", "0"], "request_rate"),
        (["--workload", "long_first", "--confidence", "1.5"], "confidence"),
        (["--workload", "long_first", "--server-args", "--port 9"], "server_args must not set --port"),
        (["--workload", "long_first", "--server-args", "'unclosed"], "server_args"),
        (["--workload", "long_first", "--seed", "-1"], "seed must be an integer >= 0, got -1"),
        (["--workload", "sustained", "--seed", "-1"], "seed must be an integer >= 0, got -1"),
    ],
)
def test_bad_options_are_rejected(tmp_path, extra, match):
    with pytest.raises(ValueError, match=match):
        options = _options(tmp_path, *extra)
        options.validate()
        options.effective_server_args()


def test_model_dir_must_exist(tmp_path):
    options = _options(tmp_path, "--workload", "long_first")
    with pytest.raises(ValueError, match="model_dir"):
        dataclasses.replace(options, model_dir=str(tmp_path / "missing")).validate()


def test_a_directory_that_holds_no_checkpoint_or_no_name_is_refused_before_any_server(tmp_path, capsys):
    """An empty directory reached the tokenizer (a traceback); an empty --out-dir wrote into the cwd."""
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["--model_dir", str(tmp_path), "--out-dir", str(tmp_path / "out")])
    assert refused.value.code == 2 and "no config.json there" in capsys.readouterr().err
    from lightllm.benchmark.comparison_options import check_out_dir

    with pytest.raises(ValueError, match="--out-dir must name a directory"):
        check_out_dir("")


def test_a_workload_flag_no_listed_workload_reads_is_refused_before_any_server(tmp_path, capsys):
    """--request-rate with long_first alone was ignored by every run."""
    from lightllm.benchmark.compare_strategies import main

    (tmp_path / "config.json").write_text("{}")
    base = ["--model_dir", str(tmp_path), "--out-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as refused:
        main([*base, "--workload", "long_first", "--request-rate", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(err) == 1
    assert "--request-rate does not apply to --workload long_first" in err[0] and "sustained" in err[0]
    assert not (tmp_path / "out").exists()
    # A flag one of the listed workloads reads applies to all of them.
    from lightllm.benchmark.compare_strategies import check_workload_flags_apply

    check_workload_flags_apply(["long_first", "sustained"], {"request_rate": "--request-rate"})


def _refused_before_anything_starts(tmp_path, monkeypatch, capsys, *extra) -> str:
    """The one error line ``compare_strategies`` exits 2 with; it never reached the run."""
    from lightllm.benchmark import compare_strategies

    def never(*_args, **_kwargs):
        raise AssertionError("the run was reached: prompts built and servers started")

    monkeypatch.setattr(compare_strategies, "run_comparison", never)
    (tmp_path / "config.json").write_text("{}")
    argv = ["--model_dir", str(tmp_path), "--out-dir", str(tmp_path / "out"), "--workload", "long_first", *extra]
    with pytest.raises(SystemExit) as refused:
        compare_strategies.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert not (tmp_path / "out").exists()
    return err[0]


@pytest.mark.parametrize("host, message", [
    ("not_a_host!!", "argument --host: no server can listen on 'not_a_host!!' here"),
    ("no-such-host.invalid", "argument --host: no server can listen on 'no-such-host.invalid' here"),
    ("192.0.2.1", "argument --host: no server can listen on '192.0.2.1' here"),  # TEST-NET-1: no machine's own
    ("::1", "argument --host: '::1' is an IPv6 address; the servers are started on IPv4"),
    ("", "argument --host: must name a host"),
])
def test_a_host_no_server_can_listen_on_is_refused_before_anything_starts(host, message, tmp_path, monkeypatch, capsys):
    """It passed until the first launch bound a port there: a socket.gaierror or OSError 99 traceback."""
    assert message in _refused_before_anything_starts(tmp_path, monkeypatch, capsys, "--host", host)


def test_a_host_of_this_machine_is_taken(tmp_path):
    for host in ("127.0.0.1", "localhost"):
        assert _options(tmp_path, "--workload", "long_first", "--host", host) is not None


@pytest.mark.parametrize("extra, message", [
    (["--settle", "inf"], "argument --settle: must be a finite number, got 'inf'"),
    (["--settle", "nan"], "argument --settle: must be a finite number, got 'nan'"),
    (["--settle", "1e12"], "--settle must be a finite number of seconds, at most 600, got 1e+12"),
    (["--start-timeout", "inf"], "argument --start-timeout: must be a finite number"),
    (["--request-timeout", "nan"], "argument --request-timeout: must be a finite number"),
    (["--output-len", "0"], "--output-len must be > 0, got 0"),
])
def test_times_and_lengths_are_refused_naming_the_flag_typed(extra, message, tmp_path, monkeypatch, capsys):
    """--settle inf / nan / 1e12 crashed in time.sleep after the servers started; --output-len 0 was
    refused as --short-output-len, a flag the user did not type."""
    assert message in _refused_before_anything_starts(tmp_path, monkeypatch, capsys, *extra)


def test_a_per_class_output_length_is_named_when_it_is_the_bad_one():
    from lightllm.benchmark.workloads import WorkloadConfig, build_workload

    with pytest.raises(ValueError, match="^short_output_len must be > 0"):
        build_workload(WorkloadConfig(name="long_first", short_output_len=0))
    with pytest.raises(ValueError, match="^output_len must be > 0"):
        build_workload(WorkloadConfig(name="long_first", output_len=0, long_output_len=4))
    # Both classes have their own length: output_len is read by neither.
    build_workload(WorkloadConfig(name="long_first", output_len=0, long_output_len=4, short_output_len=4))


def test_kv_tokens_fewer_than_the_servers_context_are_refused_before_any_server(tiny_llama_dir, tmp_path,
                                                                                 monkeypatch, capsys):
    """It started every server, which refused the KV cache naming --max_total_token_num, a flag the
    user did not type (bench_prefix_affinity already refused it up front)."""
    from lightllm.benchmark import compare_strategies

    def never(*_args, **_kwargs):
        raise AssertionError("the run was reached: prompts built and servers started")

    monkeypatch.setattr(compare_strategies, "run_comparison", never)
    argv = ["--model_dir", str(tiny_llama_dir), "--out-dir", str(tmp_path / "out"), "--workload", "long_first",
            "--long-len", "30", "--short-len", "5", "--output-len", "2", "--kv-tokens", "10"]
    with pytest.raises(SystemExit) as refused:
        compare_strategies.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(err) == 1, err
    assert "--kv-tokens 10 is fewer than" in err[0] and "--max_total_token_num" not in err[0], err[0]
    assert not (tmp_path / "out").exists()
