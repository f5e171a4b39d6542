"""The benchmark and simulator commands refuse bad flags in one line naming the flag, before they
start anything (a run that fails only at its end, or with a traceback, wastes the run)."""

from __future__ import annotations

import pytest

from lightllm.benchmark import bench_runtime, bench_serving, compare_strategies
from lightllm.benchmark.comparison_options import check_server_args
from lightllm.benchmark.simulator import __main__ as simulator_cli
from lightllm.benchmark.simulator import bound_sweep


def _refused(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in lines[0]
    return lines[0]


@pytest.mark.parametrize("extra, message", [
    (["--output-len", "0"], "--output-len must be > 0"),
    (["--long-count", "-1"], "--long-count must be >= 0"),
    (["--workload", "sustained", "--request-rate", "0"], "--request-rate must be a finite number > 0"),
    (["--workload", "shared_prefix", "--prefix-groups", "0"], "--prefix-groups must be > 0"),
    (["--output-json", "/no/such/dir/out.json"], "the directory of '/no/such/dir/out.json' does not exist"),
])
def test_bench_serving_names_the_flag(tiny_llama_dir, capsys, extra, message):
    argv = ["--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", str(tiny_llama_dir), *extra]
    assert message in _refused(bench_serving.main, argv, capsys)


def test_bench_serving_without_a_tokenizer_directory(capsys):
    line = _refused(bench_serving.main, ["--base-url", "http://127.0.0.1:9", "--model", "m",
                                         "--tokenizer", "/no/such/tokenizer"], capsys)
    assert "tokenizer must be a local tokenizer directory" in line


def test_compare_strategies_refuses_server_args_the_launcher_owns(tiny_llama_dir):
    with pytest.raises(ValueError, match="must not set --prefill_queue_strategy"):
        check_server_args(str(tiny_llama_dir), "default", ["--prefill_queue_strategy", "hrrn"])
    check_server_args(str(tiny_llama_dir), "default", ["--chunked_prefill_size", "256"])


@pytest.mark.parametrize("extra, message", [
    (["--out-dir", "/proc/forbidden/x"], "--out-dir '/proc/forbidden/x' cannot be created or written"),
    (["--seed", "-1"], "seed must be an integer >= 0, got -1"),
    (["--workload", "sustained", "--seed", "-1"], "seed must be an integer >= 0, got -1"),
])
def test_compare_strategies_refuses_before_any_server_starts(tiny_llama_dir, tmp_path, capsys, extra, message):
    # Lengths within the tiny model's context, so only the flag under test is wrong (each flag
    # once: the parser refuses one typed twice).
    flags = {"--model_dir": str(tiny_llama_dir), "--workload": "long_first", "--long-len": "256",
             "--out-dir": str(tmp_path / "out"), **dict(zip(extra[::2], extra[1::2]))}
    argv = [item for pair in flags.items() for item in pair]
    assert message in _refused(compare_strategies.main, argv, capsys)
    assert not (tmp_path / "out" / "logs").exists()  # no server was started


def test_bench_serving_refuses_a_negative_seed(tiny_llama_dir, capsys):
    argv = ["--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", str(tiny_llama_dir), "--seed", "-1"]
    assert "seed must be >= 0, got -1" in _refused(bench_serving.main, argv, capsys)


def test_a_server_flag_the_server_refuses_ends_the_comparison_with_its_one_line(tiny_llama_dir, tmp_path, capsys):
    argv = ["--model_dir", str(tiny_llama_dir), "--workload", "long_first", "--long-count", "1", "--short-count", "1",
            "--long-len", "256", "--repeats", "1", "--warmup", "0", "--out-dir", str(tmp_path / "out"), "--server-args", "--bogus_flag 1"]
    assert compare_strategies.main(argv) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "unrecognized arguments: --bogus_flag (and 1 value, not shown" in errors[0], errors


@pytest.mark.parametrize("argv, message", [
    (["--strategies", "bogus"], "--strategies must name some of default"),
    (["--bases", "abc"], "--bases takes a comma list of ints; got 'abc'"),
    (["--fractions", "x"], "--fractions takes a comma list of floats; got 'x'"),
])
def test_bound_sweep_names_the_flag(capsys, argv, message):
    assert message in _refused(bound_sweep.main, argv, capsys)


def test_simulator_refuses_an_output_path_it_could_not_write_before_running(capsys):
    line = _refused(simulator_cli.main, ["--scenario", "long_first", "--json", "/no/such/dir/x.json"], capsys)
    assert "the directory of '/no/such/dir/x.json' does not exist" in line


def test_bench_runtime_needs_a_checkpoint_directory(capsys):
    assert "--model_dir must be a local checkpoint directory" in _refused(
        bench_runtime.main, ["--model_dir", "/no/such/model"], capsys)
