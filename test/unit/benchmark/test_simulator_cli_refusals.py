"""The simulator's command lines refuse empty, repeated, ignored and impossible values in one line naming the flag.

Each of these used to print an empty report with exit code 0, simulate a value twice, silently
ignore a flag, or end in a traceback (IndexError, a stalled simulation, a cost-model check).
"""

from __future__ import annotations

import dataclasses

import pytest
from simulator_test_support import assert_refused_in_one_line, bundled_profile_with_kv

from lightllm.benchmark.simulator import __main__ as simulator_cli
from lightllm.benchmark.simulator import bound_sweep, deadline_frontier, frontier, schedule_cost
from lightllm.benchmark.simulator.cost_model import load_profile
from lightllm.benchmark.simulator.runner import check_fits_kv, simulate_workload
from lightllm.benchmark.workloads import ScheduledRequest

_CELL = ["--scenario", "long_first", "--modes", "normal", "--budget", "1024", "--strategies", "default"]


@pytest.fixture
def tiny_kv_profile(tmp_path):
    """The bundled H100 profile with a KV cache smaller than the long_first scenario's 16K prompts."""
    return bundled_profile_with_kv(tmp_path, "tiny_kv", 10000)


@pytest.mark.parametrize("argv, message", [
    (["--scenario", "long_first", "--modes", ",", "--budget", "1024"], "--modes must name at least one of"),
    (["--scenario", ",", "--modes", "normal", "--budget", "1024"], "--scenario must name at least one of"),
    (["--scenario", "long_first", "--modes", "normal", "--budget", ","], "--budget must name at least one budget"),
    (["--soak-hours", "0.01", "--modes", ","], "--modes must name at least one of"),
    (["--soak-hours", "0.01", "--soak-long-len", "-100"], "--soak-long-len must be >= 1, got -100"),
    (["--soak-hours", "0.01", "--soak-long-fraction", "-0.2"], "--soak-long-fraction must be within [0, 1], got -0.2"),
    (["--soak-hours", "inf"], "--soak-hours must be a finite number > 0"),
    (["--soak-load", "0.5", *_CELL], "--soak-load only applies with --soak-hours"),
    (["--soak-long-len", "4096", "--soak-rate", "3", *_CELL], "--soak-rate, --soak-long-len only apply with --soak-hours"),
    (["--soak-hours", "0.01", "--scenario", "long_first"], "--scenario does not apply with --soak-hours"),
    (["--soak-hours", "0.01", "--budget", "1024,4096"], "--budget must name one value with --soak-hours"),
    (["--scenario", "long_first", "--modes", "normal", "--budget", "1024", "--strategies", "hrrn,hrrn"],
     "--strategies names 'hrrn' twice"),
    (["--scenario", "long_first", "--modes", "normal", "--budget", "1024,1024"], "--budget names 1024 twice"),
    (["--scenario", "long_first", "--modes", "normal,normal", "--budget", "1024"], "--modes names 'normal' twice"),
    (["--running-max-req-size", "0", *_CELL], "--running-max-req-size must be >= 1"),
])
def test_simulator_refuses(argv, message, capsys):
    assert_refused_in_one_line(simulator_cli.main, argv, message, capsys)


def test_a_kv_cache_smaller_than_a_request_is_refused_before_simulating(tiny_kv_profile, capsys):
    # Named by the flag's value, not by the "name" inside the file (a copy of a bundled profile keeps its name).
    message = "the profile's KV cache holds 10000 tokens, but a request of scenario long_first needs 16512"
    assert_refused_in_one_line(simulator_cli.main, ["--profile", tiny_kv_profile, *_CELL],
                               f"error: --profile {tiny_kv_profile}: {message}", capsys)
    assert_refused_in_one_line(bound_sweep.main, ["--profile", tiny_kv_profile, "--cells", "long_first/normal/1024"],
                               message, capsys)
    assert_refused_in_one_line(frontier.main, ["--profile", tiny_kv_profile, "--scenario", "long_first"], message, capsys)
    # Soak: the long prompts plus their output must fit too.
    assert_refused_in_one_line(simulator_cli.main, ["--profile", tiny_kv_profile, "--soak-hours", "0.01",
                                                    "--soak-long-len", "16384"],
                               f"--soak-long-len 16384: a request needs 16512 KV tokens (prompt + 128 output), more "
                               f"than the 10000 of --profile {tiny_kv_profile}", capsys)


