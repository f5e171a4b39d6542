"""Every simulator command line refuses bad input in one line naming the flag (docs/EN/simulator.md).

argparse's own refusals used to come after its 12-17 line usage block; the integer and number
lists of the yardsticks (``--counts``, ``--starts``, ``--due-ms``, ``--spared``) were refused
without naming their flag; the overtaking bound's values were refused under the server's
spelling (``prefill_overtake_fraction``) instead of the simulator's flag.
"""

from __future__ import annotations

import argparse

import pytest
from cli_refusal_support import flags_without_help, one_line_refusal, parser_of

from lightllm.benchmark.simulator import __main__ as simulator_cli
from lightllm.benchmark.simulator import (
    bound_sweep,
    deadline_frontier,
    derive_h100_profile,
    fit_cost_profile,
    frontier,
    schedule_cost,
)
from lightllm.benchmark.simulator.bound_cli import overtake_bound_from_cli

TOOLS = {
    "simulator": simulator_cli.main,
    "frontier": frontier.main,
    "deadline_frontier": deadline_frontier.main,
    "bound_sweep": bound_sweep.main,
    "schedule_cost": schedule_cost.main,
    "fit_cost_profile": fit_cost_profile.main,
    "derive_h100_profile": derive_h100_profile.main,
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_an_unknown_flag_is_refused_in_one_line(tool, capsys):
    line = one_line_refusal(TOOLS[tool], ["--no-such-flag"], capsys)
    assert "--no-such-flag" in line


@pytest.mark.parametrize("tool, argv, flag", [
    ("simulator", ["--running-max-req-size", "0"], "--running-max-req-size"),
    ("simulator", ["--seed", "x"], "--seed"),
    ("frontier", ["--budget", "0"], "--budget"),
    ("frontier", ["--scenario", "bogus"], "--scenario"),
    ("deadline_frontier", ["--mode", "bogus"], "--mode"),
    ("bound_sweep", ["--bases", "abc"], "--bases"),
    ("schedule_cost", ["--sizes", "-1"], "--sizes"),
    ("fit_cost_profile", ["--threads", "0"], "--threads"),
    ("fit_cost_profile", ["--model-dir", "/no/such/checkpoint"], "--model-dir"),
])
def test_a_bad_value_is_refused_in_one_line_naming_the_flag(tool, argv, flag, capsys):
    assert flag in one_line_refusal(TOOLS[tool], argv, capsys)


@pytest.mark.parametrize("tool, argv, flag", [
    ("frontier", ["--counts", "10-5/1"], "--counts"),
    ("frontier", ["--counts", "abc"], "--counts"),
    ("frontier", ["--starts", "-"], "--starts"),
    ("deadline_frontier", ["--due-ms", "abc"], "--due-ms"),
    ("deadline_frontier", ["--due-ms", "-5"], "--due-ms"),
    ("deadline_frontier", ["--spared", "10-5/1"], "--spared"),
])
def test_the_yardsticks_lists_name_their_flag(tool, argv, flag, capsys):
    line = one_line_refusal(TOOLS[tool], argv, capsys)
    assert flag in line, line


@pytest.mark.parametrize("tool", ["simulator", "frontier", "deadline_frontier"])
@pytest.mark.parametrize("argv, flag", [
    (["--prefill-overtake-fraction", "-0.1"], "--prefill-overtake-fraction"),
    (["--prefill-overtake-fraction", "nan"], "--prefill-overtake-fraction"),
    (["--prefill-max-overtake-tokens", "-1"], "--prefill-max-overtake-tokens"),
])
def test_the_overtaking_bound_is_refused_under_the_simulators_flag(tool, argv, flag, capsys):
    line = one_line_refusal(TOOLS[tool], argv, capsys)
    assert flag in line and flag.lstrip("-").replace("-", "_") not in line, line


@pytest.mark.parametrize("base, fraction, flag", [
    (-1, 0.5, "--prefill-max-overtake-tokens"),
    (2048, -0.1, "--prefill-overtake-fraction"),
])
def test_a_bound_given_in_a_namespace_is_refused_under_the_simulators_flag(base, fraction, flag):
    args = argparse.Namespace(disable_prefill_overtake_bound=False, prefill_max_overtake_tokens=base,
                              prefill_overtake_fraction=fraction)
    with pytest.raises(ValueError, match=flag):
        overtake_bound_from_cli(args)


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_flag_has_a_description(tool, monkeypatch):
    assert flags_without_help(parser_of(TOOLS[tool], monkeypatch)) == []
