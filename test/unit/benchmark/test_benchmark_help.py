"""``--help`` of the benchmark tools describes every flag (49 flags of these five had none).

The simulator tools are checked in ``test_simulator_cli_one_line.py``, compare_strategies in
``test_compare_strategies_help.py``.
"""

from __future__ import annotations

import argparse

import pytest
from cli_refusal_support import flags_without_help, parser_of

from lightllm.benchmark import bench_burst, bench_hf_baseline, bench_runtime, bench_serving, process_footprint

TOOLS = {
    "bench_serving": bench_serving.main,
    "bench_burst": bench_burst.main,
    "bench_runtime": bench_runtime.main,
    "bench_hf_baseline": bench_hf_baseline.main,
    "process_footprint": process_footprint.main,
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_flag_has_a_description(tool, monkeypatch):
    assert flags_without_help(parser_of(TOOLS[tool], monkeypatch)) == []


def test_the_workload_flags_say_which_workloads_read_them(monkeypatch):
    helps = {action.option_strings[0]: action.help for action in parser_of(bench_serving.main, monkeypatch)._actions
             if action.option_strings}
    assert helps["--long-count"].startswith("long_first:") and "(default 48)" in helps["--long-count"]
    assert helps["--request-rate"].startswith("interleaved, sustained, shared_prefix:")
    assert "shared_prefix" in helps["--shared-prefix-len"]


@pytest.mark.parametrize("tool", ["bench_serving", "bench_burst"])
def test_the_server_tools_say_where_the_api_key_comes_from(tool, monkeypatch):
    helps = {action.option_strings[0]: action.help for action in parser_of(TOOLS[tool], monkeypatch)._actions
             if action.option_strings}
    assert "OPENAI_API_KEY" in helps["--api-key"] and "Authorization: Bearer" in helps["--api-key"]


def test_bench_burst_gives_every_default(monkeypatch):
    # --model and --api-key say where their default comes from instead of a value.
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    for action in parser_of(bench_burst.main, monkeypatch)._actions:
        if action.option_strings and action.default not in (None, argparse.SUPPRESS):
            assert f"(default {action.default})" in action.help, action.option_strings
