"""Soak mode's rate is a share of what the simulated server can sustain under all its limits.

The estimate used to count only the prefill budget: with ``--running-max-req-size 16``, or with
short prompts at the default cap of 256, "70% load" was an overload (12.58 req/s and 161 req/s),
and the longest wait grew with the soak's duration.  The waits below are virtual time (the
simulator's clock), not wall time.
"""

from __future__ import annotations

import json

import pytest

from lightllm.benchmark.simulator import __main__ as simulator_cli
from lightllm.benchmark.simulator.cost_model import load_profile
from lightllm.benchmark.simulator import soak
from lightllm.benchmark.simulator.soak import SoakConfig, estimate_capacity_rate, run_soak
from simulator_test_support import assert_refused_in_one_line

H100 = load_profile("h100_qwen_0p8b")


@pytest.mark.parametrize("overrides, binding", [
    ({}, "prefill"),  # the documented default: 8K prompts fill the budget first
    ({"running_max_req_size": 16}, "running"),
    ({"long_len": 100}, "running"),  # short prompts: 256 running requests bind before the budget
])
def test_the_limit_that_binds_first_sets_the_capacity(overrides, binding):
    cfg = SoakConfig(hours=0.01, **overrides)
    bounds = soak.capacity_bounds(H100, cfg)
    assert min(bounds, key=bounds.get) == binding


def test_the_default_soak_rate_is_unchanged():
    """docs/EN/simulator.md quotes 12.6 req/s for the default stream; the prefill budget binds there."""
    assert round(0.7 * estimate_capacity_rate(H100, SoakConfig(hours=1.0)), 2) == 12.58


def test_the_running_cap_lowers_the_rate():
    capped = estimate_capacity_rate(H100, SoakConfig(hours=1.0, running_max_req_size=16))
    assert capped < 0.7 * estimate_capacity_rate(H100, SoakConfig(hours=1.0))


@pytest.mark.parametrize("overrides", [{"running_max_req_size": 16}, {"long_len": 100}])
def test_seventy_percent_load_leaves_no_growing_backlog(overrides):
    """At 70% of capacity the typical request barely waits; an overload makes the median wait
    grow with the soak (the tester's 0.04 h run: p50 7.2 s with the cap of 16)."""
    result = run_soak(H100, "default", SoakConfig(hours=0.02, **overrides))
    assert result.p50_wait_s < 0.2
    assert result.max_wait_s < 3.0


def test_an_empty_soak_stream_names_the_flags(capsys):
    assert_refused_in_one_line(simulator_cli.main, ["--soak-hours", "0.0000001"],
                               "--soak-hours 1e-07 at 12.58 req/s (the default load 0.7 x the capacity estimated from "
                               "--profile h100_qwen_0p8b) draws no request (seed 0): the soak stream would be empty; "
                               "raise --soak-hours or --soak-load", capsys)
    assert_refused_in_one_line(simulator_cli.main, ["--soak-hours", "0.0000001", "--soak-rate", "2"],
                               "(--soak-rate) draws no request (seed 0): the soak stream would be empty; raise "
                               "--soak-hours or --soak-rate", capsys)


def test_an_empty_soak_stream_names_the_fields_for_api_callers():
    with pytest.raises(ValueError, match=r"^hours 1e-07 at 2 req/s \(request_rate\) draws no request"):
        run_soak(H100, "default", SoakConfig(hours=1e-7, request_rate=2.0))


def test_a_soak_run_writes_its_json_and_markdown(tmp_path, capsys):
    """The overtaking bound's spec is written as its parameters (a cached exact fraction beside
    them once made the JSON writer fail after the whole run, writing nothing)."""
    out_json, out_md = tmp_path / "soak.json", tmp_path / "soak.md"
    simulator_cli.main(["--soak-hours", "0.002", "--strategies", "default", "--json", str(out_json),
                        "--markdown", str(out_md)])
    document = json.loads(out_json.read_text())
    assert document["results"] and out_md.read_text().strip()
    assert "_exact_fraction" not in out_json.read_text()
