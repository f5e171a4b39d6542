"""compare_strategies: a prompt the builder cannot make is refused before any server starts, and
--shared-prefix-len is taken as bench_serving takes it (benchmark.md: "the workload flags are the
same as bench_serving's").

The tester's repro: ``--long-len 32 --short-len 1`` started both servers, then ended with a
ValueError traceback; ``--shared-prefix-len 8`` was an unrecognized argument.  No server is started
here.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cli_refusal_support import one_line_refusal
from lightllm.benchmark import compare_strategies
from lightllm.benchmark.pd_cluster import PdCluster
from lightllm.benchmark.server_process import ServerProcess


@pytest.fixture
def reached(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The calls that reached the run (where the servers would start)."""
    calls: list[tuple[Any, ...]] = []

    def run_comparison(*args: Any) -> None:
        calls.append(args)
        raise KeyboardInterrupt  # ends main() right there, as a Ctrl-C would

    monkeypatch.setattr(compare_strategies, "run_comparison", run_comparison)
    return calls


def _argv(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["--model_dir", str(model_dir), "--out-dir", str(out), "--strategies", "default,hrrn", "--output-len", "4",
            *extra]


# Small enough for the tiny model's 1024-token context.
SHARED_PREFIX = ["--prefix-tokens", "64", "--duration", "1"]


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        compare_strategies.main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("note:")]
    assert refused.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


def test_a_prompt_with_no_room_for_content_is_refused_before_any_server(tiny_llama_dir, tmp_path, capsys, reached):
    argv = _argv(tiny_llama_dir, tmp_path / "out", "--workload", "long_first", "--long-len", "32", "--short-len", "1",
                 "--long-count", "1")
    line = _refused(argv, capsys)
    assert line.startswith("error: --workload long_first has a short request of 1 prompt tokens (--short-len), "
                           "which leaves no room for content"), line
    assert not reached and not (tmp_path / "out").exists()


def test_a_shared_prefix_longer_than_a_prompt_is_refused_before_any_server(tiny_llama_dir, tmp_path, capsys, reached):
    argv = _argv(tiny_llama_dir, tmp_path / "out", "--workload", "long_first,shared_prefix", "--long-len", "64",
                 "--short-len", "8", "--shared-prefix-len", "100", *SHARED_PREFIX)
    line = _refused(argv, capsys)
    assert line.startswith("error: --shared-prefix-len 100 leaves no token of its own to a short request of 8 prompt "
                           "tokens (--short-len) of workload long_first"), line
    assert not reached and not (tmp_path / "out").exists()


def test_shared_prefix_len_reaches_the_workloads_that_read_it(tiny_llama_dir, tmp_path, reached):
    argv = _argv(tiny_llama_dir, tmp_path / "out", "--workload", "long_first,shared_prefix", "--long-len", "64",
                 "--short-len", "8", "--shared-prefix-len", "6", *SHARED_PREFIX)
    assert compare_strategies.main(argv) == 130
    (options, _topology, builder), = reached
    assert options.shared_prefix_len == 6 and builder is not None  # the tokenizer is loaded once, up front
    configs = {w.name: options.benchmark_config("http://h", w, "n") for w in options.workloads}
    # shared_prefix shares prefixes its own way (the builder refuses both at once).
    assert configs["long_first"].shared_prefix_len == 6 and configs["shared_prefix"].shared_prefix_len == 0


@pytest.mark.parametrize("extra, message", [
    (["--workload", "shared_prefix", "--shared-prefix-len", "4", *SHARED_PREFIX],
     "--shared-prefix-len does not apply to --workload shared_prefix (it applies to interleaved, long_first, "
     "sustained)"),
    (["--workload", "long_first", "--shared-prefix-len", "-1"], "--shared-prefix-len must be >= 0, got -1"),
])
def test_shared_prefix_len_is_checked_like_bench_serving_s(tiny_llama_dir, tmp_path, capsys, reached, extra,
                                                           message):
    line = _refused(_argv(tiny_llama_dir, tmp_path / "out", "--long-len", "64", "--short-len", "8", *extra), capsys)
    assert message in line, line
    assert not reached


def test_every_workload_flag_of_bench_serving_is_a_compare_strategies_flag(monkeypatch):
    from cli_refusal_support import parser_of
    from lightllm.benchmark import bench_serving

    serving = parser_of(bench_serving.main, monkeypatch)
    workload_group = next(g for g in serving._action_groups if g.title.startswith("workload"))
    flags = {f for action in workload_group._group_actions for f in action.option_strings}
    compare = {f for action in parser_of(compare_strategies.main, monkeypatch)._actions for f in action.option_strings}
    assert flags - compare == set()


def test_a_pd_cluster_s_report_entry_describes_its_master_at_top_level(tmp_path):
    """meta.servers.<strategy>: the pid, the URL and the command all of the master (the one measured)."""
    processes = {
        role: ServerProcess(SimpleNamespace(pid=pid), f"http://127.0.0.1:{port}", tmp_path / f"{role}.log",
                            ["python", "-m", "lightllm.server.api_server", "--run_mode", role])
        for role, pid, port in (("master", 11, 45100), ("prefill", 12, 45101), ("decode", 13, 45102))
    }
    described = PdCluster(processes).describe()
    assert described["pid"] == 11 and described["base_url"] == "http://127.0.0.1:45100"
    assert described["command"] == processes["master"].command
    assert described["processes"]["prefill"]["command"][-1] == "prefill"
