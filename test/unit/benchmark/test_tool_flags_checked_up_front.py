"""Flags an outside pass found unchecked, ignored or named by their field: refused in one line first.

Each test makes the work after the check (a model load, a measurement, a server launch, the
tokenizer) fail loudly, so a refusal that comes late, or not at all, fails the test.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from cli_refusal_support import one_line_refusal

from lightllm.benchmark import (bench_burst, bench_hf_baseline, bench_runtime, bench_serving, compare_strategies,
                                health_latency, process_footprint, side_by_side)
from lightllm.benchmark.cli_args import OneLineErrorParser, given_flags, with_flag_names
from lightllm.benchmark.simulator import schedule_cost
from lightllm.utils import demo_model
from lightllm.benchmark.workloads import COMMON_KNOBS, WORKLOAD_KNOBS, WORKLOADS, WorkloadConfig, build_workload

TINY_CONTEXT = 1024  # max_position_embeddings of the tiny demo checkpoints


def _never(*args, **kwargs):
    raise AssertionError("work started before the flags were checked")


# --- 1. bench_runtime and bench_hf_baseline: prompt plus output within the model's context -----


@pytest.mark.parametrize("tool, output_flag", [(bench_runtime, "--new-tokens"), (bench_hf_baseline, "--output-len")])
def test_a_sequence_longer_than_the_context_is_refused_before_the_model_loads(
    tool, output_flag, tiny_llama_dir, monkeypatch, capsys
):
    monkeypatch.setattr(tool, "run", _never)
    argv = ["--model_dir", str(tiny_llama_dir), "--prompt-len", str(TINY_CONTEXT - 3), output_flag, "4"]
    line = one_line_refusal(tool.main, argv, capsys)
    assert "--prompt-len 1021" in line and f"{output_flag} 4" in line and "1025" in line
    assert f"context of {TINY_CONTEXT}" in line and "max_position_embeddings" in line


@pytest.mark.parametrize("tool, output_flag", [(bench_runtime, "--new-tokens"), (bench_hf_baseline, "--output-len")])
def test_a_sequence_that_fills_the_context_exactly_is_run(tool, output_flag, tiny_llama_dir, monkeypatch):
    class Ran(Exception):
        pass

    def ran(*args, **kwargs):
        raise Ran

    monkeypatch.setattr(tool, "run", ran)
    with pytest.raises(Ran):
        tool.main(["--model_dir", str(tiny_llama_dir), "--prompt-len", str(TINY_CONTEXT - 4), output_flag, "4"])


def test_a_checkpoint_whose_config_cannot_be_read_is_refused_naming_the_flag(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(bench_runtime, "run", _never)
    line = one_line_refusal(bench_runtime.main, ["--model_dir", str(tmp_path)], capsys)
    assert "--model_dir" in line and "config.json" in line


# --- 2 and 3. schedule_cost: bounded sizes; a flag of the layout that does not run is refused ---


# The bounds docs/EN/simulator.md gives: 100,000 waiting and 10,000 running requests.
@pytest.mark.parametrize("argv, flag", [
    (["--sizes", "100", "100001"], "--sizes"),
    (["--sizes", "10000000000"], "--sizes"),
    (["--layout", "server", "--running", "10001"], "--running"),
])
def test_schedule_cost_sizes_are_bounded(argv, flag, monkeypatch, capsys):
    monkeypatch.setattr(schedule_cost, "run", _never)
    monkeypatch.setattr(schedule_cost, "run_server", _never)
    line = one_line_refusal(schedule_cost.main, argv, capsys)
    assert flag in line and "within" in line


def test_schedule_cost_runs_at_its_bound(monkeypatch):
    sizes = []
    monkeypatch.setattr(schedule_cost, "run", lambda found, *args, **kwargs: sizes.extend(found) or [])
    schedule_cost.main(["--layout", "engine", "--sizes", "100000"])
    assert sizes == [100000]


@pytest.mark.parametrize("layout, argv", [
    ("engine", ["--running", "5"]),
    ("engine", ["--kv-view", "count"]),
    ("engine", ["--server-repeats=3"]),
    ("engine", ["--server-warmup", "3"]),
    ("server", ["--repeats", "3"]),
    ("server", ["--warmup", "0"]),
])
def test_schedule_cost_refuses_a_flag_its_layout_would_ignore(layout, argv, monkeypatch, capsys):
    monkeypatch.setattr(schedule_cost, "run", _never)
    monkeypatch.setattr(schedule_cost, "run_server", _never)
    line = one_line_refusal(schedule_cost.main, ["--layout", layout, *argv], capsys)
    assert argv[0].split("=")[0] in line and f"--layout {layout}" in line


# --- 4. bench_serving: no flag of another workload; the server is reached before the tokenizer ---


@pytest.mark.parametrize("workload, argv", [
    ("interleaved", ["--long-count", "3"]),
    ("long_first", ["--request-rate", "10"]),
    ("interleaved", ["--long-spread-ms=5"]),
    ("sustained", ["--prefix-groups", "2"]),
    ("shared_prefix", ["--burstiness", "2"]),
    ("shared_prefix", ["--shared-prefix-len", "8"]),
])
def test_bench_serving_refuses_a_flag_the_workload_would_ignore(workload, argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_serving, "check_reachable", _never)
    monkeypatch.setattr(bench_serving, "load_tokenizer", _never)
    line = one_line_refusal(bench_serving.main, ["--tokenizer", str(tmp_path), "--workload", workload, *argv], capsys)
    assert argv[0].split("=")[0] in line and f"--workload {workload}" in line


def test_bench_serving_takes_every_flag_its_workload_uses(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_serving, "check_reachable", lambda *args: "stop here")
    argv = ["--tokenizer", str(tmp_path), "--workload", "sustained", "--request-rate", "5", "--duration", "2",
            "--initial-long-count", "1", "--long-spread-ms", "3", "--long-len", "50", "--seed", "2",
            "--shared-prefix-len", "4"]
    assert bench_serving.main(argv) == 1  # past the flag checks, stopped at the reachability check


def test_the_knob_map_is_true():
    """A knob outside a workload's set changes nothing in its schedule (so refusing it loses nothing),
    and every knob inside it changes something (so the refusal is no broader than it must be)."""
    base_knobs = dict(long_count=2, short_count=2, num_requests=6, duration_s=0.5, request_rate=40.0, long_len=64,
                      short_len=8, output_len=4, prefix_tokens=16, initial_long_count=2)
    changed = dict(long_count=5, short_count=7, long_spread_ms=9.0, short_start_ms=3.0, short_spread_ms=11.0,
                   request_rate=55.0, long_every=2, num_requests=9, duration_s=0.7, long_fraction=0.6, burstiness=0.5,
                   initial_long_count=3, stream_start_ms=4.0, prefix_groups=3, prefix_tokens=12, chat_turns=2)
    fields = {field.name for field in dataclasses.fields(WorkloadConfig)} - {"name"}
    assert set(changed) | COMMON_KNOBS == fields and not set(changed) & COMMON_KNOBS
    for name in WORKLOADS:
        base = WorkloadConfig(name=name, **base_knobs)
        for knob, value in changed.items():
            same = build_workload(dataclasses.replace(base, **{knob: value})) == build_workload(base)
            assert same == (knob not in WORKLOAD_KNOBS[name]), (name, knob)


def test_bench_serving_reports_an_unreachable_server_before_loading_the_tokenizer(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_serving, "load_tokenizer", _never)
    capsys.readouterr()
    status = bench_serving.main(["--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1, err
    assert err[0].startswith("error: cannot reach the server at http://127.0.0.1:9 (--base-url)")


# --- 5. process_footprint: an --entry module that cannot be found, before any launch ------------


@pytest.mark.parametrize("entry, why", [
    ("router=lightllm.server.no_such_module", "no module named 'lightllm.server.no_such_module'"),
    ("router=no_such_package_xyz.manager", "no module named 'no_such_package_xyz.manager'"),
    ("router=not a module", "is not a module name"),
])
def test_process_footprint_refuses_an_entry_module_that_cannot_be_found(
    entry, why, tiny_llama_dir, monkeypatch, capsys
):
    monkeypatch.setattr(process_footprint, "launch_and_measure", _never)
    argv = ["--model_dir", str(tiny_llama_dir), "--entry", entry]
    line = one_line_refusal(process_footprint.main, argv, capsys)
    assert "--entry" in line and why in line


# --- 6. compare_strategies names the flags, not the option fields --------------------------------


@pytest.mark.parametrize("argv, flag", [
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--long-count", "-2"], "--long-count must be >= 0"),
    (["--settle", "-1"], "--settle must be >= 0"),
    (["--request-timeout", "0"], "--request-timeout must be > 0"),
    (["--kv-tokens", "0"], "--kv-tokens must be >= 1"),
    (["--bootstrap-resamples", "50"], "--bootstrap-resamples no longer applies"),
    (["--max-concurrency", "0"], "argument --max-concurrency: must be an integer >= 1, got 0"),
    (["--workload", "long_first,long_first"], "--workload must not repeat"),
    (["--strategies", "default,default"], "--strategies must not repeat"),
    (["--server-args", "--port 9"], "--server-args must not set --port"),
    (["--long-count", "0", "--short-count", "0"], "--long-count + --short-count must be > 0"),
    (["--topology", "1p1d", "--start-timeout", "0"], "--start-timeout must be > 0"),
])
def test_compare_strategies_names_the_flag_the_user_typed(argv, flag, tiny_llama_dir, tmp_path, capsys):
    full = ["--model_dir", str(tiny_llama_dir), "--out-dir", str(tmp_path / "out"), *argv]
    if "--workload" not in argv:
        full += ["--workload", "long_first"]
    line = one_line_refusal(compare_strategies.main, full, capsys)
    assert flag in line, line
    assert not any(f" {name}" in line for name in ("settle_s", "request_timeout_s", "kv_tokens", "long_count"))
    assert not (tmp_path / "out").exists()  # refused before the output directory is created


# --- the shared helpers of lightllm.benchmark.cli_args ------------------------------------------


def test_given_flags_sees_both_spellings_and_only_typed_flags():
    parser = OneLineErrorParser(prog="t")
    parser.add_argument("--long-count", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra", default="")
    argv = ["--long-count", "3", "--extra=--seed"]
    parser.parse_args(argv)
    assert given_flags(parser, argv) == {"long_count": "--long-count", "extra": "--extra"}


def test_with_flag_names_renames_fields_but_not_flags_values_or_plain_words():
    parser = OneLineErrorParser(prog="t")
    for flag in ("--long-count", "--model_dir", "--seed", "--settle"):
        parser.add_argument(flag)
    rename = lambda message: with_flag_names(parser, message, {"settle_s": "--settle"})  # noqa: E731
    assert rename("long_count must be >= 0") == "--long-count must be >= 0"
    assert rename("settle_s must be >= 0, got -1") == "--settle must be >= 0, got -1"
    assert rename("seed must be >= 0; the workload seed") == "--seed must be >= 0; the workload seed"
    assert rename("--model_dir holds 'long_count'") == "--model_dir holds 'long_count'"


def test_missing_module_finds_without_importing():
    code = ("import sys; from lightllm.benchmark.cli_args import missing_module; "
            "assert missing_module('lightllm.server.router.manager') is None; "
            "assert missing_module('lightllm.server.router.no_such') is not None; "
            "assert 'lightllm.server.router' not in sys.modules and 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_bench_burst_names_an_unreachable_server_in_one_line_also_with_a_model(capsys):
    capsys.readouterr()
    status = bench_burst.main(["--base-url", "http://127.0.0.1:9", "--model", "m", "--num-requests", "1",
                               "--rounds", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith("error: cannot reach the server at http://127.0.0.1:9 (--base-url)")


def test_bench_burst_refuses_a_flag_given_twice_before_reaching_the_server(capsys):
    argv = ["--base-url", "http://127.0.0.1:9", "--seed", "1", "--seed", "2"]
    line = one_line_refusal(bench_burst.main, argv, capsys)
    assert line.startswith("error: --seed is given twice; give it once"), line



@pytest.mark.parametrize("flag, value, message", [
    ("--prompt-len", "-1", "--prompt-len must be >= 1, got -1"),
    ("--num-requests", "0", "--num-requests must be >= 1, got 0"),
    ("--output-len", "0", "--output-len must be >= 1, got 0"),
    ("--rounds", "0", "--rounds must be >= 1, got 0"),
    ("--vocab", "5", "--vocab must be > 5"),
])
def test_bench_burst_names_the_one_bad_flag(flag, value, message, capsys):
    """One message used to name all four count flags and --vocab, whichever was wrong."""
    line = one_line_refusal(bench_burst.main, ["--base-url", "http://127.0.0.1:9", flag, value], capsys)
    assert line.startswith(f"error: {message}"), line

# --- 7. a flag typed twice: refused by every tool's parser, not only by those that asked ------


def test_the_project_parser_refuses_a_flag_typed_twice_unless_it_collects_values(capsys):
    parser = OneLineErrorParser(prog="tool")
    parser.add_argument("--seed", "-s", type=int)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--entry", action="append")
    parser.add_argument("-v", action="count")
    assert parser.parse_args(["--entry", "a", "--entry", "b", "-v", "-v"]).entry == ["a", "b"]
    for argv, line in ((["--seed", "1", "--seed=2"], "--seed is given twice"),
                       (["--seed", "1", "-s", "2"], "--seed is given twice (also as -s)"),
                       (["--quiet", "--quiet"], "--quiet is given twice")):
        assert line in one_line_refusal(parser.parse_args, argv, capsys)


@pytest.mark.parametrize("main, argv, flag", [
    (process_footprint.main, ["--model_dir", "{model}", "--repeats", "1", "--repeats", "2"], "--repeats"),
    (health_latency.main, ["--url", "http://127.0.0.1:1", "--duration", "1", "--duration", "2"], "--duration"),
    (demo_model.main, ["--out", "{tmp}/m", "--size", "small", "--size", "medium"], "--size"),
    (side_by_side.main, ["--model_dir", "{model}", "--cases", "1x8x2", "--seed", "1", "--seed", "2"],
     "--seed"),
])
def test_tools_that_did_not_check_refuse_a_flag_typed_twice(main, argv, flag, tiny_llama_dir, tmp_path, monkeypatch,
                                                            capsys):
    """`--seed 1 --seed 2` ran with 2, without a word, in every tool but the few that checked."""
    monkeypatch.setattr(process_footprint, "launch_and_measure", _never)
    argv = [item.format(model=tiny_llama_dir, tmp=tmp_path) for item in argv]
    assert one_line_refusal(main, argv, capsys).startswith(f"error: {flag} is given twice"), argv
    assert not (tmp_path / "m").exists()
