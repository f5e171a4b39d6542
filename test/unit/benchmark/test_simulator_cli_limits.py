"""The simulator's command lines take the server's limits, refuse sizes that would not finish, a
flag given twice, a value named twice and a flag that would change nothing, and name a bad
profile file, each in one line naming the flag (exit status 2), before anything is simulated.

Each case used to end in a traceback (OverflowError in the bound's allowance, ZeroDivisionError
in the soak capacity), eat all memory (a range expanded eagerly), hang (a soak of 3.6e9
requests), or run with a flag silently dropped.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
import pytest
from simulator_test_support import assert_refused_in_one_line

from lightllm.benchmark.simulator import __main__ as simulator_cli
from lightllm.benchmark.simulator import bound_sweep, deadline_frontier, frontier, schedule_cost
from lightllm.benchmark.simulator.bound_cli import overtake_bound_from_cli
from lightllm.benchmark.simulator.cell_cli import MAX_LIST_VALUES, int_range
from lightllm.benchmark.simulator.cost_model import PROFILE_DIR, CostProfile, load_profile
from lightllm.benchmark.simulator.scenarios import SCENARIOS
from lightllm.benchmark.simulator.soak import MAX_SOAK_REQUESTS, SoakConfig, run_soak
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.arg_parser import parse_server_args
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import (
    MAX_PREFILL_OVERTAKE_FRACTION,
    MAX_PREFILL_OVERTAKE_TOKENS,
)
from lightllm.server.launch.args_check import validate_args

_CELL = ["--scenario", "long_first", "--modes", "normal", "--budget", "1024", "--strategies", "default"]
_FRACTION_PAST = repr(math.nextafter(MAX_PREFILL_OVERTAKE_FRACTION, math.inf))
_TOKENS_PAST = str(MAX_PREFILL_OVERTAKE_TOKENS + 1)


class _Simulated(Exception):
    """Raised instead of simulating: the command got past every check."""


def _never(*_args, **_kwargs):
    raise _Simulated


# --- 1. the overtaking bound's flags take the server's values -----------------------------------
@pytest.mark.parametrize("tool, argv, message", [
    (simulator_cli.main, [*_CELL, "--prefill-overtake-fraction", "1e308"],
     "--prefill-overtake-fraction must be at most 1000, the server's limit"),
    (simulator_cli.main, [*_CELL, "--prefill-max-overtake-tokens", "99999999999999999999999"],
     "--prefill-max-overtake-tokens must be at most 1,000,000,000,000, the server's limit"),
    (frontier.main, ["--prefill-overtake-fraction", "1e308", "--counts", "10", "--starts", "0"],
     "--prefill-overtake-fraction must be at most 1000"),
    (deadline_frontier.main, ["--prefill-max-overtake-tokens", _TOKENS_PAST, "--due-ms", "2000", "--spared", "0"],
     "--prefill-max-overtake-tokens must be at most"),
    (bound_sweep.main, ["--cells", "long_first/normal/1024", "--bases", "2048", "--fractions", "1e308"],
     "--fractions: each fraction must be at most 1000, the server's limit of --prefill_overtake_fraction"),
    (bound_sweep.main, ["--cells", "long_first/normal/1024", "--bases", _TOKENS_PAST, "--fractions", "0.1"],
     "--bases: each base must be at most 1,000,000,000,000"),
])
def test_bound_values_past_the_servers_limit_are_refused(tool, argv, message, capsys):
    assert_refused_in_one_line(tool, argv, message, capsys)


def test_the_simulator_takes_exactly_the_values_the_server_takes():
    # Both read the limits from the scheduling core; this checks they apply them the same way.
    parser = simulator_cli.build_parser()
    at_limit = parser.parse_args(["--prefill-overtake-fraction", repr(MAX_PREFILL_OVERTAKE_FRACTION),
                                  "--prefill-max-overtake-tokens", str(MAX_PREFILL_OVERTAKE_TOKENS)])
    bound = overtake_bound_from_cli(at_limit)
    assert (bound.base_tokens, bound.fraction) == (MAX_PREFILL_OVERTAKE_TOKENS, MAX_PREFILL_OVERTAKE_FRACTION)
    assert bound.allowance(10**9) > 0  # the largest allowed values do not overflow
    server = ["--model_dir", "/m"]
    validate_args(parse_server_args([*server, "--prefill_overtake_fraction", repr(MAX_PREFILL_OVERTAKE_FRACTION),
                                     "--prefill_max_overtake_tokens", str(MAX_PREFILL_OVERTAKE_TOKENS)]))
    for sim_flag, server_flag, past in (("--prefill-overtake-fraction", "--prefill_overtake_fraction", _FRACTION_PAST),
                                        ("--prefill-max-overtake-tokens", "--prefill_max_overtake_tokens",
                                         _TOKENS_PAST)):
        with pytest.raises(ValueError, match=f"{sim_flag} must be at most"):
            overtake_bound_from_cli(parser.parse_args([sim_flag, past]))
        with pytest.raises(ArgumentError, match=f"{server_flag} must be at most"):
            validate_args(parse_server_args([*server, server_flag, past]))


# --- 3. sizes that would not finish ---------------------------------------------------------------
def test_a_range_may_name_at_most_max_list_values():
    assert int_range(f"0-{MAX_LIST_VALUES - 1}") == list(range(MAX_LIST_VALUES))
    with pytest.raises(ValueError, match=f"names at least {MAX_LIST_VALUES + 1:,} values, more than the "
                                         f"{MAX_LIST_VALUES}"):
        int_range(f"0-{MAX_LIST_VALUES}")
    with pytest.raises(ValueError, match="more than the"):
        int_range(f"5,10-{MAX_LIST_VALUES + 9}")  # 1 + 1000 values
    with pytest.raises(ValueError, match="the range '140-40/10' holds no value"):
        int_range("5,140-40/10")  # used to drop the empty range silently


@pytest.mark.parametrize("tool, flag", [
    (frontier.main, "--counts"), (frontier.main, "--starts"), (deadline_frontier.main, "--spared"),
])
def test_a_huge_range_is_refused_before_it_is_expanded(tool, flag, capsys):
    # Expanded eagerly, this range took all memory.
    assert_refused_in_one_line(tool, [flag, "1-1000000000/1"],
                               f"argument {flag}: names at least 1,000,000,000 values", capsys)


@pytest.mark.parametrize("argv, message", [
    (["--soak-hours", "0.001", "--soak-rate", "1e12"],
     "--soak-hours 0.001 at 1e+12 req/s (--soak-rate) is about 3,600,000,000,000 requests per strategy"),
    (["--soak-hours", "1000"], "(the default load 0.7 x the capacity estimated from --profile h100_qwen_0p8b)"),
    (["--soak-hours", "100", "--soak-load", "0.5"], "(--soak-load 0.5 x the capacity"),
])
def test_a_soak_too_large_to_finish_is_refused(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(simulator_cli, "run_soaks", _never)
    assert_refused_in_one_line(simulator_cli.main, argv, f"more than the {MAX_SOAK_REQUESTS:,} a soak run simulates",
                               capsys)
    assert_refused_in_one_line(simulator_cli.main, argv, message, capsys)


@pytest.mark.parametrize("argv", [
    ["--soak-hours", "2", "--budget", "1024", "--modes", "normal"],  # the documented runs
    ["--soak-hours", "1", "--budget", "1024", "--modes", "normal", "--soak-load", "0.9"],
])
def test_the_documented_soak_runs_pass_the_cap(argv, monkeypatch):
    monkeypatch.setattr(simulator_cli, "run_soaks", _never)
    with pytest.raises(_Simulated):
        simulator_cli.main(argv)


def test_run_soak_refuses_a_soak_too_large_for_api_callers_too():
    profile = load_profile("h100_qwen_0p8b")
    with pytest.raises(ValueError, match=f"more than the {MAX_SOAK_REQUESTS:,} a soak run simulates"):
        run_soak(profile, "default", SoakConfig(hours=1.0, request_rate=1e9))


# --- 5. a flag given twice, a value named twice, a flag that would change nothing ------------------
@pytest.mark.parametrize("tool, argv, message", [
    (simulator_cli.main, ["--scenario", "long_first", "--budget", "1024", "--modes", "normal", "--modes", "1p1d"],
     "--modes is given twice"),
    (simulator_cli.main, [*_CELL, "--strategies", "hrrn"], "--strategies is given twice"),
    (simulator_cli.main, [*_CELL, "--budget", ","], "--budget is given twice"),
    (simulator_cli.main, [*_CELL, "--scenario", "interleaved"], "--scenario is given twice"),
    (simulator_cli.main, [*_CELL, "--seed=1", "--seed", "2"], "--seed is given twice"),
    (frontier.main, ["--counts", "10", "--counts", "20"], "--counts is given twice"),
    (deadline_frontier.main, ["--due-ms", "2000", "--due-ms=2100"], "--due-ms is given twice"),
    (bound_sweep.main, ["--bases", "1", "--bases", "2"], "--bases is given twice"),
    (schedule_cost.main, ["--sizes", "100", "--sizes", "200"], "--sizes is given twice"),
])
def test_a_flag_given_twice_is_refused(tool, argv, message, capsys):
    # argparse kept the last value and dropped the first; --budget and --scenario added them up.
    assert_refused_in_one_line(tool, argv, f"{message}; give it once, with all its values", capsys)


@pytest.mark.parametrize("scenario, message", [
    ("long_first,long_first", "--scenario names 'long_first' twice; name each once"),
    ("seed_all,long_first", "--scenario names 'long_first' twice (seed_all holds it)"),
    ("seed_six,seed_all", "--scenario names 'long_first' twice (seed_six and seed_all hold it)"),
])
def test_a_scenario_named_twice_is_refused_as_a_budget_named_twice_is(scenario, message, capsys):
    argv = ["--scenario", scenario, "--budget", "1024", "--modes", "normal", "--strategies", "default"]
    assert_refused_in_one_line(simulator_cli.main, argv, message, capsys)


def test_soak_load_and_soak_rate_together_are_refused(capsys, monkeypatch):
    monkeypatch.setattr(simulator_cli, "run_soaks", _never)
    assert_refused_in_one_line(simulator_cli.main, ["--soak-hours", "0.001", "--soak-load", "0.5", "--soak-rate", "3"],
                               "--soak-load and --soak-rate both set the soak stream's rate", capsys)


@pytest.mark.parametrize("tool, argv", [
    (simulator_cli.main, [*_CELL, "--seed", "5"]),
    (simulator_cli.main, ["--scenario", "long_first,interleaved", "--budget", "1024", "--seed", "0"]),
    (frontier.main, ["--scenario", "long_first", "--seed", "5"]),
    (deadline_frontier.main, ["--scenario", "interleaved", "--seed", "5"]),
    (bound_sweep.main, ["--cells", "long_first/normal/1024", "--seed", "5"]),
])
def test_a_seed_no_selected_scenario_reads_is_refused(tool, argv, capsys):
    readers = ", ".join(name for name, spec in SCENARIOS.items() if spec.reads_seed)
    assert_refused_in_one_line(tool, argv, "--seed changes nothing for", capsys)
    assert_refused_in_one_line(tool, argv, f"(the seed draws the arrivals of {readers})", capsys)


def test_a_seed_some_selected_scenario_reads_is_accepted(monkeypatch):
    monkeypatch.setattr(simulator_cli, "run_matrix", _never)
    with pytest.raises(_Simulated):
        simulator_cli.main(["--scenario", "long_first,sustained", "--budget", "1024", "--seed", "5"])


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_reads_seed_says_whether_the_seed_changes_the_schedule(name):
    spec = SCENARIOS[name]
    assert (spec.build(0) != spec.build(1)) == spec.reads_seed


@pytest.mark.parametrize("argv, message", [
    (["--layout", "engine", "--sizes", "100", "100"], "--sizes names 100 twice"),
    (["--layout", "server", "--running", "5", "6", "5"], "--running names 5 twice"),
    (["--layout", "engine", "--strategies", "hrrn", "hrrn"], "--strategies names hrrn twice"),
    (["--layout", "server", "--kv-view", "radix", "radix"], "--kv-view names radix twice"),
    (["--layout", "engine", "--seed", "-1"], "--seed must be >= 0, got -1"),
])
def test_schedule_cost_refuses_repeats_and_a_negative_seed(argv, message, capsys):
    # Each used to measure (and print) the same cell twice, or run with a seed every other tool refuses.
    assert_refused_in_one_line(schedule_cost.main, argv, message, capsys)


# --- 6, 8. profiles: a free prefill, a file that is not UTF-8 ---------------------------------------
def _profile_file(tmp_path: Path, **coefficients: float) -> str:
    profile = json.loads((PROFILE_DIR / "h100_qwen_0p8b.json").read_text())
    profile["coefficients"].update(coefficients)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    return str(path)


_FREE_PREFILL = dict(prefill_fixed_s=0, prefill_per_token_s=0, prefill_attention_s=0)


@pytest.mark.parametrize("tool, argv", [
    (simulator_cli.main, ["--soak-hours", "0.001"]),  # used to divide by zero estimating capacity
    (simulator_cli.main, _CELL),
    (frontier.main, ["--counts", "10", "--starts", "0"]),  # used to divide by zero comparing with default
    (deadline_frontier.main, ["--due-ms", "2000", "--spared", "0"]),
    (bound_sweep.main, ["--cells", "long_first/normal/1024"]),
])
def test_a_profile_whose_prefill_costs_nothing_is_refused_naming_the_file(tool, argv, tmp_path, capsys):
    path = _profile_file(tmp_path, **_FREE_PREFILL)
    assert_refused_in_one_line(tool, ["--profile", path, *argv],
                               f"profile {path!r}: prefill_fixed_s, prefill_per_token_s and prefill_attention_s are "
                               "all 0", capsys)


def test_cost_profile_itself_refuses_a_free_prefill_and_takes_any_one_prefill_cost():
    base = load_profile("h100_qwen_0p8b")
    values = {**base.coefficients(), "name": "t", "max_total_token_num": 1000}
    with pytest.raises(ValueError, match="prefill forwards would cost nothing"):
        CostProfile(**{**values, **_FREE_PREFILL})
    for name in _FREE_PREFILL:
        CostProfile(**{**values, **_FREE_PREFILL, name: 1e-6})


def test_a_profile_that_is_not_utf8_is_refused_naming_the_file(tmp_path, capsys):
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    assert_refused_in_one_line(simulator_cli.main, ["--profile", str(path), *_CELL],
                               f"profile {str(path)!r} is not UTF-8 text (JSON)", capsys)


@pytest.mark.parametrize("content, message", [
    ({"name": "x"}, "is missing required keys"),
    ([1, 2], "must be a JSON object, got list"),
])
def test_every_invalid_profile_names_the_file(content, message, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=rf"^profile '{path}': .*{message}"):
        load_profile(str(path))


def test_a_soak_says_which_strategy_it_runs_while_it_runs(capsys):
    """The documented two-hour soak printed nothing for minutes (one to two on a quiet machine)."""
    assert simulator_cli.main(["--soak-hours", "0.002", "--budget", "1024", "--modes", "normal",
                               "--strategies", "default,hrrn"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("soaking ")]
    assert [line.split(":")[0] for line in lines] == ["soaking default", "soaking hrrn"]
    assert "0.002 simulated hours, about 91 requests" in lines[0]


def test_a_profile_file_of_any_name_loads_and_a_directory_is_named(tmp_path, monkeypatch):
    """A copy of a bundled profile under a name without `.json` was refused as 'neither a JSON file
    nor a bundled profile', as were a directory and /etc/passwd, with one message for all three."""
    monkeypatch.chdir(tmp_path)
    copy = tmp_path / "okprof"
    copy.write_text((PROFILE_DIR / "cpu_demo_small.json").read_text())
    assert load_profile(str(copy)) == load_profile("cpu_demo_small")
    assert load_profile("okprof") == load_profile("cpu_demo_small")  # a relative path in the working directory
    with pytest.raises(ValueError, match=rf"^profile '{tmp_path}' is a directory, not a profile file$"):
        load_profile(str(tmp_path))
    text = tmp_path / "notes.txt"
    text.write_text("not json")
    with pytest.raises(ValueError, match=rf"^profile '{text}' is not valid JSON"):
        load_profile(str(text))
    with pytest.raises(ValueError, match="is neither a file nor a bundled profile; bundled: .*h100_qwen_0p8b"):
        load_profile("no_such_profile")
    with pytest.raises(ValueError, match="^profile '' is empty; name a bundled profile"):
        load_profile("")  # not the working directory
