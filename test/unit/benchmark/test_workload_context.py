"""compare_strategies refuses, before any server starts, a workload longer than the servers' context.

The tester's repro: benchmark.md's 1P1D example gave no size flags, so on the demo model (context
4096) the default 48 prompts of 16384 tokens failed with HTTP 400 in every repeat; the run took 75 s
and exited 1.  No server is started here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from lightllm.benchmark import compare_strategies
from lightllm.benchmark.context_limit import ContextLimit
from lightllm.benchmark.workload_context import check_workloads_fit, length_fields, longest_request, servers_context
from lightllm.benchmark.workloads import WorkloadConfig, build_workload

# The demo model's shape (small), with its 4096-token context.
LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=211, max_position_embeddings=4096)
# Lengths that fit 4096 tokens for every workload.
FITTING = ["--long-len", "2048", "--short-len", "64", "--output-len", "32"]


def _model_dir(tmp_path: Path, **extra: Any) -> Path:
    directory = tmp_path / "model"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**LLAMA, **extra}))
    return directory


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The calls that reached the run (where the servers would start)."""
    reached: list[Any] = []

    def run_comparison(options: Any, topology: Any, *_builder: Any) -> None:
        reached.append((options, topology))
        raise KeyboardInterrupt  # ends main() right there, as a Ctrl-C would

    monkeypatch.setattr(compare_strategies, "run_comparison", run_comparison)
    return reached


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as refused:
        compare_strategies.main(argv)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("note:")]
    assert refused.value.code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def _argv(tmp_path: Path, *extra: str, **config: Any) -> list[str]:
    return ["--model_dir", str(_model_dir(tmp_path, **config)), "--out-dir", str(tmp_path / "out"), *extra]


def test_the_documented_1p1d_example_without_size_flags_is_refused_before_any_server(tmp_path, capsys, no_run):
    argv = _argv(tmp_path, "--topology", "1p1d", "--workload", "long_first", "--strategies", "default,hrrn",
                 "--server-args", "--max_total_token_num 65536",
                 "--prefill-args", "--chunked_prefill_size 256 --prefill_max_overtake_tokens 64",
                 "--decode-args", "--pd_max_segment_tokens 64")
    line = _refused(argv, capsys)
    assert line.startswith("error: --workload long_first has a long request of 16384 prompt tokens (--long-len) "
                           "plus 128 output tokens (--output-len), 16512 in all, more than the servers' context of "
                           "4096 (max_position_embeddings in "), line
    assert "every such request would fail with HTTP 400: lower --long-len or --output-len" in line
    assert not no_run and not (tmp_path / "out").exists()


def test_a_request_the_servers_would_cut_is_refused_saying_so(tmp_path, capsys, no_run):
    # 4000 + 128 > 4096: the completions endpoint would not refuse it, it would cut the output to 96
    # tokens and the run would report lengths it did not measure.
    argv = _argv(tmp_path, "--workload", "long_first", "--long-len", "4000", "--output-len", "128")
    line = _refused(argv, capsys)
    assert "4128 in all, more than the servers' context of 4096" in line, line
    assert "the servers would cut such a request's output to 96 tokens" in line
    assert "HTTP 400" not in line


def test_the_same_run_with_lengths_that_fit_goes_on(tmp_path, no_run):
    argv = _argv(tmp_path, "--topology", "1p1d", "--workload", "long_first,interleaved,sustained,shared_prefix",
                 *FITTING, "--long-count", "8", "--prefix-tokens", "1024")
    assert compare_strategies.main(argv) == 130
    assert len(no_run) == 1


@pytest.mark.parametrize("workload, extra, request_text, flags", [
    ("long_first", ["--output-len", "8", "--long-len", "64", "--short-len", "4095"], "a short request of 4095 prompt tokens (--short-len) "
     "plus 8 output tokens (--output-len)", "lower --short-len or --output-len"),
    ("interleaved", ["--long-len", "4000", "--long-output-len", "97"], "a long request of 4000 prompt tokens "
     "(--long-len) plus 97 output tokens (--long-output-len)", "lower --long-len or --long-output-len"),
    ("sustained", ["--long-len", "64", "--short-len", "4000", "--short-output-len", "200"],
     "a short request of 4000 prompt tokens (--short-len) plus 200 output tokens (--short-output-len)",
     "lower --short-len or --short-output-len"),
    # Chats grow by --short-len per turn: the fourth turn holds 1024 + 3 x 1100 prompt tokens.
    ("shared_prefix", ["--long-len", "64", "--short-len", "1100", "--prefix-tokens", "1024", "--output-len", "8"],
     "a short request of 4324 prompt tokens (--prefix-tokens + --short-len + --chat-turns) plus 8 output tokens "
     "(--output-len)", "lower --prefix-tokens, --short-len, --chat-turns or --output-len"),
    # One turn per chat: the longest is a few-shot prompt, a template and --short-len tokens.
    ("shared_prefix", ["--long-len", "64", "--short-len", "8", "--prefix-tokens", "4090", "--output-len", "8",
                       "--chat-turns", "1"],
     "a short request of 4098 prompt tokens (--prefix-tokens + --short-len) plus 8 output tokens",
     "lower --prefix-tokens, --short-len or --output-len"),
])
def test_every_workload_is_checked_naming_the_flags_that_make_its_longest_request(
    tmp_path, capsys, no_run, workload, extra, request_text, flags
):
    line = _refused(_argv(tmp_path, "--workload", workload, *extra), capsys)
    assert f"--workload {workload} has " in line and request_text in line and flags in line, line
    assert not no_run


