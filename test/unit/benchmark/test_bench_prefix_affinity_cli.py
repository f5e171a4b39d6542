"""bench_prefix_affinity refuses every bad flag in one line before a PD cluster starts.

Bad values were ValueError tracebacks naming WorkloadConfig fields, a negative --affinity or a
--kv-tokens of 0 a node's refusal after a cluster had started, a --prefix-tokens beyond the
context a run into a 90 s timeout, a repeated --affinity value a second identical run; and the
clusters' ports could not be confined to a range.
"""

from __future__ import annotations

import pytest
from cli_refusal_support import flags_without_help, one_line_refusal, parser_of

from lightllm.benchmark import bench_prefix_affinity
from lightllm.benchmark.port_range import PortRange
from lightllm.benchmark.prefix_affinity_flags import affinity_values, cluster_topology


def _never(*args, **kwargs):
    raise AssertionError("a cluster was started before the flags were checked")


@pytest.mark.parametrize("argv, named", [
    (["--request-rate", "0"], "--request-rate"),
    (["--duration", "0"], "--duration"),
    (["--warmup-duration", "-1"], "--warmup-duration"),
    (["--output-len", "0"], "--output-len"),
    (["--short-len", "0"], "--short-len"),
    (["--prefix-groups", "0"], "--prefix-groups"),
    (["--chat-turns", "0"], "--chat-turns"),
    (["--kv-tokens", "0"], "--kv-tokens"),
    (["--affinity", "-1"], "--affinity"),
    (["--affinity", "256,x"], "--affinity"),
    (["--affinity", "0,0"], "twice"),
    (["--ports", "45200"], "--ports"),
    (["--host", "no.such.host.invalid"], "--host"),
])
def test_a_bad_value_is_refused_naming_its_flag(argv, named, tiny_llama_dir, monkeypatch, capsys):
    monkeypatch.setattr(bench_prefix_affinity, "run", _never)
    line = one_line_refusal(bench_prefix_affinity.main, ["--model_dir", str(tiny_llama_dir), *argv], capsys)
    assert named in line, line


def test_a_prompt_beyond_the_context_is_refused_before_any_cluster(tiny_llama_dir, monkeypatch, capsys):
    monkeypatch.setattr(bench_prefix_affinity, "run", _never)
    line = one_line_refusal(bench_prefix_affinity.main,
                            ["--model_dir", str(tiny_llama_dir), "--prefix-tokens", "2000"], capsys)
    assert "--prefix-tokens" in line and "context" in line and "prefix_tokens" not in line, line


def test_a_kv_cache_smaller_than_the_context_is_refused(tiny_llama_dir, monkeypatch, capsys):
    monkeypatch.setattr(bench_prefix_affinity, "run", _never)
    line = one_line_refusal(bench_prefix_affinity.main, ["--model_dir", str(tiny_llama_dir), "--kv-tokens", "100"],
                            capsys)
    assert "--kv-tokens 100" in line and "context" in line, line


def test_an_empty_warm_up_names_the_warm_up_flag(tiny_llama_dir, monkeypatch, capsys):
    monkeypatch.setattr(bench_prefix_affinity, "run", _never)
    line = one_line_refusal(bench_prefix_affinity.main, ["--model_dir", str(tiny_llama_dir), "--request-rate", "0.01",
                                                         "--warmup-duration", "1"], capsys)
    assert "--warmup-duration" in line and "duration_s" not in line, line


def test_a_prefix_the_prompt_builder_cannot_make_is_refused(tiny_llama_dir, monkeypatch, capsys):
    monkeypatch.setattr(bench_prefix_affinity, "run", _never)
    line = one_line_refusal(bench_prefix_affinity.main, ["--model_dir", str(tiny_llama_dir), "--prefix-tokens", "1"],
                            capsys)
    assert "--prefix-tokens" in line and "special" in line, line


def test_a_port_range_too_small_for_every_setting_is_refused(tiny_llama_dir, monkeypatch, capsys):
    monkeypatch.setattr(bench_prefix_affinity, "run", _never)
    # One 1p1d cluster takes 4 ports (master, prefill, decode, the prefill node's transfer port): 8 for two.
    line = one_line_refusal(bench_prefix_affinity.main, ["--model_dir", str(tiny_llama_dir), "--topology", "1p1d",
                                                         "--ports", "45200-45206"], capsys)
    assert "--ports 45200-45206" in line and "2 --affinity settings" in line, line


def test_the_clusters_take_their_ports_from_the_range(tiny_llama_dir):
    args = bench_prefix_affinity.build_parser().parse_args(
        ["--model_dir", str(tiny_llama_dir), "--ports", "45200-45299", "--host", "127.0.0.1"])
    topology = cluster_topology(args, 0)
    assert topology.ports is args.ports and isinstance(topology.ports, PortRange)
    assert topology.master_args == ("--pd_prefix_affinity_tokens", "0") and topology.host == "127.0.0.1"


def test_affinity_values_are_distinct_non_negative_integers():
    assert affinity_values("256, 0,64") == [256, 0, 64]
    for bad in ("0,0", "-1", "1.5", "", "256,"):
        with pytest.raises(ValueError):
            affinity_values(bad)


def test_every_flag_has_a_description(monkeypatch):
    assert flags_without_help(parser_of(bench_prefix_affinity.main, monkeypatch)) == []
