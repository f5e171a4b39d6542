"""The simulator's tools refuse a flag or value that would measure nothing, in one line, before any run.

An outside pass found each of these accepted: ``--mixed-batches`` with only 1P1D modes (output
identical without it), a bound sweep of ``default`` alone (every row compared ``default`` with
itself), frontier counts above the scenario's short prompts (identical rows) and starts beyond
its prefill tokens (rows equal to ``default``), a deadline sweep sparing every short prompt (a row
equal to ``default``) and ``schedule_cost --sizes 0`` (a table of zeros).  Each test stubs the work
after the checks, so a refusal that comes late, or not at all, fails it.
"""

from __future__ import annotations

from typing import Any, List

import pytest
from simulator_test_support import assert_refused_in_one_line

from lightllm.benchmark.simulator import __main__ as simulator_cli
from lightllm.benchmark.simulator import bound_sweep, deadline_frontier, frontier, schedule_cost
from lightllm.benchmark.simulator.scenarios import SCENARIOS
from lightllm.benchmark.workloads import SHORT

_LONG_FIRST = SCENARIOS["long_first"].build(0)
LONG_FIRST_SHORTS = sum(1 for item in _LONG_FIRST if item.request_class == SHORT)  # 48
LONG_FIRST_PREFILL_TOKENS = sum(item.prompt_len for item in _LONG_FIRST)


def _never(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a run started before the flags were checked")


@pytest.fixture
def no_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tool's work fails the test: a refusal must come first."""
    for module, name in ((simulator_cli, "run_matrix"), (simulator_cli, "run_soaks"), (bound_sweep, "sweep"),
                         (frontier, "frontier"), (deadline_frontier, "deadline_frontier"),
                         (schedule_cost, "run"), (schedule_cost, "run_server")):
        monkeypatch.setattr(module, name, _never)


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """Stub every tool's work with an empty result; the list names the work that ran."""
    ran: List[str] = []

    def stub(name: str, result: Any):
        return lambda *args, **kwargs: ran.append(name) or result

    monkeypatch.setattr(simulator_cli, "run_matrix", stub("run_matrix", []))
    monkeypatch.setattr(simulator_cli, "full_report_markdown", lambda *args: "")
    monkeypatch.setattr(simulator_cli, "results_json", lambda *args: {})
    monkeypatch.setattr(bound_sweep, "sweep", stub("bound_sweep", []))
    monkeypatch.setattr(frontier, "frontier", stub("frontier", []))
    monkeypatch.setattr(deadline_frontier, "deadline_frontier", stub("deadline_frontier", []))
    monkeypatch.setattr(schedule_cost, "run", stub("schedule_cost", []))
    return ran


_SIM_CELL = ["--scenario", "long_first", "--budget", "1024", "--strategies", "default"]


@pytest.mark.parametrize("argv", [
    [*_SIM_CELL, "--modes", "1p1d", "--mixed-batches"],
    ["--soak-hours", "0.01", "--modes", "1p1d", "--mixed-batches"],
])
def test_mixed_batches_with_only_pd_pairs_is_refused(argv, no_runs, capsys):
    assert_refused_in_one_line(simulator_cli.main, argv, "--mixed-batches changes nothing with --modes 1p1d", capsys)


@pytest.mark.parametrize("modes", [["--modes", "normal"], ["--modes", "1p1d,normal"], []])
def test_mixed_batches_with_a_normal_node_runs(modes, runs):
    assert simulator_cli.main([*_SIM_CELL, *modes, "--mixed-batches"]) == 0
    assert runs == ["run_matrix"]


@pytest.mark.parametrize("strategies", ["default", "default,hrrn", "hrrn,default"])
def test_bound_sweep_naming_default_is_refused(no_runs, capsys, strategies):
    # Alone or in a list: default's rows would compare default with itself (report item 8: a list ran them).
    assert_refused_in_one_line(bound_sweep.main, ["--strategies", strategies, "--cells", "long_first/normal/1024"],
                               "--strategies names default, which every row is compared with", capsys)


@pytest.mark.parametrize("argv, message", [
    (["--counts", f"{LONG_FIRST_SHORTS},1000", "--starts", "0"],
     f"--counts 1000 is above the {LONG_FIRST_SHORTS} short prompts of scenario long_first"),
    # The default counts (40-140/10) pass 48 too.
    ([], f"--counts 50 is above the {LONG_FIRST_SHORTS} short prompts of scenario long_first"),
    (["--counts", "10", "--starts", f"0,{LONG_FIRST_PREFILL_TOKENS}"],
     f"--starts {LONG_FIRST_PREFILL_TOKENS} is at or beyond the {LONG_FIRST_PREFILL_TOKENS} prefill tokens"),
    (["--counts", "10", "--starts", "100000000"], "--starts 100000000 is at or beyond"),
])
def test_frontier_members_that_add_nothing_are_refused(argv, message, no_runs, capsys):
    assert_refused_in_one_line(frontier.main, ["--scenario", "long_first", *argv], message, capsys)


def test_frontier_counts_the_workload_its_seed_builds(no_runs, capsys):
    shorts = sum(1 for item in SCENARIOS["sustained"].build(3) if item.request_class == SHORT)
    assert_refused_in_one_line(frontier.main, ["--scenario", "sustained", "--seed", "3", "--counts", str(shorts + 1)],
                               f"above the {shorts} short prompts of scenario sustained (seed 3)", capsys)


def test_frontier_runs_up_to_every_short_prompt_and_the_last_prefill_token(runs):
    argv = ["--scenario", "long_first", "--counts", f"0,{LONG_FIRST_SHORTS}",
            "--starts", f"0,{LONG_FIRST_PREFILL_TOKENS - 1}"]
    assert frontier.main(argv) == 0
    assert runs == ["frontier"]


@pytest.mark.parametrize("spared", [str(LONG_FIRST_SHORTS), f"0,{100000}"])
def test_deadline_sweep_sparing_every_short_prompt_is_refused(spared, no_runs, capsys):
    assert_refused_in_one_line(deadline_frontier.main, ["--scenario", "long_first", "--spared", spared],
                               f"spares all {LONG_FIRST_SHORTS} short prompts of scenario long_first", capsys)


def test_deadline_sweep_sparing_all_but_one_runs(runs):
    assert deadline_frontier.main(["--scenario", "long_first", "--spared", f"0,{LONG_FIRST_SHORTS - 1}"]) == 0
    assert runs == ["deadline_frontier"]


@pytest.mark.parametrize("layout", ["engine", "server", "both"])
def test_schedule_cost_refuses_a_size_of_no_waiting_request(layout, no_runs, capsys):
    assert_refused_in_one_line(schedule_cost.main, ["--layout", layout, "--sizes", "0", "100"],
                               "--sizes must be within [1, 100000], got 0 100", capsys)


def test_schedule_cost_runs_one_waiting_request(runs):
    schedule_cost.main(["--layout", "engine", "--sizes", "1"])
    assert runs == ["schedule_cost"]