def test_check_fits_kv_allows_a_request_that_exactly_fills_the_cache():
    profile = dataclasses.replace(load_profile("h100_qwen_0p8b"), max_total_token_num=1000)
    fits = [ScheduledRequest(0.0, "long", 900, 100)]
    check_fits_kv(profile, fits)
    for mode in ("normal", "1p1d"):
        records, _ = simulate_workload(profile, fits, "default", mode, 256)
        assert records[0].output_tokens == 100
    with pytest.raises(ValueError, match="needs 1001: its 901-token prompt plus 100 output tokens"):
        simulate_workload(profile, [ScheduledRequest(0.0, "long", 901, 100)], "default", "normal", 256)


@pytest.mark.parametrize("argv, message", [
    (["--cells", "long_first/normal/0"], "--cells: cell budget must be >= 1; got 'long_first/normal/0'"),
    (["--cells", "long_first/normal/1024,long_first/normal/1024"], "--cells names ('long_first', 'normal', 1024) twice"),
    (["--strategies", "hrrn,hrrn"], "--strategies names 'hrrn' twice"),
    (["--bases", "2048,2048"], "--bases names 2048 twice"),
])
def test_bound_sweep_refuses(argv, message, capsys):
    assert_refused_in_one_line(bound_sweep.main, argv, message, capsys)


@pytest.mark.parametrize("argv, message", [
    ([*_CELL, "--disable-prefill-overtake-bound", "--prefill-max-overtake-tokens", "4096"],
     "--prefill-max-overtake-tokens sets the overtaking bound, which --disable-prefill-overtake-bound turns off"),
    ([*_CELL, "--disable-prefill-overtake-bound", "--prefill-max-overtake-tokens", "2048",
      "--prefill-overtake-fraction", "0.15"],
     "--prefill-max-overtake-tokens and --prefill-overtake-fraction set the overtaking bound"),
])
def test_bound_values_with_the_bound_off_are_refused_as_the_server_refuses_them(argv, message, capsys):
    assert_refused_in_one_line(simulator_cli.main, argv, message, capsys)


@pytest.mark.parametrize("tool, argv, message", [
    (frontier.main, ["--counts", "50,50", "--starts", "0"], "--counts: names 50 twice"),
    (frontier.main, ["--counts", "40-60/10,50", "--starts", "0"], "--counts: names 50 twice"),
    (frontier.main, ["--counts", "50", "--starts", "0,0"], "--starts: names 0 twice"),
    (deadline_frontier.main, ["--due-ms", "2000,2000"], "--due-ms: names 2000 twice"),
    (deadline_frontier.main, ["--spared", "0,0"], "--spared: names 0 twice"),
    (deadline_frontier.main, ["--due-ms", "2000", "--disable-prefill-overtake-bound", "--prefill-overtake-fraction",
                              "0.3"], "--prefill-overtake-fraction sets the overtaking bound"),
])
def test_the_yardsticks_refuse_repeated_values_and_ignored_bound_values(tool, argv, message, capsys):
    assert_refused_in_one_line(tool, argv, message, capsys)


_BOUND_FLAGS = "use --prefill-max-overtake-tokens and --prefill-overtake-fraction"


@pytest.mark.parametrize("tool, argv, replacement", [
    (simulator_cli.main, [*_CELL, "--prefill-max-wait-tokens", "65536"], _BOUND_FLAGS),
    (simulator_cli.main, [*_CELL, "--prefill-max-wait-tokens=0"], _BOUND_FLAGS),
    (frontier.main, ["--counts", "50", "--starts", "0", "--prefill-max-wait-tokens"], _BOUND_FLAGS),
    (deadline_frontier.main, ["--due-ms", "2000", "--prefill-max-wait-tokens", "1"], _BOUND_FLAGS),
    # Commands without the bound flags name what they have instead.
    (bound_sweep.main, ["--cells", "long_first/normal/1024", "--prefill-max-wait-tokens", "65536"],
     "sweep the overtaking bound with --bases and --fractions"),
    (schedule_cost.main, ["--prefill-max-wait-tokens", "65536"],
     "this command's cells run under the default overtaking bound, which it does not vary"),
])
def test_the_replaced_waiting_bound_flag_is_refused_naming_its_replacement(tool, argv, replacement, capsys):
    # As the server refuses --prefill_max_wait_tokens (it was a bare "unrecognized arguments" here).
    assert_refused_in_one_line(tool, argv, "--prefill-max-wait-tokens was replaced by the overtaking bound: "
                               + replacement, capsys)


def test_the_profile_help_names_the_default():
    assert "(default h100_qwen_0p8b)" in " ".join(simulator_cli.build_parser().format_help().split())
