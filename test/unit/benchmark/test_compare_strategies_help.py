"""``compare_strategies --help`` describes every flag (``--confidence`` and the workload flags had none)."""

from __future__ import annotations

from cli_refusal_support import flags_without_help

from lightllm.benchmark import compare_strategies


def test_every_flag_has_a_description():
    assert flags_without_help(compare_strategies.build_parser()) == []


def test_confidence_says_what_it_takes():
    [confidence] = [a for a in compare_strategies.build_parser()._actions if "--confidence" in a.option_strings]
    assert "(0, 1)" in (confidence.help or "") and "0.95" in confidence.help, confidence.help