@pytest.mark.parametrize("extra, limit, source", [
    (["--server-args", "--max_req_total_len 1024"], 1024, "--max_req_total_len 1024 in --server-args"),
    (["--topology", "1p1d", "--prefill-args=--max_req_total_len=1500"], 1500,
     "--max_req_total_len 1500 in --prefill-args"),
    (["--topology", "2p1d", "--master-args", "--max_req_total_len 2000"], 2000,
     "--max_req_total_len 2000 in --master-args"),
    # Longer than the checkpoint on the nodes only: the master still takes the checkpoint's context.
    (["--topology", "1p1d", "--server-args", "--max_req_total_len 8192"], 4096, "max_position_embeddings in"),
])
def test_a_smaller_max_req_total_len_given_to_any_process_is_the_limit(tmp_path, capsys, no_run, extra, limit,
                                                                        source):
    line = _refused(_argv(tmp_path, "--workload", "long_first", "--long-len", "4090", "--output-len", "8", *extra),
                    capsys)
    assert f"more than the servers' context of {limit} ({source}" in line, line
    assert ("(or raise that --max_req_total_len)" in line) is source.startswith("--max_req_total_len")


def test_a_sliding_window_bounds_the_servers_context(tmp_path, capsys, no_run):
    line = _refused(_argv(tmp_path, "--workload", "long_first", *FITTING, sliding_window=1024), capsys)
    assert "more than the servers' context of 1024 (max_position_embeddings, or its sliding window, in" in line


def test_a_checkpoint_without_a_usable_config_is_left_to_the_servers(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert servers_context(str(tmp_path), {"server": {"extra_args": ()}}) is None
    check_workloads_fit(str(tmp_path), [WorkloadConfig()], [0], {"server": {"extra_args": ()}})


def test_the_servers_context_is_the_smallest_of_every_process(tmp_path):
    model_dir = str(_model_dir(tmp_path))
    processes = {"master": {"master_args": ()}, "prefill": {"extra_args": ("--max_req_total_len", "3000"),
                                                           "prefill_args": ()},
                 "decode": {"extra_args": ("--max_req_total_len", "3000"), "decode_args": ("--tp", "1")}}
    assert servers_context(model_dir, processes) == ContextLimit(
        3000, "--max_req_total_len 3000 in extra_args", "the servers' context")
    # A value the server cannot parse is its own refusal, at its start.
    assert servers_context(model_dir, {"server": {"extra_args": ("--max_req_total_len", "x")}}).tokens == 4096


def test_a_random_schedule_is_checked_for_every_seed_the_run_uses():
    cfg = WorkloadConfig(name="shared_prefix", duration_s=0.5, request_rate=40.0, long_len=64, short_len=100)
    seeds = range(0, 6)
    worst = longest_request(cfg, seeds)
    every = [r for seed in seeds for r in build_workload(dataclasses.replace(cfg, seed=seed))]
    assert worst.prompt_len + worst.output_len == max(r.prompt_len + r.output_len for r in every)
    # A fixed schedule is the same for every seed: built once.
    long_first = WorkloadConfig(name="long_first", long_count=2, short_count=2, long_len=50, short_len=9, output_len=3)
    assert longest_request(long_first, seeds).prompt_len == 50


def test_length_fields_name_the_output_override_of_the_class():
    cfg = WorkloadConfig(name="long_first", long_output_len=7)
    long_request, short_request = (next(r for r in build_workload(cfg) if r.request_class == c)
                                   for c in ("long", "short"))
    assert length_fields(cfg, long_request) == (["long_len"], "long_output_len")
    assert length_fields(cfg, short_request) == (["short_len"], "output_len")
    chats = WorkloadConfig(name="shared_prefix", long_fraction=0.0, prefix_tokens=100, short_len=10, chat_turns=3,
                           duration_s=2.0, request_rate=50.0)
    named = {r.prompt_len: length_fields(chats, r)[0] for r in build_workload(chats)}
    assert named == {100: ["prefix_tokens"], 110: ["prefix_tokens", "short_len"],
                     120: ["prefix_tokens", "short_len", "chat_turns"]}
