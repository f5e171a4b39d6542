"""The simulator refuses the sizing the server refuses, in its own flags' words.

Its docs call ``--budget`` and ``--running-max-req-size`` the server's ``--batch_max_tokens`` and
``--running_max_req_size``, yet it simulated settings the launch refuses
(``lightllm/server/launch/sizing.py``): a budget below the running cap with mixed batches, and a
budget above the KV cache.
"""

from __future__ import annotations


import pytest
from simulator_test_support import assert_refused_in_one_line, bundled_profile_with_kv

from lightllm.benchmark.simulator import __main__ as simulator_cli
from lightllm.benchmark.simulator import bound_sweep, frontier

_CELL = ["--scenario", "long_first", "--modes", "normal", "--strategies", "default"]


def _never(*args, **kwargs):
    raise AssertionError("simulated before the sizing was checked")


@pytest.fixture
def small_kv_profile(tmp_path):
    """The H100 profile with a 20,000-token KV cache (long_first's requests still fit)."""
    return bundled_profile_with_kv(tmp_path, "small_kv", 20000)


@pytest.mark.parametrize("argv", [
    [*_CELL, "--mixed-batches", "--budget", "128"],
    ["--soak-hours", "0.01", "--mixed-batches", "--budget", "128"],
    # A normal node among the modes mixes its batches: its cells would run what the server refuses.
    ["--scenario", "long_first", "--modes", "normal,1p1d", "--mixed-batches", "--budget", "4096,128"],
])
def test_mixed_batches_need_a_budget_of_at_least_the_running_cap(argv, monkeypatch, capsys):
    monkeypatch.setattr(simulator_cli, "run_matrix", _never)
    monkeypatch.setattr(simulator_cli, "run_soaks", _never)
    assert_refused_in_one_line(simulator_cli.main, argv,
                               "with --mixed-batches each decoding request takes one token of a step's --budget, so "
                               "--budget (128) must be >= --running-max-req-size (256)", capsys)


def test_mixed_batches_accept_a_budget_equal_to_the_running_cap_and_plain_steps_any(monkeypatch):
    calls = []
    monkeypatch.setattr(simulator_cli, "run_matrix", lambda *a, **k: calls.append(a) or [])
    monkeypatch.setattr(simulator_cli, "full_report_markdown", lambda *a: "")
    monkeypatch.setattr(simulator_cli, "results_json", lambda *a: {})
    assert simulator_cli.main([*_CELL, "--mixed-batches", "--budget", "128", "--running-max-req-size", "128"]) == 0
    assert simulator_cli.main([*_CELL, "--budget", "128"]) == 0  # two forwards: decodes take no budget
    assert len(calls) == 2


def test_a_budget_above_the_kv_cache_is_refused(small_kv_profile, monkeypatch, capsys):
    monkeypatch.setattr(simulator_cli, "run_matrix", _never)
    message = f"--budget (20001) exceeds the KV cache of --profile {small_kv_profile} (20000 tokens)"
    assert_refused_in_one_line(simulator_cli.main, ["--profile", small_kv_profile, *_CELL, "--budget", "20001"],
                               message, capsys)
    monkeypatch.setattr(frontier, "frontier", _never)
    assert_refused_in_one_line(frontier.main, ["--profile", small_kv_profile, "--scenario", "long_first",
                                               "--budget", "20001"], message, capsys)
    monkeypatch.setattr(bound_sweep, "sweep", _never)
    assert_refused_in_one_line(bound_sweep.main, ["--profile", small_kv_profile, "--strategies", "hrrn",
                                                  "--cells", "long_first/normal/20001"],
                               "the budget of --cells long_first/normal/20001 (20001) exceeds the KV cache", capsys)


def test_a_budget_equal_to_the_kv_cache_is_simulated(small_kv_profile, monkeypatch):
    monkeypatch.setattr(simulator_cli, "run_matrix", lambda *a, **k: [])
    monkeypatch.setattr(simulator_cli, "full_report_markdown", lambda *a: "")
    monkeypatch.setattr(simulator_cli, "results_json", lambda *a: {})
    assert simulator_cli.main(["--profile", small_kv_profile, *_CELL, "--budget", "20000"]) == 0


def test_mixed_batches_take_a_budget_up_to_the_running_cap_above_the_kv_cache(small_kv_profile, monkeypatch, capsys):
    # As the server's --batch_max_tokens: a mixed step's decode rows take budget tokens, so a KV
    # cache smaller than --running-max-req-size left every budget refused ("give at most 20000"
    # was itself below the 20001 rows).
    monkeypatch.setattr(simulator_cli, "run_matrix", lambda *a, **k: [])
    monkeypatch.setattr(simulator_cli, "full_report_markdown", lambda *a: "")
    monkeypatch.setattr(simulator_cli, "results_json", lambda *a: {})
    rows = ["--mixed-batches", "--running-max-req-size", "20001"]
    assert simulator_cli.main(["--profile", small_kv_profile, *_CELL, *rows, "--budget", "20001"]) == 0
    assert_refused_in_one_line(simulator_cli.main, ["--profile", small_kv_profile, *_CELL, *rows, "--budget", "20002"],
                               "give at most 20001", capsys)
