"""Every benchmark tool checks its output paths before it measures anything.

``schedule_cost --json /nonexistent/x.json`` used to measure for a minute and then die with a
FileNotFoundError traceback; the other tools that write results lost their run the same way.
Each case here replaces the tool's long work by a stub that fails the test if it is reached:
the refusal must come first, in one line naming the flag.
"""

from __future__ import annotations

import pytest
import torch
from cli_refusal_support import one_line_refusal

from lightllm.benchmark import (
    bench_attention_backends,
    bench_burst,
    bench_decode_attention,
    bench_hf_baseline,
    bench_prefix_affinity,
    bench_runtime,
    bench_serving,
    process_footprint,
    server_process,
    side_by_side,
    soak_server,
)
from lightllm.benchmark.simulator import __main__ as simulator_cli
from lightllm.benchmark.simulator import derive_h100_profile, fit_cost_profile, schedule_cost

MISSING_DIR = "/no/such/dir/out.json"  # its directory does not exist
UNWRITABLE = "/proc/out.json"  # its directory exists, but no file can be created there
MODEL = "<model>"  # replaced by a real (tiny) checkpoint directory

_CELL = ["--scenario", "long_first", "--modes", "normal", "--budget", "1024", "--strategies", "default"]

# tool, the other flags, the output flag, the long work (module, attribute) replaced by a stub
CASES = [
    ("simulator", simulator_cli.main, _CELL, "--json", [(simulator_cli, "run_matrix")]),
    ("simulator", simulator_cli.main, _CELL, "--markdown", [(simulator_cli, "run_matrix")]),
    ("schedule_cost", schedule_cost.main, [], "--json",
     [(schedule_cost, "run_server"), (schedule_cost, "run"), (schedule_cost, "freeze_startup_objects")]),
    ("fit_cost_profile", fit_cost_profile.main, [], "--out",
     [(fit_cost_profile, "measure"), (fit_cost_profile, "generate_demo_model")]),
    ("derive_h100_profile", derive_h100_profile.main, [], "--out", [(derive_h100_profile, "derive")]),
    ("bench_runtime", bench_runtime.main, ["--model_dir", MODEL], "--json", [(bench_runtime, "run")]),
    ("bench_hf_baseline", bench_hf_baseline.main, ["--model_dir", MODEL], "--output-json",
     [(bench_hf_baseline, "run")]),
    ("bench_decode_attention", bench_decode_attention.main, ["--model_dir", MODEL], "--json",
     [(bench_decode_attention, "load_model")]),
    ("bench_attention_backends", bench_attention_backends.main, ["--model_dir", MODEL, "--device", "cpu"], "--json",
     [(bench_attention_backends, "measure_backend"), (bench_attention_backends, "resolve_attention_backend")]),
    ("bench_burst", bench_burst.main, ["--base-url", "http://127.0.0.1:9", "--model", "m"], "--output-json",
     [(bench_burst, "run_round")]),
    ("bench_serving", bench_serving.main, ["--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", MODEL],
     "--output-json", [(bench_serving, "_run_cli")]),
    ("bench_serving", bench_serving.main, ["--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", MODEL],
     "--output-jsonl", [(bench_serving, "_run_cli")]),
    ("side_by_side", side_by_side.main, ["--model_dir", MODEL, "--cases", "1x8x8", "--engines", "ours"], "--out",
     [(side_by_side, "EngineServer")]),
    ("process_footprint", process_footprint.main, ["--model_dir", MODEL], "--out",
     [(process_footprint, "launch_and_measure"), (process_footprint, "measure_import")]),
    ("bench_prefix_affinity", bench_prefix_affinity.main, ["--model_dir", MODEL], "--out",
     [(bench_prefix_affinity, "run")]),
    ("soak_server", soak_server.main, ["--model_dir", MODEL], "--output-json",
     [(server_process.ServerProcess, "start"), (soak_server, "soak")]),
    ("soak_server", soak_server.main, ["--model_dir", MODEL], "--output-md",
     [(server_process.ServerProcess, "start"), (soak_server, "soak")]),
]

DIR_CASES = [
    ("bench_prefix_affinity", bench_prefix_affinity.main, ["--model_dir", MODEL], "--log-dir",
     [(bench_prefix_affinity, "run")]),
    ("soak_server", soak_server.main, ["--model_dir", MODEL], "--log-dir",
     [(server_process.ServerProcess, "start"), (soak_server, "soak")]),
]


def _stub_long_work(monkeypatch, stubs) -> None:
    def reached(*args, **kwargs):
        raise AssertionError("the tool started its work before checking its output path")

    for owner, name in stubs:
        monkeypatch.setattr(owner, name, reached)
    # bench_runtime and bench_hf_baseline set torch's threads just before measuring.
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)


def _ids(cases):
    return [f"{case[0]}{case[3]}" for case in cases]


@pytest.mark.parametrize("path", [MISSING_DIR, UNWRITABLE])
@pytest.mark.parametrize("tool, main, argv, flag, stubs", CASES, ids=_ids(CASES))
def test_an_output_file_that_cannot_be_written_is_refused_before_the_run(
    tool, main, argv, flag, stubs, path, tiny_llama_dir, monkeypatch, capsys
):
    _stub_long_work(monkeypatch, stubs)
    if tool == "process_footprint" and path == MISSING_DIR:
        path = "/proc/no/such/out.json"  # process_footprint creates missing directories: one it cannot
    argv = [str(tiny_llama_dir) if arg == MODEL else arg for arg in argv]
    line = one_line_refusal(main, [*argv, flag, path], capsys)
    assert flag in line and path in line, line


@pytest.mark.parametrize("tool, main, argv, flag, stubs", CASES[:1], ids=_ids(CASES[:1]))
def test_an_output_file_that_is_a_directory_is_refused(tool, main, argv, flag, stubs, tmp_path, monkeypatch, capsys):
    _stub_long_work(monkeypatch, stubs)
    line = one_line_refusal(main, [*argv, flag, str(tmp_path)], capsys)
    assert flag in line and "directory" in line, line


@pytest.mark.parametrize("path", ["/proc/logs", "/proc/no/such/logs"])
@pytest.mark.parametrize("tool, main, argv, flag, stubs", DIR_CASES, ids=_ids(DIR_CASES))
def test_an_output_directory_that_cannot_be_created_is_refused_before_the_run(
    tool, main, argv, flag, stubs, path, tiny_llama_dir, monkeypatch, capsys
):
    _stub_long_work(monkeypatch, stubs)
    argv = [str(tiny_llama_dir) if arg == MODEL else arg for arg in argv]
    line = one_line_refusal(main, [*argv, flag, path], capsys)
    assert flag in line and path in line, line
